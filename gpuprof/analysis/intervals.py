"""Interval arithmetic on half-open intervals [start, end), vectorized with numpy.

An interval set is an (n, 2) array of [start, end) rows. "Merged" sets are sorted,
disjoint and non-touching; every function here returns merged sets and accepts any
set (unsorted, overlapping, empty or zero-length rows). Rows with end < start are
treated as empty.

All set operations are one sweep over the sorted boundaries (`membership_segments`),
so union, intersection, difference and the multi-set split used by the kernel-type
breakdown share one definition.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = [
    "merge",
    "union",
    "intersect",
    "subtract",
    "total_length",
    "membership_segments",
    "overlap_per_window",
]


def _checked(intervals) -> np.ndarray:
    array = np.asarray(intervals)
    if array.size == 0:
        return np.empty((0, 2), dtype=array.dtype if array.dtype != object else np.float64)
    if array.ndim != 2 or array.shape[1] != 2:
        raise ValueError(f"intervals must have shape (n, 2), got {array.shape}")
    return array


def merge(intervals) -> np.ndarray:
    """Union of the rows of one set: sorted, disjoint; touching intervals are joined."""
    array = _checked(intervals)
    array = array[array[:, 1] > array[:, 0]]
    if len(array) == 0:
        return array.reshape(0, 2)
    array = array[np.argsort(array[:, 0], kind="stable")]
    starts, ends = array[:, 0], array[:, 1]
    running_end = np.maximum.accumulate(ends)
    # A new group starts where an interval begins after everything before it ended.
    new_group = np.empty(len(array), dtype=bool)
    new_group[0] = True
    new_group[1:] = starts[1:] > running_end[:-1]
    group_starts = np.flatnonzero(new_group)
    group_last = np.append(group_starts[1:] - 1, len(array) - 1)
    return np.column_stack([starts[group_starts], running_end[group_last]])


def total_length(intervals) -> float | int:
    """Length covered by the set, each point counted once."""
    merged = merge(intervals)
    if len(merged) == 0:
        return 0
    return (merged[:, 1] - merged[:, 0]).sum().item()


def membership_segments(sets: Sequence) -> tuple[np.ndarray, np.ndarray]:
    """Split the time line into segments by which of `sets` cover them.

    Returns (segments, masks): merged-style [start, end) rows of non-zero length and,
    for each, a bit mask with bit i set when sets[i] covers the segment. Uncovered
    segments are left out.
    """
    if len(sets) > 62:
        raise ValueError("at most 62 sets")
    merged = [merge(s) for s in sets]
    times, deltas = [], []
    for bit, intervals in enumerate(merged):
        weight = np.int64(1) << bit
        times += [intervals[:, 0], intervals[:, 1]]
        deltas += [np.full(len(intervals), weight), np.full(len(intervals), -weight)]
    if not times or sum(len(t) for t in times) == 0:
        dtype = merged[0].dtype if merged else np.float64
        return np.empty((0, 2), dtype=dtype), np.empty(0, dtype=np.int64)
    times = np.concatenate(times)
    deltas = np.concatenate(deltas)
    order = np.argsort(times, kind="stable")
    times, running = times[order], np.cumsum(deltas[order])
    # Sets are merged, so each covers a point at most once and the running sum is a mask.
    segments = np.column_stack([times[:-1], times[1:]])
    masks = running[:-1]
    keep = (segments[:, 1] > segments[:, 0]) & (masks > 0)
    return segments[keep], masks[keep]


def _select(sets: Sequence, predicate) -> np.ndarray:
    segments, masks = membership_segments(sets)
    return merge(segments[predicate(masks)])


def union(*sets) -> np.ndarray:
    """Points covered by any of the sets."""
    return _select(sets, lambda mask: mask > 0)


def intersect(a, b) -> np.ndarray:
    """Points covered by both a and b."""
    return _select([a, b], lambda mask: mask == 3)


def subtract(a, b) -> np.ndarray:
    """Points covered by a and not by b."""
    return _select([a, b], lambda mask: mask == 1)


def overlap_per_window(intervals, windows) -> np.ndarray:
    """For each [start, end) row of `windows`, the length of `intervals` inside it.

    O((n + w) log n): cumulative covered length evaluated at window edges.
    """
    merged = merge(intervals)
    windows = _checked(windows)
    if len(windows) == 0:
        return np.zeros(0, dtype=np.float64)
    if len(merged) == 0:
        return np.zeros(len(windows), dtype=np.result_type(windows.dtype, np.int64))
    starts, ends = merged[:, 0], merged[:, 1]
    covered_before = np.concatenate([[0], np.cumsum(ends - starts)])

    def covered_until(t: np.ndarray) -> np.ndarray:
        # Intervals starting before t: all complete except possibly the last one.
        index = np.searchsorted(starts, t, side="right")
        last = np.maximum(index - 1, 0)
        partial = np.where(index > 0, np.clip(t - starts[last], 0, ends[last] - starts[last]), 0)
        return covered_before[last] + partial

    lengths = covered_until(windows[:, 1]) - covered_until(windows[:, 0])
    return np.maximum(lengths, 0)
