"""Temporal breakdown, as HTA defines it (`TraceAnalysis.get_temporal_breakdown`).

Per rank, over the span from the first device event's start to the last one's end
(`kernel_time_us`): idle = no kernel, memcpy or memset running; compute = covered by
computation kernels; non-compute = the rest (busy with communication or memory only).
"""

from __future__ import annotations

import pandas as pd

from gpuprof.analysis import intervals
from gpuprof.analysis.trace.events import kernel_type_spans, spans
from gpuprof.analysis.trace.loader import Trace

COLUMNS = [
    "rank",
    "idle_time_us",
    "compute_time_us",
    "non_compute_time_us",
    "kernel_time_us",
    "idle_time_pct",
    "compute_time_pct",
    "non_compute_time_pct",
]


def temporal_breakdown(trace: Trace) -> pd.DataFrame:
    rows = [_rank_row(rank, rank_trace.events) for rank, rank_trace in trace.ranks.items()]
    table = pd.DataFrame([row for row in rows if row], columns=COLUMNS[:5])
    for part in ("idle", "compute", "non_compute"):
        table[f"{part}_time_pct"] = (100 * table[f"{part}_time_us"] / table["kernel_time_us"]).round(2)
    return table[COLUMNS]


def _rank_row(rank: int, events: pd.DataFrame) -> dict | None:
    busy = intervals.merge(spans(events, events["is_device"].to_numpy()))
    if len(busy) == 0:
        return None
    kernel_time = int(busy[-1, 1] - busy[0, 0])
    idle = kernel_time - int(intervals.total_length(busy))
    compute = int(intervals.total_length(kernel_type_spans(events, "computation")))
    return {
        "rank": rank,
        "idle_time_us": idle,
        "compute_time_us": compute,
        "non_compute_time_us": kernel_time - compute - idle,
        "kernel_time_us": kernel_time,
    }
