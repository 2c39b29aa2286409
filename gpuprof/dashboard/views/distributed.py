"""Distributed page: step time and phases per rank, stragglers, and the share of communication."""

from __future__ import annotations

import streamlit as st

from gpuprof.analysis.run.summary import slowest_ranks
from gpuprof.dashboard import data
from gpuprof.dashboard.charts import rank_phase_panel
from gpuprof.dashboard.views.common import need_runs, section, show_findings, show_panel

# Findings about how ranks work together, shown again here beside the per-rank evidence.
DISTRIBUTED_RULE_PREFIXES = ("rank-", "straggler", "comm", "ddp", "dataparallel", "non-nccl")
SLOWEST_SHOWN = 10


def render(root, entries, selected) -> None:
    if not need_runs(selected, 1, "Distributed"):
        return
    entry = selected[0]
    st.header(f"Distributed · `{entry.name}`")
    summary = entry.summary
    if summary.world_size <= 1:
        st.info(f"`{entry.name}` ran as a single process: nothing to compare across ranks. "
                "Record a run under torchrun (e.g. `torchrun --nproc-per-node 2 -m gpuprof train ...`).")
        return
    st.caption(f"{summary.world_size} ranks · figures after warm-up ({summary.warmup.reason}).")
    if summary.missing_ranks:
        st.warning(f"{len(summary.missing_ranks)} rank(s) left no readable steps and are not shown: "
                   f"{shorten(summary.missing_ranks)}.")
    findings = [f for f in entry.findings if f.rule.startswith(DISTRIBUTED_RULE_PREFIXES)]
    st.subheader("Stragglers and communication")
    show_findings(findings)
    slowest = slowest_ranks(summary.per_rank, SLOWEST_SHOWN)
    with section("Slowest ranks"):
        st.subheader("Slowest ranks")
        st.caption("Ranked by own work per step (the phases outside DDP's all-reduce), against the median rank.")
        st.dataframe(slowest, hide_index=True, key="slowest_ranks")
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
        st.dataframe(summary.per_rank, hide_index=True, key="per_rank_table")
        show_panel(rank_phase_panel(summary.per_rank))
    with section("Communication"):
        show_communication(entry)


def shorten(ranks: list[int], shown: int = 20) -> str:
    text = ", ".join(map(str, ranks[:shown]))
    return text + (f" and {len(ranks) - shown} more" if len(ranks) > shown else "")


TRACE_TABLE_TITLES = {
    "rank_spread": "Step time across ranks (trace window)",
    "stragglers": "Straggler candidates (trace window)",
    "comm_comp_overlap": "Communication time and its overlap with computation (trace window)",
}


def show_communication(entry) -> None:
    tables = data.communication_by_rank(entry)
    if not tables:
        st.info("This run has no trace window: record one with the profile's trace_steps to see communication time.")
        return
    for name, table in tables.items():
        st.subheader(TRACE_TABLE_TITLES[name])
        st.dataframe(table, hide_index=True, key=f"dist_{name}")
