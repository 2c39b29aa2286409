"""The operator view (the TensorBoard plugin's): per CPU op, its total and self time on the host and the
device time of the kernels it launched (total: with the ops inside it; self: launched by it directly),
by name, by name and input shapes (record_shapes=True) and by name and call stack (with_stack=True).

The call tree (`host_tree`) is shared with the module view: ops, Python frames and launch calls of each
thread, each with the innermost event enclosing it (gpuprof.analysis.trace.nesting)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from gpuprof.analysis.trace import nesting
from gpuprof.analysis.trace.classify import matches
from gpuprof.analysis.trace.events import device_events
from gpuprof.analysis.trace.loader import RankTrace

TREE_KINDS = ("cpu_op", "runtime", "python_function")
TREE_COLUMNS = ["ts_us", "end_us", "dur_us", "ts_frac_ns", "end_frac_ns", "name", "pid", "tid", "kind", "correlation",
                "input_dims", "stack"]
FIGURES = ["count", "total_us", "self_us", "device_total_us", "device_self_us"]
COLUMNS = ["rank", "name", "count", "total_us", "mean_us", "max_us", "self_us", "device_total_us", "device_self_us"]
SHAPE_COLUMNS = ["rank", "name", "input_dims", *FIGURES]
STACK_COLUMNS = ["rank", "name", "stack", *FIGURES]
# Frames that are not the user's code in a call stack: the interpreter's, torch's, and nn.Module markers.
LIBRARY_FRAME_RE = re.compile(r"^(<built-in|<frozen|<string>|torch/|nn\.Module: )")
STACK_FRAMES = 5  # innermost user frames kept in a call stack
FRAME_SEPARATOR = " ← "


@dataclass
class HostTree:
    """One rank's host events that nest (ops, Python frames, launch calls), with `parent` (nesting.parents)
    and the device time of what each launch call launched (`launched_us`, 0 for the other events)."""

    events: pd.DataFrame
    parent: np.ndarray
    launched_us: np.ndarray

    def rows_of(self, kind: str) -> np.ndarray:
        return np.flatnonzero(self.events["kind"].eq(kind).to_numpy())

    def enclosing(self, rows: np.ndarray) -> np.ndarray:
        """For each of `rows` (events of one sort), the position in `rows` of the nearest of them enclosing it,
        or NONE."""
        wanted, position = self._marks(rows)
        above = nesting.nearest(self.parent, wanted)[rows]
        return np.where(above >= 0, position[np.maximum(above, 0)], nesting.NONE)

    def self_time_us(self, rows: np.ndarray, enclosing: np.ndarray) -> np.ndarray:
        """Each row's duration less those of the rows directly inside it (`enclosing`: self.enclosing(rows))."""
        total = self.events["dur_us"].to_numpy()[rows]
        inner = enclosing >= 0
        children = np.bincount(enclosing[inner], weights=total[inner], minlength=len(rows))
        return np.maximum(total - children, 0).astype(np.int64)

    def device_time_us(self, rows: np.ndarray, enclosing: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The device time launched inside each of `rows` (total), and inside it with none of the others
        between (self)."""
        wanted, position = self._marks(rows)
        launches = np.flatnonzero(self.launched_us > 0)
        owner = nesting.nearest(self.parent, wanted)[launches]
        has_owner = owner >= 0
        own = np.bincount(position[owner[has_owner]], weights=self.launched_us[launches[has_owner]],
                          minlength=len(rows))
        return nesting.subtree_sums(enclosing, own).astype(np.int64), own.astype(np.int64)

    def _marks(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        wanted = np.zeros(len(self.events), dtype=bool)
        wanted[rows] = True
        position = np.full(len(self.events), nesting.NONE)
        position[rows] = np.arange(len(rows))
        return wanted, position


def host_tree(rank_trace: RankTrace) -> HostTree:
    events = rank_trace.events
    host = events.loc[events["kind"].isin(TREE_KINDS).to_numpy(), TREE_COLUMNS].reset_index(drop=True)
    device = device_events(events)
    device = device[device["correlation"].to_numpy() >= 0]
    launched = device.groupby("correlation")["dur_us"].sum()
    calls = host["kind"].eq("runtime").to_numpy() & (host["correlation"].to_numpy() >= 0)
    launched_us = np.zeros(len(host))
    launched_us[calls] = launched.reindex(host["correlation"].to_numpy()[calls]).fillna(0).to_numpy()
    return HostTree(host, nesting.parents(host), launched_us)


def op_times(tree: HostTree) -> pd.DataFrame:
    """One row per CPU op: name, input_dims, stack, and FIGURES but count."""
    rows = tree.rows_of("cpu_op")
    ops = tree.events.iloc[rows]
    enclosing = tree.enclosing(rows)
    device_total, device_self = tree.device_time_us(rows, enclosing)
    return pd.DataFrame({
        "name": ops["name"].to_numpy(),
        "input_dims": ops["input_dims"].to_numpy(),
        "stack": _stacks(tree, rows),
        "total_us": ops["dur_us"].to_numpy(),
        "self_us": tree.self_time_us(rows, enclosing),
        "device_total_us": device_total,
        "device_self_us": device_self,
    })


def _stacks(tree: HostTree, rows: np.ndarray) -> np.ndarray:
    """Each op's call stack: the innermost STACK_FRAMES user frames around it (with_stack=True), innermost
    first; a torch < 1.11 trace's own "Call stack" argument as it is; None without either."""
    recorded = tree.events["stack"].to_numpy()[rows]
    user = tree.events["kind"].eq("python_function").to_numpy()
    if not user.any():
        return recorded
    user = user & ~matches(tree.events["name"], LIBRARY_FRAME_RE)
    frame_of = nesting.nearest(tree.parent, user)
    user_rows = np.flatnonzero(user)
    names = tree.events["name"].to_numpy()
    chains: dict[int, tuple] = {}
    for row in user_rows[np.argsort(nesting.depths(tree.parent)[user_rows], kind="stable")].tolist():
        chains[row] = (str(names[row]), *chains.get(int(frame_of[row]), ()))[:STACK_FRAMES]
    stacks = np.array([None] * len(rows), dtype=object)
    for position, frame in enumerate(frame_of[rows].tolist()):
        if frame >= 0:
            stacks[position] = FRAME_SEPARATOR.join(chains[frame])
    return np.where(pd.isna(recorded), stacks, recorded)


def cpu_op_tables(op_frames: dict[int, pd.DataFrame], keys: list[str], limit: int | None,
                  columns: list[str]) -> pd.DataFrame:
    """Per rank (`op_frames`: op_times of each), ops grouped by `keys`, the `limit` with the most total time
    first; ops whose key was not recorded are left out."""
    tables = []
    for rank, ops in op_frames.items():
        ops = ops.dropna(subset=keys)
        if ops.empty:
            continue
        grouped = ops.groupby(keys, sort=False)
        stats = grouped[FIGURES[1:]].sum()
        stats.insert(0, "count", grouped.size())
        if "mean_us" in columns:
            stats["mean_us"] = grouped["total_us"].mean().round(2)
            stats["max_us"] = grouped["total_us"].max()
        stats = stats.reset_index().sort_values("total_us", ascending=False, kind="stable").head(limit)
        stats["rank"] = rank
        tables.append(stats[columns])
    return pd.concat(tables, ignore_index=True) if tables else pd.DataFrame(columns=columns)
