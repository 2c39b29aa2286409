"""The module view (the TensorBoard plugin's): time per nn.Module of the model, from the `nn.Module: Name_N`
frames torch's Python tracer records (with_stack=True; with_modules=True adds TorchScript modules), each
module named by its path in the module tree ("GPT2LMHeadModel_0.GPT2Model_0.GPT2Block_1")."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from gpuprof.analysis.trace import nesting
from gpuprof.analysis.trace.classify import matches
from gpuprof.analysis.trace.loader import Trace

MODULE_FRAME_RE = re.compile(r"^nn\.Module: ")
COLUMNS = ["rank", "module", "depth", "calls", "total_us", "self_us", "device_total_us", "device_self_us"]
PATH_SEPARATOR = "."


def module_times(trace: Trace, trees: dict, limit: int | None = None) -> pd.DataFrame:
    """Per rank and module path: calls, host time (total; self: outside its child modules), and the device
    time of the kernels launched inside it (total, and self: outside its child modules), in tree order."""
    tables = []
    for rank, tree in trees.items():
        events = tree.events
        rows = np.flatnonzero(events["kind"].eq("python_function").to_numpy() & matches(events["name"], MODULE_FRAME_RE))
        if not len(rows):
            continue
        parent = tree.enclosing(rows)
        device_total, device_self = tree.device_time_us(rows, parent)
        depth = nesting.depths(parent)
        frame = pd.DataFrame({
            "module": _paths(events["name"].to_numpy()[rows], parent, depth),
            "depth": depth,
            "total_us": events["dur_us"].to_numpy()[rows],
            "self_us": tree.self_time_us(rows, parent),
            "device_total_us": device_total,
            "device_self_us": device_self,
        })
        grouped = frame.groupby(["module", "depth"], sort=False)
        stats = grouped[COLUMNS[4:]].sum().astype("int64")
        stats.insert(0, "calls", grouped.size())
        stats = stats.reset_index()
        if limit is not None:
            stats = stats.nlargest(limit, "total_us").sort_index()
        tables.append(stats.assign(rank=rank)[COLUMNS])
    return pd.concat(tables, ignore_index=True) if tables else pd.DataFrame(columns=COLUMNS)


def _paths(names: np.ndarray, parent: np.ndarray, depth: np.ndarray) -> list[str]:
    """Each module frame's path from the outermost module (parents named first: by depth)."""
    paths: list[str] = [""] * len(names)
    for row in np.argsort(depth, kind="stable").tolist():
        short = MODULE_FRAME_RE.sub("", str(names[row]))
        paths[row] = short if parent[row] < 0 else f"{paths[parent[row]]}{PATH_SEPARATOR}{short}"
    return paths
