"""Run page: the verdict and the diagnoses first, then the headline figures, then every timeline."""

from __future__ import annotations

import streamlit as st

from gpuprof.dashboard import data
from gpuprof.dashboard.charts import trace_steps_panel
from gpuprof.dashboard.views.common import (
    need_runs, section, show_findings, show_not_in_a_trace, show_panel, show_verdict,
)
from gpuprof.report.format import device_label, headline_figures, workload_label

METRIC_HELP = {"Peak memory": "torch's peak allocated on a GPU; the process RSS on a CPU"}


def rank_picker(entry, key: str) -> int:
    """Rank 0 for single-process runs, else the rank the user picks (kept across reruns)."""
    world_size = entry.report.summary.world_size
    if world_size <= 1:
        return 0
    return st.selectbox("Rank", list(range(world_size)), key=key)


def headline(entry) -> None:
    summary = entry.report.summary
    meta = entry.meta
    st.header(f"Run `{entry.name}`")
    st.caption(f"{entry.status} · {device_label(meta)} · {workload_label(meta)} · {summary.n_steps} steps")
    figures = headline_figures(summary)
    for column, (label, text) in zip(st.columns(len(figures)), figures.items()):
        column.metric(label, text, help=METRIC_HELP.get(label))
    st.caption(f"Warm-up: {summary.warmup.reason}.")
    for note in entry.report.notes:
        st.warning(note)


def render(root, entries, selected) -> None:
    if not need_runs(selected, 1, "Run"):
        return
    entry = selected[0]
    headline(entry)
    show_verdict(entry.report.verdict)
    st.subheader("Diagnoses")
    show_findings(entry.report.findings)
    if entry.bare_trace:
        show_trace_charts(entry)
        return
    rank = rank_picker(entry, key="run_rank")
    with section("Charts"):
        for panel in data.run_panels(str(entry.path), entry.signature, rank):
            show_panel(panel)


def show_trace_charts(entry) -> None:
    """A plain trace's step breakdown (its latest span), and what the run's timelines would need."""
    with section("Charts"):
        show_panel(trace_steps_panel(entry.report.tables["step_breakdown"]))
    show_not_in_a_trace("step time, throughput, memory and GPU utilization over the run",
                        ("steps", "device metrics"))
