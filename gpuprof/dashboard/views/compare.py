"""Compare page: run B against run A (e.g. baseline vs optimized) with the noise measured: the
conclusion line, every figure with its interval, the comparability contract's differences, both
runs' step-time distributions, the findings that appeared or disappeared, their timelines overlaid.
With more than two runs selected, B is the last and A is a baseline of the others (their steps pooled,
or their median run), as `gpuprof compare A_FOLDER B` does."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from gpuprof.dashboard import data
from gpuprof.dashboard.charts import step_time_distribution_panel, trace_steps_panel
from gpuprof.dashboard.views.common import (
    escape_markdown, need_runs, section, show_findings, show_not_in_a_trace, show_panel, show_verdict,
)
from gpuprof.report import compare
from gpuprof.report.comparison import contract_lines, distribution_rows, figure_rows, figures_caption
from gpuprof.report.gate import POOLINGS
from gpuprof.report.page_views import compare_kpis
from gpuprof.report.trace_views import DIFF_TITLE

FIGURE_COLUMNS = {
    "Figure": st.column_config.TextColumn("Figure", width="medium"),
    "A": st.column_config.TextColumn("A", help="A's value [its confidence interval]"),
    "B": st.column_config.TextColumn("B", help="B's value [its confidence interval]"),
    "B vs A": st.column_config.TextColumn("B vs A", help="B over A (×), or B minus A in percentage points (pp)"),
    "Call": st.column_config.TextColumn("Call", help="a winner only where the whole interval says so"),
}


# A figure's small print is grey where its interval names no winner, else green for B, red for A.
KPI_COLORS = {"B better": "normal", "A better": "inverse"}


def headline(comparison) -> None:
    """The conclusion, then the speedup, throughput and peak memory ratios, each with its interval."""
    (st.warning if comparison.blocking else st.success)(escape_markdown(comparison.conclusion))
    for column, kpi in zip(st.columns(3), compare_kpis(comparison)):
        column.metric(kpi.label, kpi.value, delta=kpi.note or None, delta_arrow="off",
                      delta_color=KPI_COLORS.get(kpi.call, "off"))


def findings_column(column, title: str, findings: list) -> None:
    with column:
        st.subheader(title)
        if findings:
            show_findings(findings)
        else:
            st.info("No findings.")


def baseline_pooling(baseline: list) -> str:
    """How a baseline of several runs makes side A (asked only when there are several)."""
    if len(baseline) == 1:
        return POOLINGS[0]
    return st.radio("Baseline A of several runs", POOLINGS, horizontal=True, key="compare_pooling",
                    help="pooled: every run's measured steps together; median: the run of median mean step time")


def render(root, entries, selected) -> None:
    if not need_runs(selected, 2, "Compare"):
        return
    baseline, entry_b = selected[:-1], selected[-1]
    entry_a = baseline[0]
    names_a = ", ".join(f"`{entry.name}`" for entry in baseline)
    st.header(f"Compare · A {names_a} vs B `{entry_b.name}`")
    comparison = None
    with section("Comparison"):
        pooling = baseline_pooling(baseline)
        comparison = compare([entry.report for entry in baseline], entry_b.report, pooling=pooling)
        headline(comparison)
        if len(baseline) > 1:
            st.caption(f"A: {escape_markdown(comparison.a_side.label)}")
        for label, entry in (*(("A", entry) for entry in baseline), ("B", entry_b)):
            st.caption(f"{label} `{entry.name}`")
            show_verdict(entry.report.verdict)
        st.caption(figures_caption(comparison))
        st.dataframe(pd.DataFrame(figure_rows(comparison)), hide_index=True, column_config=FIGURE_COLUMNS,
                     key="compare_figures")
        st.markdown("**Comparability contract** (checked from what the runs recorded)\n\n"
                    + "\n".join(f"- {escape_markdown(line)}" for line in contract_lines(comparison)))
    if comparison is None:
        return
    with section("Step-time distributions"):
        times = {f"{label}: {side.label}": side.steps["step_time_s"].dropna().to_numpy()
                 for label, side in (("A", comparison.a_side), ("B", comparison.b_side))}
        show_panel(step_time_distribution_panel(times))
        st.dataframe(pd.DataFrame(distribution_rows(comparison)), hide_index=True, key="compare_distributions")
    with section("Diagnoses"):
        left, right = st.columns(2)
        findings_column(left, "Findings that appeared in B", comparison.appeared)
        findings_column(right, "Findings gone in B", comparison.disappeared)
        if comparison.persisted:
            st.caption(f"In both runs: {', '.join(comparison.persisted)}")
    if entry_a.bare_trace or entry_b.bare_trace:
        show_traced_steps(entry_a, entry_b)
        return
    with section("Timelines"):
        for panel in data.overlay_panels(str(entry_a.path), entry_a.signature, str(entry_b.path), entry_b.signature):
            show_panel(panel)


def show_traced_steps(*entries) -> None:
    """Where one side is a plain trace: each side's traced step breakdown, and what overlaid timelines need."""
    with section("Traced steps"):
        for label, column, entry in zip("AB", st.columns(2), entries):
            windows = [window for window in entry.report.trace_windows if window.error is None]
            with column:
                st.caption(f"{label} `{entry.name}`")
                if windows:
                    show_panel(trace_steps_panel(windows[-1].tables["step_breakdown"]), key=label)
                else:
                    st.info("No readable trace window.")
    if all(entry.bare_trace for entry in entries):
        with section("By kernel and op"):
            st.subheader(DIFF_TITLE)
            st.dataframe(data.traces_diff(*(value for entry in entries for value in (str(entry.path), entry.signature))),
                         hide_index=True, key="traces_diff")
    show_not_in_a_trace("overlaying step time and throughput over the two runs", ("steps",))
