"""Distributed page: step time and phases per rank, stragglers, and the share of communication."""

from __future__ import annotations

import streamlit as st

from gpuprof.dashboard import data
from gpuprof.dashboard.views.common import need_runs, section, show_findings, show_panel

# Findings about how ranks work together, shown again here beside the per-rank evidence.
DISTRIBUTED_RULE_PREFIXES = ("rank-", "straggler", "comm", "ddp", "dataparallel", "non-nccl")


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
    findings = [f for f in entry.findings if f.rule.startswith(DISTRIBUTED_RULE_PREFIXES)]
    st.subheader("Stragglers and communication")
    show_findings(findings)
    with section("Per-rank figures"):
        st.subheader("Per-rank figures")
        st.dataframe(summary.per_rank, hide_index=True, key="per_rank_table")
        for panel in data.rank_panels(str(entry.path), entry.signature, summary.per_rank):
            show_panel(panel)
    with section("Communication"):
        show_communication(entry)


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
