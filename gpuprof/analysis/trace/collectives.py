"""Collectives by kind (all-gather, reduce-scatter, all-reduce): their time per step, and the
part of it the step is exposed to, i.e. not hidden behind computation.

- On a GPU: the NCCL/RCCL kernels of each kind against computation kernels (HTA's
  communication/computation overlap, split by kind).
- On a CPU (gloo): a collective runs on gloo's own threads as a `gloo:<op>` span; its kind is
  that of the last `c10d::` op the training thread (the one holding the ProfilerStep events)
  issued before it started, and the part of it during which the training thread runs no
  operator of its own is exposed.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from gpuprof.analysis import intervals
from gpuprof.analysis.trace.classify import (
    C10D_OP_RE, COLLECTIVE_KINDS, CPU_COLLECTIVE_RE, GLOO_WORK_RE, PROFILER_STEP_RE, collective_kind, map_categories,
    matches,
)
from gpuprof.analysis.trace.events import kernel_type_spans, profiler_steps, spans
from gpuprof.analysis.trace.loader import Trace

COLUMNS = ["rank", "collective", "count", "steps", "time_us", "exposed_us", "overlap_pct"]


def collective_times(trace: Trace) -> pd.DataFrame:
    """One row per rank and collective kind present; `steps` is the profiler steps in the window."""
    rows = []
    for rank, rank_trace in trace.ranks.items():
        events = rank_trace.events
        n_steps = len(profiler_steps(events))
        work, kinds, computation = (_device_work if rank_trace.has_device_activity else _host_work)(events)
        for kind in COLLECTIVE_KINDS:
            selected = work[(kinds == kind).to_numpy()]
            if len(selected) == 0:
                continue
            busy = intervals.merge(spans(selected))
            time_us = intervals.total_length(busy)
            overlapped_us = intervals.total_length(intervals.intersect(busy, computation))
            overlap_pct = round(100 * overlapped_us / time_us, 2) if time_us else np.nan
            rows.append([rank, kind, len(selected), n_steps, int(time_us), int(time_us - overlapped_us), overlap_pct])
    return pd.DataFrame(rows, columns=COLUMNS)


def _device_work(events: pd.DataFrame):
    communication = events[events["kernel_type"].eq("communication").to_numpy()]
    kinds = map_categories(communication["name"], collective_kind, COLLECTIVE_KINDS)
    return communication, kinds, kernel_type_spans(events, "computation")


def _host_work(events: pd.DataFrame):
    gloo = events[matches(events["name"], GLOO_WORK_RE)].sort_values("ts_us", kind="stable")
    training = events[events["tid"].eq(_training_thread(events)).to_numpy()]
    issued = training[matches(training["name"], C10D_OP_RE)].sort_values("ts_us", kind="stable")
    issued_kinds = np.array([collective_kind(str(name)) for name in issued["name"]], dtype=object)
    position = np.searchsorted(issued["ts_us"].to_numpy(), gloo["ts_us"].to_numpy(), side="right") - 1
    kinds = pd.Series(np.where(position >= 0, issued_kinds[np.maximum(position, 0)] if len(issued) else "other",
                               "other"), index=gloo.index)
    own_ops = training[training["kind"].eq("cpu_op").to_numpy() & ~matches(training["name"], CPU_COLLECTIVE_RE)]
    return gloo, kinds, intervals.merge(spans(own_ops))


def _training_thread(events: pd.DataFrame):
    steps = events[matches(events["name"], PROFILER_STEP_RE)]
    return steps["tid"].iloc[0] if len(steps) else None
