"""Numerics page: where a value first went NaN/Inf (step, module, pass, op, tensor), the events
around it, the GradScaler's view, and the command that replays the step."""

from __future__ import annotations

import shlex
from pathlib import Path

import pandas as pd
import streamlit as st

from gpuprof.dashboard.charts import loss_panel, scaler_panel
from gpuprof.dashboard.views.common import escape_markdown, need_runs, section, show_findings, show_panel
from gpuprof.diagnoses.rules.numerics import NONFINITE_EVENT_KINDS
from gpuprof.run.schema import NUMERICS_DIR

NUMERICS_RULES = ("nonfinite-values", "gradscaler-trouble", "lr-step-on-skipped")
BLAME_FIELDS = ("step", "rank", "phase", "module", "op", "first", "tensor", "dtype", "shape",
                "nonfinite_count", "input_absmax", "source", "micro_batch", "trigger")
# Events this many steps before the first bad one are the "chain" that led to it.
CHAIN_STEPS_BEFORE = 5


def blame_fields(event: pd.Series) -> pd.DataFrame:
    """Field/value rows of one non-finite event: where it happened, the tensor, and the cause found."""
    details = event["details"] if isinstance(event["details"], dict) else {}
    fields = {"step": event["step"], "rank": event["rank"]}
    fields.update({name: details.get(name) for name in BLAME_FIELDS if name not in fields})
    cause = details.get("cause")
    if isinstance(cause, dict) and cause.get("summary"):
        fields["cause"] = cause["summary"]
    shown = {name: value for name, value in fields.items() if value is not None and value == value}
    return pd.DataFrame({"field": list(shown), "value": [_text(value) for value in shown.values()]})


def _text(value) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (list, tuple)):
        return " × ".join(map(str, value))
    return str(value)


def chain(events: pd.DataFrame, first_step: int | None) -> pd.DataFrame:
    if first_step is None or events.empty:
        return events
    steps = pd.to_numeric(events["step"], errors="coerce")
    near = events[(steps >= first_step - CHAIN_STEPS_BEFORE) & (steps <= first_step + 1) | steps.isna()]
    return near.sort_values("time_unix_s")[["time_unix_s", "step", "rank", "kind", "severity", "message"]]


def bundle_path(run_path: Path, recorded: str) -> Path:
    """The replay bundle in this run's numerics folder, where the run format keeps it: the path
    recorded at training time is relative to that process's working folder, or to a machine the
    run may since have left."""
    return run_path / NUMERICS_DIR / Path(recorded).name


def replay_bundle(run_path: Path, event: pd.Series) -> Path | None:
    details = event["details"] if isinstance(event["details"], dict) else {}
    return bundle_path(run_path, details["bundle"]) if details.get("bundle") else None


def show_blame(entry, event: pd.Series) -> None:
    st.markdown(f":red[**{escape_markdown(event['message'])}**]")
    st.table(blame_fields(event).set_index("field"))
    bundle = replay_bundle(entry.path, event)
    if bundle is not None:
        st.caption("Replay the step on this machine and print the same blame:")
        st.code(f"gpuprof replay {shlex.quote(str(bundle))}", language="bash")
        if not bundle.is_file():
            st.caption(f"The bundle {bundle.name} is not in this copy of the run (bundles hold the model "
                       "and optimizer state, so shared copies often leave them out).")


def render(root, entries, selected) -> None:
    if not need_runs(selected, 1, "Numerics"):
        return
    entry = selected[0]
    st.header(f"Numerics · `{entry.name}`")
    show_findings([f for f in entry.findings if f.rule in NUMERICS_RULES] or [])
    run = entry.load()
    events = run.query.frame("events")
    blame = events[events["kind"].isin(NONFINITE_EVENT_KINDS)] if not events.empty else events
    with section("Non-finite values"):
        st.subheader("Where a value first went non-finite")
        if blame.empty:
            health = entry.summary.health
            st.success(
                f"No NaN/Inf recorded: {health['nonfinite_loss_steps']} non-finite loss steps, "
                f"{health['nonfinite_grad_steps']} non-finite gradient steps, "
                f"{health['skipped_steps']} steps skipped by GradScaler."
            )
        else:
            for _, event in blame.iterrows():
                show_blame(entry, event)
            first_step = pd.to_numeric(blame["step"], errors="coerce").min()
            st.subheader("Events around it")
            st.dataframe(chain(events, None if pd.isna(first_step) else int(first_step)),
                         hide_index=True, key="chain_table")
    with section("Loss and GradScaler"):
        ranks = run.query.ranks_with_steps
        steps = run.query.rank_frame("steps", ranks[0]) if ranks else run.query.frame("steps", limit=0)
        if not steps.empty:
            show_panel(loss_panel(steps))
            show_panel(scaler_panel(steps))
