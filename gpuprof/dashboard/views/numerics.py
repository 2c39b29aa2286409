"""Numerics page: where a value first went NaN/Inf (step, module, pass, op, tensor), the events
around it, the GradScaler's view, and the command that replays the step."""

from __future__ import annotations

import shlex
from pathlib import Path

import pandas as pd
import streamlit as st

from gpuprof.dashboard.charts import loss_panel, scaler_panel
from gpuprof.dashboard.views.common import (
    escape_markdown, need_runs, section, show_findings, show_not_in_a_trace, show_panel,
)
from gpuprof.report.format import MISSING, field_text, figure, known, value_text
from gpuprof.run.schema import BLAME_PHASES, bundle_in_run

EVENT_COLUMNS = {
    "time": st.column_config.DatetimeColumn("time (UTC)", format="HH:mm:ss.SSS"),
    "step": st.column_config.TextColumn("step", help="n/a: an event of the run, not of a step"),
}
BLAME_FIELDS = ("step", "rank", "phase", "module", "op", "first", "tensor", "dtype", "shape",
                "nonfinite_count", "input_absmax", "source", "micro_batch", "trigger")


def blame_fields(event: pd.Series) -> pd.DataFrame:
    """Field/value rows of one non-finite event: where it happened, the tensor, and the cause found."""
    details = event["details"] if isinstance(event["details"], dict) else {}
    fields = {"step": event["step"], "rank": event["rank"]}
    fields.update({name: details.get(name) for name in BLAME_FIELDS if name not in fields})
    cause = details.get("cause")
    if isinstance(cause, dict) and cause.get("summary"):
        fields["cause"] = cause["summary"]
    shown = {name: value for name, value in fields.items() if value is not None and value == value}
    return pd.DataFrame({"field": list(map(field_text, shown)), "value": [_text(value) for value in shown.values()]})


def _text(value) -> str:
    """A blame field; its lists are tensor shapes."""
    return " × ".join(map(str, value)) if isinstance(value, (list, tuple)) else value_text(value)


def readable_events(events: pd.DataFrame) -> pd.DataFrame:
    """The events with their clock time as a time, their step as a whole number (n/a for the run's own) and
    their kind in words."""
    steps = events["step"].map(lambda step: str(int(step)) if known(step) else MISSING)
    shown = events.drop(columns=["time_unix_s"]).assign(step=steps, kind=events["kind"].map(field_text))
    return shown.assign(time=pd.to_datetime(events["time_unix_s"], unit="s"))[["time", *shown.columns]]


def replay_bundle(run_path: Path, event: pd.Series) -> Path | None:
    details = event["details"] if isinstance(event["details"], dict) else {}
    return bundle_in_run(run_path, details["bundle"]) if details.get("bundle") else None


def show_blame(entry, event: pd.Series) -> None:
    st.markdown(f":red[**{escape_markdown(event['message'])}**]")
    st.table(blame_fields(event).set_index("field"))
    phase = (event["details"] if isinstance(event["details"], dict) else {}).get("phase")
    if phase in BLAME_PHASES:
        st.caption(f"Phase {phase}: {BLAME_PHASES[phase]}.")
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
    if entry.bare_trace:
        show_not_in_a_trace("NaN forensics (where a value first went non-finite)", ("numerics",))
        return
    report = entry.report
    others = len(report.findings) - len(report.findings_in("numerics"))
    show_findings(report.findings_in("numerics"), "No numerics findings" + (
        f" (the Run page lists this run's {others} other finding{'s' * (others != 1)})." if others else "."))
    with section("Non-finite values"):
        st.subheader("Where a value first went non-finite")
        if report.blames.empty:
            health = report.summary.health
            st.success(
                f"No NaN/Inf recorded: {figure(health['nonfinite_loss_steps'])} non-finite loss steps, "
                f"{health['nonfinite_grad_steps']} non-finite gradient steps, "
                f"{health['skipped_steps']} steps skipped by GradScaler."
            )
        else:
            for _, event in report.blames.iterrows():
                show_blame(entry, event)
            st.subheader("Events around it")
            st.dataframe(readable_events(report.blame_chain), hide_index=True, column_config=EVENT_COLUMNS,
                         key="chain_table")
    with section("Loss and GradScaler"):
        query = report.run.query
        ranks = query.ranks_with_steps
        steps = query.rank_frame("steps", ranks[0]) if ranks else query.frame("steps", limit=0)
        if not steps.empty:
            show_panel(loss_panel(steps))
            show_panel(scaler_panel(steps))
