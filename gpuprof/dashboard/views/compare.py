"""Compare page: two runs side by side (e.g. baseline vs optimized): speedup, memory saved,
findings that appeared or disappeared, and their timelines overlaid."""

from __future__ import annotations

import streamlit as st

from gpuprof.dashboard import data
from gpuprof.dashboard.charts import trace_steps_panel
from gpuprof.dashboard.views.common import (
    need_runs, section, show_findings, show_not_in_a_trace, show_panel, show_verdict,
)
from gpuprof.report import compare
from gpuprof.report.format import fmt_gib, fmt_ratio
from gpuprof.report.trace_views import DIFF_TITLE


def headline(comparison) -> None:
    a, b = comparison.a.summary, comparison.b.summary
    speedup = a.step_time_p50_s / b.step_time_p50_s if a.step_time_p50_s and b.step_time_p50_s else None
    throughput = b.tokens_per_s / a.tokens_per_s if a.tokens_per_s and b.tokens_per_s else None
    saved = (a.peak_memory_bytes - b.peak_memory_bytes
             if a.peak_memory_bytes is not None and b.peak_memory_bytes is not None else None)
    columns = st.columns(3)
    columns[0].metric("Speedup (step time p50, A/B)", fmt_ratio(speedup))
    columns[1].metric("Throughput (tokens/s, B/A)", fmt_ratio(throughput))
    columns[2].metric("Peak memory saved (A−B)", fmt_gib(saved))


def findings_column(column, title: str, findings: list) -> None:
    with column:
        st.subheader(title)
        if findings:
            show_findings(findings)
        else:
            st.info("None.")


def render(root, entries, selected) -> None:
    if not need_runs(selected, 2, "Compare"):
        return
    entry_a, entry_b = selected[:2]
    st.header(f"Compare · A `{entry_a.name}` vs B `{entry_b.name}`")
    with section("Comparison"):
        comparison = compare(entry_a.report, entry_b.report)
        headline(comparison)
        for label, entry in (("A", entry_a), ("B", entry_b)):
            st.caption(f"{label} `{entry.name}`")
            show_verdict(entry.report.verdict)
        st.dataframe(comparison.metrics, hide_index=True, key="compare_metrics")
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
