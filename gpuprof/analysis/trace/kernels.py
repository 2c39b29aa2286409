"""Kernel breakdown: time by kernel type with their overlaps (as HTA), top kernels, and kernels by the op that
launched them (the TensorBoard plugin's kernel view), with tensor-core use and Kineto's occupancy fields."""

from __future__ import annotations

import numpy as np
import pandas as pd

from gpuprof.analysis import intervals
from gpuprof.analysis.trace import nesting
from gpuprof.analysis.trace.classify import TENSOR_CORE_RE
from gpuprof.analysis.trace.events import device_events, kernel_type_spans
from gpuprof.analysis.trace.loader import Trace

# HTA's order, which also names the overlaps ("computation overlapping communication").
SPLIT_TYPES = ("computation", "communication", "memory")
TYPE_COLUMNS = ["rank", "kernel_type", "time_us", "time_pct"]
# Kineto's occupancy fields (loader columns) and their names in the tables.
OCCUPANCY_COLUMNS = {"blocks_per_sm": "blocks_per_sm", "occupancy_pct": "est_achieved_occupancy_pct"}
KERNEL_FIGURES = ["count", "total_us", "mean_us", "max_us", "min_us", "tensor_cores", *OCCUPANCY_COLUMNS.values()]
TOP_COLUMNS = ["rank", "kernel_type", "name", *KERNEL_FIGURES, "total_pct"]
BY_OP_COLUMNS = ["rank", "op", "name", *KERNEL_FIGURES]


def kernel_type_breakdown(trace: Trace) -> pd.DataFrame:
    """Device time by the exact set of kernel types running, e.g. "computation",
    "computation overlapping communication"; percentages of the rank's covered time."""
    tables = [_type_split(rank, rt.events) for rank, rt in trace.ranks.items()]
    tables = [t for t in tables if not t.empty]
    return pd.concat(tables, ignore_index=True) if tables else pd.DataFrame(columns=TYPE_COLUMNS)


def _mask_label(mask: int) -> str:
    return " overlapping ".join(t for bit, t in enumerate(SPLIT_TYPES) if mask & (1 << bit))


def _type_split(rank: int, events: pd.DataFrame) -> pd.DataFrame:
    sets = [kernel_type_spans(events, t) for t in SPLIT_TYPES]
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
    """The `limit` device events with the most total time per rank and kernel type, with whether each runs
    on tensor cores and its occupancy where Kineto records it (duration-weighted means, as the plugin's)."""
    tables = []
    for rank, rank_trace in trace.ranks.items():
        device = device_events(rank_trace.events)
        if device.empty:
            continue
        stats = _kernel_stats(device, ["kernel_type", "name"])
        stats["total_pct"] = (100 * stats["total_us"] / stats["total_us"].sum()).round(2)
        stats["rank"] = rank
        stats = stats.sort_values("total_us", ascending=False, kind="stable").head(limit)
        stats["kernel_type"] = stats["kernel_type"].astype(str)
        tables.append(stats[TOP_COLUMNS])
    return pd.concat(tables, ignore_index=True) if tables else pd.DataFrame(columns=TOP_COLUMNS)


def kernels_by_op(trace: Trace, trees: dict, limit: int | None = 10) -> pd.DataFrame:
    """Device time by the CPU op that launched it (the innermost op around the launch call) and kernel:
    the `limit` pairs with the most time per rank. `trees`: cpu_ops.host_tree of each rank."""
    tables = []
    for rank, rank_trace in trace.ranks.items():
        device = device_events(rank_trace.events)
        if device.empty:
            continue
        device = device.assign(op=device["correlation"].map(_launching_ops(trees[rank])))
        stats = _kernel_stats(device.dropna(subset=["op"]), ["op", "name"])
        stats["rank"] = rank
        stats = stats.sort_values("total_us", ascending=False, kind="stable").head(limit)
        tables.append(stats[BY_OP_COLUMNS])
    return pd.concat(tables, ignore_index=True) if tables else pd.DataFrame(columns=BY_OP_COLUMNS)


def _launching_ops(tree) -> pd.Series:
    """The innermost CPU op around each launch call, by correlation id."""
    events = tree.events
    is_op = events["kind"].eq("cpu_op").to_numpy()
    calls = np.flatnonzero(events["kind"].eq("runtime").to_numpy() & (events["correlation"].to_numpy() >= 0))
    owner = nesting.nearest(tree.parent, is_op)[calls]
    calls, owner = calls[owner >= 0], owner[owner >= 0]
    ops = pd.Series(events["name"].to_numpy()[owner], index=events["correlation"].to_numpy()[calls])
    return ops[~ops.index.duplicated()]


def _kernel_stats(device: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Count and time per group of `keys` (none missing; in groupby's order), tensor-core use (by name), and
    duration-weighted blocks per SM and achieved occupancy over the kernels that record them (NaN where none does).

    Grouped in numpy: pandas' groupby costs about 10 ms a call in fixed overhead, most of a small trace's table."""
    coded = [_group_codes(device[key]) for key in keys]
    groups, group_of = np.unique(np.column_stack([codes for codes, _ in coded]), axis=0, return_inverse=True)
    group_of = group_of.ravel()
    order = np.argsort(group_of, kind="stable")
    count = np.bincount(group_of, minlength=len(groups))
    starts = np.cumsum(count) - count
    dur = device["dur_us"].to_numpy()[order]
    total = np.add.reduceat(dur, starts)
    columns = {key: labels(groups[:, i]) for i, (key, (_, labels)) in enumerate(zip(keys, coded))}
    columns |= {"count": count, "total_us": total, "mean_us": np.round(total / count, 2),
                "max_us": np.maximum.reduceat(dur, starts), "min_us": np.minimum.reduceat(dur, starts)}
    for column, label in OCCUPANCY_COLUMNS.items():
        values = device[column].to_numpy()[order]
        recorded = ~np.isnan(values)
        weight = recorded * dur
        weights = np.add.reduceat(weight, starts)
        weighted = np.add.reduceat(np.where(recorded, values, 0) * weight, starts)
        columns[label] = np.round(weighted / np.where(weights > 0, weights, np.nan), 2)
    stats = pd.DataFrame(columns)
    stats["name"] = stats["name"].astype(str)
    stats["tensor_cores"] = np.array([bool(TENSOR_CORE_RE.search(name)) for name in stats["name"]], dtype=bool)
    return stats


def _group_codes(values: pd.Series):
    """A key's integer codes in groupby's order (its categories', else sorted values), and the function turning
    codes back into the key's values."""
    if isinstance(values.dtype, pd.CategoricalDtype):
        return values.cat.codes.to_numpy(), lambda codes: pd.Categorical.from_codes(codes, dtype=values.dtype)
    codes, uniques = pd.factorize(values, sort=True)
    return codes, uniques.take
