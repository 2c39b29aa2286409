"""Distributed page: hangs and how each rank ended, step time and phases per rank, stragglers, and the
share of communication."""

from __future__ import annotations

import streamlit as st

from gpuprof.dashboard import data
from gpuprof.dashboard.charts import rank_phase_panel
from gpuprof.dashboard.views.common import (
    need_runs, section, show_findings, show_frame, show_not_in_a_trace, show_panel,
)
from gpuprof.report.format import rank_list
from gpuprof.report.frames import units_view
from gpuprof.report.trace_views import TABLE_TITLES, empty_table_note, frame_view
from gpuprof.report.verdict import HOW_TO_RECORD

SLOWEST_SHOWN = 10
# The trace window's tables about ranks and communication, shown below the per-rank figures.
COMMUNICATION_TABLES = ("rank_spread", "stragglers", "comm_comp_overlap")


def render(root, entries, selected) -> None:
    if not need_runs(selected, 1, "Distributed"):
        return
    entry = selected[0]
    st.header(f"Distributed · `{entry.name}`")
    summary = entry.report.summary
    stopped = not entry.bare_trace and show_stops(entry)  # a bare trace records no heartbeat nor rank status
    if summary.world_size <= 1:
        st.info(f"`{entry.name}` ran as a single process: nothing to compare across ranks. "
                "Record a run under torchrun (e.g. `torchrun --nproc-per-node 2 -m gpuprof train ...`).")
        return
    if entry.bare_trace:
        show_traced_ranks(entry)
        return
    st.caption(f"{summary.world_size} ranks · figures after warm-up ({summary.warmup.reason}).")
    if summary.missing_ranks:
        st.warning(f"{len(summary.missing_ranks)} rank(s) left no readable steps and are not shown: "
                   f"{rank_list(summary.missing_ranks)}.")
    st.subheader("Stragglers and communication")
    show_findings(entry.report.findings_in("communication"))
    slowest = entry.report.ranks_by_slowness.head(SLOWEST_SHOWN)
    with section("Slowest ranks"):
        st.subheader("Slowest ranks")
        st.caption("Ranked by own work per step (the phases outside DDP's all-reduce), against the median rank.")
        show_frame(units_view(slowest), "slowest_ranks")
    with section("Ranks over the run"):
        heatmaps = data.rank_heatmaps(str(entry.path), entry.signature)
        shown = st.selectbox("Heatmap", list(heatmaps), key="rank_heatmap")
        show_panel(heatmaps[shown])
    with section("One rank"):
        st.subheader("One rank")
        ranks = [int(rank) for rank in summary.per_rank["rank"]] if not summary.per_rank.empty else [0]
        default = int(slowest["rank"].iloc[0]) if not slowest.empty else ranks[0]
        rank = st.selectbox("Rank", ranks, index=ranks.index(default), key="dist_rank",
                            help="Its steps are read when picked; the slowest rank first.")
        for panel in data.rank_detail(str(entry.path), entry.signature, rank):
            show_panel(panel)
    with section("Per-rank figures"):
        st.subheader("Per-rank figures")
        show_frame(units_view(summary.per_rank), "per_rank_table")
        show_panel(rank_phase_panel(summary.per_rank))
    with section("Communication"):
        show_communication(entry.report)
    if not stopped:
        with section("Ranks over time"):
            show_panel(data.rank_timeline(str(entry.path), entry.signature))


def show_stops(entry) -> bool:
    """Hangs, ranks that never finished, and every rank's heartbeats over time, first: a stopped run's
    speed is not the question. False (nothing shown) for a run that neither hung nor lost a rank."""
    report = entry.report
    stopped = report.stopped_ranks
    if report.hangs.empty and stopped.empty:
        return False
    with section("Hangs and ranks"):
        st.subheader("Hangs and ranks")
        show_findings(report.findings_in("failure"))
        for number, row in enumerate(report.distinct_hangs.to_dict(orient="records")):
            text = f"**Step {row['step']}, seen by rank {row['rank']}**: {row['message']}"
            if row["ended"]:
                st.success(f"{text} (it went on later)")
            else:
                st.error(text)
            for rank, stack in row["stacks"].items():
                with st.expander(f"Stack of rank {rank} (hang {number + 1})"):
                    st.code(stack, language="text")
        st.dataframe(report.rank_outcomes.drop(columns=["traceback"]), hide_index=True, key="rank_outcomes")
        for row in stopped.dropna(subset=["traceback"]).head(SLOWEST_SHOWN).to_dict(orient="records"):
            with st.expander(f"Traceback of rank {row['rank']}: {row['error']}"):
                st.code(row["traceback"], language="text")
        show_panel(data.rank_timeline(str(entry.path), entry.signature))
    return True


def show_traced_ranks(entry) -> None:
    """A plain trace folder's workers as ranks: computation, communication, overlap and waiting per rank."""
    report = entry.report
    st.caption(f"{len(report.ranks)} of {report.summary.world_size} ranks traced (one file per worker).")
    st.subheader("Stragglers and communication")
    show_findings(report.findings_in("communication"))
    with section("Communication"):
        show_communication(report)
    show_not_in_a_trace("the per-step figures of every rank over the run (heatmaps, slowest ranks by phase)",
                        ("steps", "phases"))


def show_communication(report) -> None:
    """Step spread, stragglers and communication overlap per rank, from the run's first trace window."""
    if not report.trace_windows:
        st.info(f"This run has no trace window, which communication time needs. "
                f"Record {HOW_TO_RECORD['trace window']}.")
        return
    window = report.trace_windows[-1] if report.bare_trace else report.trace_windows[0]
    if window.error is not None:
        st.error(f"Trace window {window.name}: {window.error}")
        return
    for name in COMMUNICATION_TABLES:
        st.subheader(f"{TABLE_TITLES[name]} (trace window {window.name})")
        if window.tables[name].empty:
            st.info(empty_table_note(name, window.has_device_activity))
        else:
            show_frame(frame_view(name, window.tables[name]), f"dist_{name}")
