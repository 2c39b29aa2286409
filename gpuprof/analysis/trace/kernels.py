"""Kernel breakdown: time by kernel type with their overlaps (as HTA), and top kernels."""

from __future__ import annotations

import pandas as pd

from gpuprof.analysis import intervals
from gpuprof.analysis.trace.events import device_events, spans
from gpuprof.analysis.trace.loader import Trace

# HTA's order, which also names the overlaps ("computation overlapping communication").
SPLIT_TYPES = ("computation", "communication", "memory")
TYPE_COLUMNS = ["rank", "kernel_type", "time_us", "time_pct"]
TOP_COLUMNS = ["rank", "kernel_type", "name", "count", "total_us", "mean_us", "max_us", "min_us", "total_pct"]


def kernel_type_breakdown(trace: Trace) -> pd.DataFrame:
    """Device time by the exact set of kernel types running, e.g. "computation",
    "computation overlapping communication"; percentages of the rank's covered time."""
    tables = [_type_split(rank, rt.events) for rank, rt in trace.ranks.items()]
    tables = [t for t in tables if not t.empty]
    return pd.concat(tables, ignore_index=True) if tables else pd.DataFrame(columns=TYPE_COLUMNS)


def _mask_label(mask: int) -> str:
    return " overlapping ".join(t for bit, t in enumerate(SPLIT_TYPES) if mask & (1 << bit))


def _type_split(rank: int, events: pd.DataFrame) -> pd.DataFrame:
    device = device_events(events)
    sets = [spans(device[device["kernel_type"].eq(t).to_numpy()]) for t in SPLIT_TYPES]
    segments, masks = intervals.membership_segments(sets)
    if len(segments) == 0:
        return pd.DataFrame(columns=TYPE_COLUMNS)
    split = pd.DataFrame({"mask": masks, "time_us": segments[:, 1] - segments[:, 0]})
    split = split.groupby("mask", as_index=False)["time_us"].sum()
    split["kernel_type"] = split["mask"].map(_mask_label)
    split["rank"] = rank
    split["time_pct"] = (100 * split["time_us"] / split["time_us"].sum()).round(1)
    return split.sort_values("time_us", ascending=False, ignore_index=True)[TYPE_COLUMNS]


def top_kernels(trace: Trace, limit: int = 10) -> pd.DataFrame:
    """The `limit` device events with the most total time per rank and kernel type."""
    tables = []
    for rank, rank_trace in trace.ranks.items():
        device = device_events(rank_trace.events)
        if device.empty:
            continue
        grouped = device.groupby(["kernel_type", "name"], observed=True)["dur_us"]
        stats = grouped.agg(count="count", total_us="sum", mean_us="mean", max_us="max", min_us="min")
        stats = stats.reset_index()
        stats["total_pct"] = (100 * stats["total_us"] / stats["total_us"].sum()).round(2)
        stats["rank"] = rank
        stats["mean_us"] = stats["mean_us"].round(2)
        stats = stats.sort_values("total_us", ascending=False, kind="stable").head(limit)
        stats["kernel_type"] = stats["kernel_type"].astype(str)
        stats["name"] = stats["name"].astype(str)
        tables.append(stats[TOP_COLUMNS])
    return pd.concat(tables, ignore_index=True) if tables else pd.DataFrame(columns=TOP_COLUMNS)
