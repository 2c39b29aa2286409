"""Step-time breakdown that sums to wall time, priority-ordered as the TensorBoard
profiler plugin did: each instant of a step goes to the first category active then."""

from __future__ import annotations

import numpy as np
import pandas as pd

from gpuprof.analysis import intervals
from gpuprof.analysis.trace.classify import CPU_COLLECTIVE_RE, DATALOADER_RE, matches
from gpuprof.analysis.trace.events import spans, step_windows
from gpuprof.analysis.trace.loader import Trace

CATEGORIES = ("kernel", "memcpy", "memset", "communication", "runtime", "dataloader", "cpu_exec")
COLUMNS = ["rank", "step", "start_us", "end_us", "step_time_us"] + [f"{c}_us" for c in CATEGORIES] + ["other_us"]
HOST_KINDS = ("cpu_op", "user_annotation", "python_function")


def step_breakdown(trace: Trace) -> pd.DataFrame:
    tables = [_rank_steps(rank, rank_trace) for rank, rank_trace in trace.ranks.items()]
    return pd.concat(tables, ignore_index=True)[COLUMNS]


def _category_sets(events: pd.DataFrame) -> list[np.ndarray]:
    kind = events["kind"]
    kernel_type = events["kernel_type"]
    host = kind.isin(HOST_KINDS).to_numpy()
    communication = kernel_type.eq("communication").to_numpy() | (host & matches(events["name"], CPU_COLLECTIVE_RE))
    masks = {
        "kernel": kind.eq("kernel").to_numpy() & ~communication,
        "memcpy": kind.eq("memcpy").to_numpy(),
        "memset": kind.eq("memset").to_numpy(),
        "communication": communication,
        "runtime": kind.eq("runtime").to_numpy(),
        "dataloader": host & matches(events["name"], DATALOADER_RE),
        "cpu_exec": kind.eq("cpu_op").to_numpy(),
    }
    return [spans(events, masks[c]) for c in CATEGORIES]


def _rank_steps(rank: int, rank_trace) -> pd.DataFrame:
    windows = step_windows(rank_trace)
    edges = windows[["start_us", "end_us"]].to_numpy()
    segments, masks = intervals.membership_segments(_category_sets(rank_trace.events))
    # The category of a segment is its highest-priority (lowest) set bit.
    first_bit = np.log2(masks & -masks).astype(np.int64) if len(masks) else masks
    table = windows.assign(rank=rank, step_time_us=edges[:, 1] - edges[:, 0])
    for bit, category in enumerate(CATEGORIES):
        table[f"{category}_us"] = intervals.overlap_per_window(segments[first_bit == bit], edges)
    covered = table[[f"{c}_us" for c in CATEGORIES]].sum(axis=1)
    table["other_us"] = table["step_time_us"] - covered
    return table
