"""Computation/communication overlap (HTA's `get_comm_comp_overlap`): the share of
communication-kernel time during which a computation kernel also runs."""

from __future__ import annotations

import numpy as np
import pandas as pd

from gpuprof.analysis import intervals
from gpuprof.analysis.trace.events import kernel_type_spans
from gpuprof.analysis.trace.loader import Trace

COLUMNS = ["rank", "communication_time_us", "overlapped_time_us", "comm_comp_overlap_pct"]


def comm_comp_overlap(trace: Trace) -> pd.DataFrame:
    rows = []
    for rank, rank_trace in trace.ranks.items():
        communication = kernel_type_spans(rank_trace.events, "communication")
        if len(communication) == 0:
            continue
        computation = kernel_type_spans(rank_trace.events, "computation")
        comm_time = intervals.total_length(communication)
        overlapped = intervals.total_length(intervals.intersect(communication, computation))
        pct = round(100 * overlapped / comm_time, 2) if comm_time else np.nan
        rows.append([rank, int(comm_time), int(overlapped), pct])
    return pd.DataFrame(rows, columns=COLUMNS)
