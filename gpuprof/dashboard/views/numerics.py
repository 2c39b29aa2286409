"""Numerics page: where a value first went NaN/Inf (step, module, pass, op, tensor), the events
around it, the GradScaler's view, and the command that replays the step."""

from __future__ import annotations

import shlex

import pandas as pd
import streamlit as st

from gpuprof.dashboard.charts import loss_panel, scaler_panel
from gpuprof.dashboard.views.common import (
    escape_markdown, need_runs, section, show_findings, show_not_in_a_trace, show_panel, show_rows,
)
from gpuprof.report.format import MISSING, field_text, figure, known
from gpuprof.report.page_views import blame_rows, events_around, replay_bundle
from gpuprof.run.schema import BLAME_PHASES

EVENT_COLUMNS = {
    "time": st.column_config.DatetimeColumn("time (UTC)", format="HH:mm:ss.SSS"),
    "step": st.column_config.TextColumn("step", help="n/a: an event of the run, not of a step"),
}
def readable_events(events: pd.DataFrame) -> pd.DataFrame:
    """The events with their clock time as a time, their step as a whole number (n/a for the run's own) and
    their kind in words."""
    steps = events["step"].map(lambda step: str(int(step)) if known(step) else MISSING)
    shown = events.drop(columns=["time_unix_s"]).assign(step=steps, kind=events["kind"].map(field_text))
    return shown.assign(time=pd.to_datetime(events["time_unix_s"], unit="s"))[["time", *shown.columns]]


def show_blame(entry, event: pd.Series, titles: str) -> None:
    """One blame, once: its line where no finding's title (`titles`) already says it, then its fields with the
    line to start at, and the replay command where this copy of the run holds the bundle."""
    details = event["details"] if isinstance(event["details"], dict) else {}
    if event["message"] not in titles:
        st.markdown(f":red[**{escape_markdown(event['message'])}**]")
    show_rows(blame_rows(event["step"], event["rank"], details))
    if details.get("phase") in BLAME_PHASES:
        st.caption(f"Phase {details['phase']}: {BLAME_PHASES[details['phase']]}.")
    bundle = replay_bundle(entry.path, details)
    if bundle is not None:
        st.caption("Replay the step on this machine and print the same blame:")
        st.code(f"gpuprof replay {shlex.quote(str(bundle))}", language="bash")


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
    findings = report.findings_in("numerics")
    show_findings(findings, "No numerics findings" + (
        f" (the Run page lists this run's {others} other finding{'s' * (others != 1)})." if others else "."),
        blame_shown=not report.blames.empty)
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
            titles = " ".join(finding.title for finding in findings)
            for _, event in report.blames.iterrows():
                show_blame(entry, event, titles)
            st.subheader("Events around it")
            st.dataframe(readable_events(events_around(report.blame_chain, report.blames)), hide_index=True,
                         column_config=EVENT_COLUMNS, key="chain_table")
    with section("Loss and GradScaler"):
        query = report.run.query
        ranks = query.ranks_with_steps
        steps = query.rank_frame("steps", ranks[0]) if ranks else query.frame("steps", limit=0)
        if not steps.empty:
            show_panel(loss_panel(steps))
            show_panel(scaler_panel(steps))
