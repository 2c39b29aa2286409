"""Selections shared by the analyses: device/host events, profiler steps, the analysis window."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd

from gpuprof.analysis.trace.classify import PROFILER_STEP_RE, matches
from gpuprof.analysis.trace.loader import RankTrace, Trace

HOST_STEP_KINDS = ("user_annotation", "cpu_op")


def spans(events: pd.DataFrame, rows: np.ndarray | None = None) -> np.ndarray:
    """The [ts_us, end_us) intervals of `events`, or of its `rows` (a boolean mask), for gpuprof.analysis.intervals."""
    starts, ends = events["ts_us"].to_numpy(), events["end_us"].to_numpy()
    if rows is not None:
        starts, ends = starts[rows], ends[rows]
    return np.column_stack([starts, ends])


def kernel_type_spans(events: pd.DataFrame, kernel_type: str) -> np.ndarray:
    """The intervals of the device events of one of HTA's kernel types (host events have none),
    selected without copying the frame."""
    return spans(events, events["kernel_type"].eq(kernel_type).to_numpy())


def device_events(events: pd.DataFrame) -> pd.DataFrame:
    """Kernels, memcpys and memsets: the work that occupies device streams."""
    return events[events["is_device"].to_numpy()]


def host_events(events: pd.DataFrame) -> pd.DataFrame:
    return events[~events["is_device"].to_numpy()]


def profiler_steps(events: pd.DataFrame) -> pd.DataFrame:
    """Host `ProfilerStep#N` events, one per step number (the first if repeated), in time order."""
    candidates = events[events["kind"].isin(HOST_STEP_KINDS).to_numpy() & matches(events["name"], PROFILER_STEP_RE)]
    step = candidates["name"].astype(str).str.extract(PROFILER_STEP_RE.pattern, expand=False)
    steps = candidates.assign(step=step.astype(np.int64))
    return steps.sort_values("ts_us", kind="stable").drop_duplicates("step").reset_index(drop=True)


def window_rows(events: pd.DataFrame, cutoff_us: int) -> np.ndarray:
    """HTA's default analysis window, as a mask of `events`: host events starting before `cutoff_us`
    (host_cutoff_us) and the device events they launched."""
    host = ~events["is_device"].to_numpy()
    kept_host = host & (events["ts_us"].to_numpy() < cutoff_us)
    correlation = events["correlation"].to_numpy()
    launched = np.isin(correlation, correlation[kept_host & (correlation >= 0)])
    return kept_host | (~host & (correlation >= 0) & launched)


def host_cutoff_us(events: pd.DataFrame, include_last_step: bool) -> int | None:
    """Host events (and memory events) starting before this time are in the analysis window; None: all are.

    The window ends where the last profiler step starts, or with `include_last_step` where it ends.
    Traces with fewer than two steps are kept whole, as in HTA, and so are traces whose steps all
    start at once (dropping the last would leave no window at all)."""
    steps = profiler_steps(events)
    if steps["ts_us"].nunique() < 2:
        return None
    return int(steps["end_us"].max()) + 1 if include_last_step else int(steps["ts_us"].max())


def windowed(trace: Trace, include_last_step: bool) -> Trace:
    """Each rank's analysis window. `trace` is used up: each rank's frame is handed over and cut a column at
    a time, so that a rank and its window are never both in memory."""
    ranks = {rank: _windowed_rank(rank_trace, include_last_step) for rank, rank_trace in trace.ranks.items()}
    return replace(trace, ranks=ranks)


def _windowed_rank(rank_trace: RankTrace, include_last_step: bool) -> RankTrace:
    events, memory = rank_trace.events, rank_trace.memory
    cutoff = host_cutoff_us(events, include_last_step)
    if cutoff is None:
        return rank_trace
    rows = window_rows(events, cutoff)
    columns = {name: events[name].array for name in events.columns}
    rank_trace.events = events = None  # the columns are now only here: each is freed once cut
    window = pd.DataFrame({name: columns.pop(name)[rows] for name in list(columns)}, copy=False)
    return replace(rank_trace, events=window, memory=memory[memory["ts_us"].to_numpy() < cutoff].reset_index(drop=True))


def step_windows(rank_trace: RankTrace) -> pd.DataFrame:
    """Contiguous [start_us, end_us) wall-time windows, one per profiler step.

    A step runs from its host ProfilerStep start to the next step's start; the last step
    ends when both its host step and the device work launched inside it have ended.
    Without ProfilerStep markers the whole trace is one window with step -1.
    """
    events = rank_trace.events
    steps = profiler_steps(events)
    if steps.empty:
        return pd.DataFrame(
            {"step": [-1], "start_us": [events["ts_us"].min()], "end_us": [events["end_us"].max()]}
        )
    starts = steps["ts_us"].to_numpy()
    last = steps.iloc[-1]
    in_last = (~events["is_device"]) & (events["ts_us"] >= last["ts_us"]) & (events["correlation"] >= 0)
    launched = events["is_device"] & events["correlation"].isin(events.loc[in_last, "correlation"])
    last_end = max(int(last["end_us"]), int(events.loc[launched, "end_us"].max()) if launched.any() else 0)
    ends = np.append(starts[1:], last_end)
    return pd.DataFrame({"step": steps["step"].to_numpy(), "start_us": starts, "end_us": ends})


OVERVIEW_COLUMNS = [
    "rank",
    "world_size",
    "file",
    "events",
    "device_events",
    "has_device_activity",
    "profiler_steps",
    "span_us",
]


def overview(trace: Trace) -> pd.DataFrame:
    """One row per rank: what the analysis window holds."""
    rows = []
    for rank, rank_trace in trace.ranks.items():
        events = rank_trace.events
        device_count = int(events["is_device"].sum())
        span = int(events["end_us"].max() - events["ts_us"].min()) if len(events) else 0
        rows.append(
            [rank, rank_trace.world_size, str(rank_trace.path), len(events), device_count,
             device_count > 0, len(profiler_steps(events)), span]
        )
    return pd.DataFrame(rows, columns=OVERVIEW_COLUMNS)
