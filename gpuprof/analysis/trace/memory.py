"""The memory view (the TensorBoard plugin's), from profile_memory=True traces: memory over time per device,
its peaks, and allocations by the CPU op that made them (the innermost op around each "[memory]" event, at
the times Kineto recorded)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from gpuprof.analysis.trace import nesting
from gpuprof.analysis.trace.loader import Trace, recorded_ns

TIMELINE_POINTS = 500  # per device: the highest point of each of this many equal time slices
TIMELINE_COLUMNS = ["rank", "device", "ts_us", "allocated_bytes", "reserved_bytes"]
SUMMARY_COLUMNS = ["rank", "device", "allocations", "frees", "allocated_bytes", "peak_allocated_bytes",
                   "peak_at_us", "peak_reserved_bytes", "end_allocated_bytes"]
BY_OP_COLUMNS = ["rank", "device", "op", "allocations", "allocated_bytes", "frees", "freed_bytes", "net_bytes"]
NO_OP = "(no op)"


def with_totals(memory: pd.DataFrame) -> pd.DataFrame:
    """The events with the allocator's totals after each; traces before torch 1.10 record none: there the
    allocated total is the running sum of the trace's own allocations and frees (from 0 at its start)."""
    memory = memory.copy()
    running = memory.groupby("device", observed=True)["bytes"].cumsum()
    memory["allocated_bytes"] = memory["total_allocated_bytes"].fillna(running)
    memory["reserved_bytes"] = memory["total_reserved_bytes"]
    return memory


def memory_timeline(trace: Trace, points: int = TIMELINE_POINTS) -> pd.DataFrame:
    """Allocated and reserved bytes over time per device, thinned to the highest point of each time slice
    (so the peak is always kept)."""
    tables = []
    for rank, memory in _recorded(trace):
        for device, events in memory.groupby("device", observed=True):
            edges = np.linspace(events["ts_us"].min(), events["ts_us"].max() + 1, points + 1)
            slices = np.searchsorted(edges, events["ts_us"].to_numpy(), side="right")
            highest = events.assign(slice=slices).groupby("slice")["allocated_bytes"].idxmax()
            kept = events.loc[np.sort(highest.to_numpy())]
            tables.append(kept.assign(rank=rank, device=str(device))[TIMELINE_COLUMNS])
    return pd.concat(tables, ignore_index=True) if tables else pd.DataFrame(columns=TIMELINE_COLUMNS)


def memory_summary(trace: Trace) -> pd.DataFrame:
    rows = []
    for rank, memory in _recorded(trace):
        for device, events in memory.groupby("device", observed=True):
            peak = events["allocated_bytes"].idxmax()
            sizes = events["bytes"]
            rows.append([rank, str(device), int((sizes > 0).sum()), int((sizes < 0).sum()), _int(sizes[sizes > 0].sum()),
                         _int(events.loc[peak, "allocated_bytes"]), int(events.loc[peak, "ts_us"]),
                         _int(events["reserved_bytes"].max()), _int(events["allocated_bytes"].iloc[-1])])
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


def memory_by_op(trace: Trace, trees: dict, limit: int | None = 10) -> pd.DataFrame:
    """Allocations and frees by device and the innermost CPU op that made them (`trees`: cpu_ops.host_tree of
    each rank); the `limit` ops allocating the most per rank first."""
    tables = []
    for rank, rank_trace in trace.ranks.items():
        memory = rank_trace.memory
        if memory.empty:
            continue
        sizes = memory["bytes"].fillna(0).to_numpy()
        frame = pd.DataFrame({
            "device": memory["device"].astype(str).to_numpy(), "op": _allocating_ops(trees[rank], memory),
            "allocated_bytes": np.where(sizes > 0, sizes, 0), "freed_bytes": np.where(sizes < 0, -sizes, 0),
            "allocations": sizes > 0, "frees": sizes < 0,
        })
        stats = frame.groupby(["device", "op"], sort=False).sum().reset_index()
        stats["net_bytes"] = stats["allocated_bytes"] - stats["freed_bytes"]
        stats = stats.sort_values("allocated_bytes", ascending=False, kind="stable").head(limit)
        tables.append(stats.assign(rank=rank)[BY_OP_COLUMNS].astype({c: "int64" for c in BY_OP_COLUMNS[3:]}))
    return pd.concat(tables, ignore_index=True) if tables else pd.DataFrame(columns=BY_OP_COLUMNS)


def _allocating_ops(tree, memory: pd.DataFrame) -> np.ndarray:
    """The innermost CPU op on the same thread whose [start, end) holds each memory event, NO_OP outside every
    op, as the TensorBoard plugin places them. On the recorded ns: in whole µs an allocation made just before a
    child op starts, in the same µs, falls in the child, and one made in an op's last µs falls after the op."""
    ops = tree.events[tree.events["kind"].eq("cpu_op").to_numpy()]
    # An op's last ns is end - 1: an event at the instant one op ends and the next starts is the next's.
    spans = pd.DataFrame({"start": recorded_ns(ops), "last": recorded_ns(ops, "end") - 1,
                          "pid": ops["pid"].to_numpy(), "tid": ops["tid"].to_numpy()})
    at = recorded_ns(memory)
    points = pd.DataFrame({"start": at, "last": at, "pid": memory["pid"].to_numpy(), "tid": memory["tid"].to_numpy()})
    both = pd.concat([spans, points], ignore_index=True)
    owner = nesting.nearest(nesting.parents(both, "start", "last"), np.arange(len(both)) < len(ops))[len(ops):]
    names = np.append(ops["name"].to_numpy(), NO_OP)
    return names[np.where(owner >= 0, owner, len(ops))]


def _recorded(trace: Trace):
    """(rank, memory events with totals) of the ranks that recorded memory events."""
    return [(rank, with_totals(rank_trace.memory)) for rank, rank_trace in trace.ranks.items()
            if not rank_trace.memory.empty]


def _int(value) -> int | None:
    return None if pd.isna(value) else int(value)

