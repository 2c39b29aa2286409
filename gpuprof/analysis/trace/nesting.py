"""Which event encloses which, on one thread: the call tree of host events (ops inside ops, ops inside
Python frames, allocations inside ops), computed for all events at once.

Host events of one thread nest (Kineto records them as a call stack). Sorted by start (the longer
first on a tie), the innermost event enclosing event i is i-1 or one of i-1's enclosing events; each
candidate that does not enclose i is replaced by its own candidate (pointer jumping), for all events
together, until every candidate encloses its event or is none. No Python loop over events.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

NONE = -1


def thread_order(events: pd.DataFrame, start: str = "ts_us", end: str = "end_us") -> np.ndarray:
    """Positions of `events` sorted by thread, then start, the longer first on a tie."""
    return np.lexsort((-events[end].to_numpy(), events[start].to_numpy(), _thread_codes(events)))


def parents(events: pd.DataFrame, start: str = "ts_us", end: str = "end_us") -> np.ndarray:
    """For each row of `events` (host events with times `start` and `end`, pid, tid), the position of the
    innermost other row on the same thread that encloses it, or NONE."""
    order = thread_order(events, start, end)
    starts = events[start].to_numpy()[order]
    ends = events[end].to_numpy()[order]
    threads = _thread_codes(events)[order]
    candidate = np.arange(len(order)) - 1
    if len(order):
        candidate[np.flatnonzero(np.diff(threads, prepend=threads[0] - 1))] = NONE  # a thread's first event
    while True:
        safe = np.maximum(candidate, 0)
        failing = (candidate >= 0) & ((ends[safe] < ends) | (starts[safe] > starts))
        if not failing.any():
            break
        candidate[failing] = candidate[safe[failing]]
    result = np.full(len(order), NONE)
    result[order] = np.where(candidate >= 0, order[np.maximum(candidate, 0)], NONE)
    return result


def nearest(parent: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """For each row, the nearest enclosing row (itself excluded) for which `wanted` is true, or NONE."""
    found = parent.copy()
    while True:
        safe = np.maximum(found, 0)
        climbing = (found >= 0) & ~wanted[safe]
        if not climbing.any():
            return found
        found[climbing] = parent[safe[climbing]]


def subtree_sums(parent: np.ndarray, own: np.ndarray) -> np.ndarray:
    """Each row's `own` value plus those of every row it encloses (directly or not)."""
    total = own.astype(np.float64).copy()
    depth = depths(parent)
    for level in range(int(depth.max(initial=0)), 0, -1):
        rows = np.flatnonzero(depth == level)
        np.add.at(total, parent[rows], total[rows])
    return total


def depths(parent: np.ndarray) -> np.ndarray:
    """How many rows enclose each row."""
    depth = np.zeros(len(parent), dtype=np.int64)
    above = parent.copy()
    while (alive := above >= 0).any():
        depth += alive
        above[alive] = parent[above[alive]]
    return depth


def _thread_codes(events: pd.DataFrame) -> np.ndarray:
    pid = events["pid"].astype("category").cat.codes.to_numpy().astype(np.int64)
    tid = events["tid"].astype("category").cat.codes.to_numpy().astype(np.int64)
    return pid * (int(tid.max(initial=0)) + 2) + tid
