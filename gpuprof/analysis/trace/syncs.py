"""Host-device synchronizations inside profiler steps, with the CPU op that caused each.

Counted: blocking runtime calls (stream/device/event synchronize, synchronous memcpy)
and asynchronous copies whose device side is device-to-host (the host must wait for
the data before using it, e.g. `.item()`, `.cpu()`, `print(loss)`).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from gpuprof.analysis.trace.classify import ASYNC_COPY_CALL_RE, DEVICE_TO_HOST_RE, SYNC_CALL_RE, matches
from gpuprof.analysis.trace.events import device_events, step_windows
from gpuprof.analysis.trace.loader import RankTrace, Trace

COLUMNS = ["rank", "step", "ts_us", "dur_us", "sync_call", "sync_type", "cpu_op", "innermost_cpu_op"]


def host_device_syncs(trace: Trace) -> pd.DataFrame:
    tables = [_rank_syncs(rank, rank_trace) for rank, rank_trace in trace.ranks.items()]
    tables = [t for t in tables if not t.empty]
    return pd.concat(tables, ignore_index=True) if tables else pd.DataFrame(columns=COLUMNS)


def _sync_type(call: str) -> str:
    for word, label in (("Stream", "stream sync"), ("Device", "device sync"), ("Event", "event sync")):
        if f"{word}Synchronize" in call:
            return label
    return "device-to-host copy" if "Async" in call else "blocking copy"


def _sync_calls(events: pd.DataFrame) -> pd.DataFrame:
    runtime = events[events["kind"].eq("runtime").to_numpy()]
    blocking = matches(runtime["name"], SYNC_CALL_RE)
    device = device_events(events)
    to_host = device[matches(device["name"], DEVICE_TO_HOST_RE)]["correlation"]
    async_to_host = matches(runtime["name"], ASYNC_COPY_CALL_RE) & runtime["correlation"].isin(to_host).to_numpy()
    return runtime[blocking | async_to_host]


def _rank_syncs(rank: int, rank_trace: RankTrace) -> pd.DataFrame:
    events = rank_trace.events
    calls = _sync_calls(events)
    if calls.empty:
        return pd.DataFrame(columns=COLUMNS)
    windows = step_windows(rank_trace)
    index = np.searchsorted(windows["start_us"].to_numpy(), calls["ts_us"].to_numpy(), side="right") - 1
    inside = (index >= 0) & (calls["ts_us"].to_numpy() < windows["end_us"].to_numpy()[np.maximum(index, 0)])
    calls, index = calls[inside], index[inside]
    ops = events[events["kind"].eq("cpu_op").to_numpy()]
    threads = {key: _ThreadOps(group) for key, group in ops.groupby(["pid", "tid"], observed=True)}
    callers = [
        threads[(call.pid, call.tid)].callers(call.ts_us, call.end_us) if (call.pid, call.tid) in threads else (None, None)
        for call in calls.itertuples()
    ]
    return pd.DataFrame(
        {
            "rank": rank,
            "step": windows["step"].to_numpy()[index],
            "ts_us": calls["ts_us"].to_numpy(),
            "dur_us": calls["dur_us"].to_numpy(),
            "sync_call": calls["name"].astype(str).to_numpy(),
            "sync_type": [_sync_type(str(name)) for name in calls["name"]],
            "cpu_op": [outer for outer, _ in callers],
            "innermost_cpu_op": [inner for _, inner in callers],
        },
        columns=COLUMNS,
    )


class _ThreadOps:
    """The CPU ops of one thread, for finding the ops that enclose an instant."""

    INNERMOST_SEARCH = 256  # ops looked back at for the innermost caller

    def __init__(self, ops: pd.DataFrame):
        self.starts = ops["ts_us"].to_numpy()
        self.ends = ops["end_us"].to_numpy()
        self.names = ops["name"].astype(str).to_numpy()
        # Top-level ops: not inside an earlier op (they start after everything before ended).
        running_end = np.maximum.accumulate(self.ends)
        top = np.ones(len(self.starts), dtype=bool)
        top[1:] = self.starts[1:] >= running_end[:-1]
        self.top = np.flatnonzero(top)

    def callers(self, start: int, end: int) -> tuple[str | None, str | None]:
        """The outermost and innermost ops enclosing [start, end)."""
        last = np.searchsorted(self.starts, start, side="right") - 1
        if last < 0:
            return None, None
        outer = self.top[np.searchsorted(self.starts[self.top], start, side="right") - 1]
        if self.ends[outer] < end:
            return None, None
        for index in range(last, max(outer, last - self.INNERMOST_SEARCH) - 1, -1):
            if self.ends[index] >= end:
                return str(self.names[outer]), str(self.names[index])
        return str(self.names[outer]), str(self.names[outer])
