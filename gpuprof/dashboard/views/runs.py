"""Runs page: every run under the folder with its verdict and headline figures; runs that cannot be read say why."""

from __future__ import annotations

from functools import partial

import pandas as pd
import streamlit as st

from gpuprof.dashboard import MAX_SELECTED_RUNS
from gpuprof.report.format import GIB, MISSING, device_label, workload_label
from gpuprof.report.frames import shown_values
from gpuprof.run.reader import unlisted_traces_note


def _row(entry) -> dict:
    report, meta = entry.report, entry.meta
    summary = report.summary
    severities = [finding.severity for finding in report.findings]
    # the verdict and figures first, then how the run was recorded in one column, so that at 1440 px the table
    # shows every column; the step count stays: it is what a half-written run has to show for itself
    return {
        "run": entry.name,
        "verdict": report.verdict.headline,
        "steps": summary.n_steps,
        "p50 ms": summary.step_time_p50_s * 1e3 if summary.step_time_p50_s is not None else None,
        "tokens/s": summary.tokens_per_s,
        "MFU %": summary.mfu * 100 if summary.mfu is not None else None,
        "peak GiB": (summary.peak_memory_bytes / GIB
                            if summary.peak_memory_bytes is not None else None),
        "critical": severities.count("critical"),
        "warnings": severities.count("warning"),
        "recorded": " · ".join(part for part in (entry.status, device_label(meta), workload_label(meta))
                               if part not in (MISSING, "unknown", "finished")),  # "2 × cpu · tiny baseline"
    }


ROW_HEIGHT_PX, ROWS_SHOWN = 35, 25  # Streamlit's grid rows; a longer list scrolls
VERDICT_WIDTH_PX = 300  # "Bound by numerics (50 %): nan in transformer.wte"
# Number formats of the figures (printf style, as Streamlit's NumberColumn takes them).
FIGURE_FORMATS = {"p50 ms": "%.1f", "tokens/s": "%d", "MFU %": "%.1f", "peak GiB": "%.3f"}
# Short headers keep the table within the window; each says in full what it holds when hovered.
FIGURE_HELP = {"p50 ms": "median step time after warm-up", "tokens/s": "tokens trained per second, every rank together",
               "MFU %": "model FLOPs utilization: achieved over the device's peak FLOP/s (n/a: no peak known)",
               "peak GiB": "peak memory: the device allocator's, or on a CPU run the process's resident memory"}


def _figures_shown(table: pd.DataFrame) -> pd.DataFrame:
    """A figure column that some run lacks as text, "n/a" there (a missing number is drawn as a grey None)."""
    return table.assign(**{name: shown_values(table[name], "", lambda value, pattern=pattern: pattern % value)
                           for name, pattern in FIGURE_FORMATS.items()})


def _select_rows(names: list[str]) -> None:
    """Ticked rows become the sidebar's selected runs (a callback: it runs before the rerun draws the sidebar)."""
    rows = st.session_state["runs_table"]["selection"]["rows"]
    if rows:
        st.session_state.selected_runs = [names[row] for row in sorted(rows)][:MAX_SELECTED_RUNS]


def render(root, entries, selected) -> None:
    st.header("Runs")
    st.caption(f"Folder: `{root}`")
    readable = [entry for entry in entries if entry.ok]
    unlisted = unlisted_traces_note(root)
    if unlisted:
        st.caption(unlisted)
    if not entries:
        st.info(
            f"No runs under {root}. Record one with `gpuprof train --run-dir {root}/NAME`, "
            "or wrap a training loop in `gpuprof.profile(...)`, then reload."
        )
        return
    if readable:
        table = _figures_shown(pd.DataFrame([_row(entry) for entry in readable]))
        st.dataframe(
            table, hide_index=True, key="runs_table", height=ROW_HEIGHT_PX * (min(len(table), ROWS_SHOWN) + 1) + 3,
            on_select=partial(_select_rows, table["run"].tolist()), selection_mode="multi-row",
            column_config={"verdict": st.column_config.TextColumn(width=VERDICT_WIDTH_PX),
                           "steps": st.column_config.NumberColumn(width="small", help="optimizer steps recorded"),
                           **{name: (st.column_config.NumberColumn(format=pattern, help=FIGURE_HELP[name])
                                     if pd.api.types.is_numeric_dtype(table[name])
                                     else st.column_config.TextColumn(help=FIGURE_HELP[name]))
                              for name, pattern in FIGURE_FORMATS.items()}},
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
