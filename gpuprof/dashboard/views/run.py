"""Run page: the diagnoses first, then the headline figures, then every timeline."""

from __future__ import annotations

import streamlit as st

from gpuprof.dashboard import data
from gpuprof.dashboard.format import device_label, fmt, fmt_gib, fmt_ms, fmt_pct
from gpuprof.dashboard.views.common import need_runs, section, show_findings, show_panel


def rank_picker(entry, key: str) -> int:
    """Rank 0 for single-process runs, else the rank the user picks (kept across reruns)."""
    if entry.summary.world_size <= 1:
        return 0
    return st.selectbox("Rank", list(range(entry.summary.world_size)), key=key)


def headline(entry) -> None:
    summary = entry.summary
    meta = entry.meta
    config = meta.get("config") or {}
    st.header(f"Run `{entry.name}`")
    st.caption(
        f"{entry.status} · {device_label(meta)} · "
        f"model {config.get('model_size') or (meta.get('model') or {}).get('class') or '—'} · "
        f"variant {config.get('variant') or '—'} · {summary.n_steps} steps"
    )
    columns = st.columns(5)
    columns[0].metric("Step time p50", fmt_ms(summary.step_time_p50_s))
    columns[1].metric("Tokens/s", fmt(summary.tokens_per_s, "{:,.0f}"))
    columns[2].metric("MFU", fmt_pct(summary.mfu))
    columns[3].metric("Peak memory", fmt_gib(summary.peak_memory_bytes),
                      help="torch's peak allocated on a GPU; the process RSS on a CPU")
    columns[4].metric("GPU utilization", fmt(summary.gpu_util_mean_pct, "{:.0f} %"))
    st.caption(f"Warm-up: {summary.warmup.reason}.")
    for note in entry.notes:
        st.warning(note)


def render(root, entries, selected) -> None:
    if not need_runs(selected, 1, "Run"):
        return
    entry = selected[0]
    headline(entry)
    st.subheader("Diagnoses")
    show_findings(entry.findings)
    rank = rank_picker(entry, key="run_rank")
    with section("Charts"):
        for panel in data.run_panels(str(entry.path), entry.signature, rank):
            show_panel(panel)
