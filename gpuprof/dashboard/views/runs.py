"""Runs page: every run under the folder with its verdict and headline figures; runs that cannot be read say why."""

from __future__ import annotations

from functools import partial

import pandas as pd
import streamlit as st

from gpuprof.dashboard import MAX_SELECTED_RUNS
from gpuprof.report.format import GIB, MISSING, device_label, model_label, variant_label


def _row(entry) -> dict:
    report, meta = entry.report, entry.meta
    summary = report.summary
    severities = [finding.severity for finding in report.findings]
    # the figures first: a wide table scrolls, and what sets runs apart should show without scrolling
    return {
        "run": entry.name,
        "kind": "plain trace" if entry.bare_trace else "gpuprof run",
        "verdict": report.verdict.headline,
        "steps": summary.n_steps,
        "step p50 ms": summary.step_time_p50_s * 1e3 if summary.step_time_p50_s is not None else None,
        "tokens/s": summary.tokens_per_s,
        "MFU %": summary.mfu * 100 if summary.mfu is not None else None,
        "peak memory GiB": (summary.peak_memory_bytes / GIB
                            if summary.peak_memory_bytes is not None else None),
        "critical": severities.count("critical"),
        "warnings": severities.count("warning"),
        "status": entry.status,
        "device": device_label(meta),
        "model": model_label(meta),
        "variant": variant_label(meta),
        "ranks": summary.world_size,
    }


# Number formats of the figures; a figure a run lacks reads MISSING, not "None".
FIGURE_FORMATS = {"step p50 ms": "{:,.1f}", "tokens/s": "{:,.0f}", "MFU %": "{:.1f}", "peak memory GiB": "{:.3f}"}


def _select_rows(names: list[str]) -> None:
    """Ticked rows become the sidebar's selected runs (a callback: it runs before the rerun draws the sidebar)."""
    rows = st.session_state["runs_table"]["selection"]["rows"]
    if rows:
        st.session_state.selected_runs = [names[row] for row in sorted(rows)][:MAX_SELECTED_RUNS]


def render(root, entries, selected) -> None:
    st.header("Runs")
    st.caption(f"Folder: `{root}`")
    readable = [entry for entry in entries if entry.ok]
    if not entries:
        st.info(
            f"No runs under {root}. Record one with `gpuprof train --run-dir {root}/NAME`, "
            "or wrap a training loop in `gpuprof.profile(...)`, then reload."
        )
        return
    if readable:
        table = pd.DataFrame([_row(entry) for entry in readable])
        st.dataframe(
            table.style.format(FIGURE_FORMATS, na_rep=MISSING), hide_index=True, key="runs_table",
            on_select=partial(_select_rows, table["run"].tolist()), selection_mode="multi-row",
            column_config={"verdict": st.column_config.TextColumn(width="medium")},
        )
        devices = sorted({device_label(entry.meta) for entry in readable})
        st.caption(f"Recorded on: {', '.join(devices)}. Select one run (Run page) or two or more (Compare): "
                   "tick rows here or pick them in the sidebar.")
    for entry in entries:
        if not entry.ok:
            st.warning(f"`{entry.name}` cannot be shown: {entry.error}")
            continue
        for note in entry.report.notes:
            st.caption(f"`{entry.name}`: {note}")
