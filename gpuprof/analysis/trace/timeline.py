"""The intervals of one profiler step, row by row, thinned for drawing: the Timeline page's data.

Rows: each device stream (kernels, memcpys, memsets) and each host thread at each nesting depth
(an op inside an op goes one row down, as in Perfetto); Python frames (with_stack=True) on lanes of
their own below a thread's ops. A browser draws a few thousand bars
fluidly, not a step's hundred thousand events, so `thin` merges the intervals shorter than
one pixel of the drawn step per row and pixel, and, when more remain than asked, keeps the
longest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from gpuprof.analysis.trace.events import step_windows
from gpuprof.analysis.trace.loader import RankTrace, Trace
from gpuprof.errors import GpuprofError

MAX_INTERVALS = 2000
WIDTH_PX = 1600
# Host ops nested deeper than this are not drawn: they are the shortest, and each level is a row.
MAX_HOST_DEPTH = 6
# Python frames (with_stack=True) nest as deep as the program's stack: they get lanes of their own, below the
# ops (whose depth counts ops alone), and only the outermost of them, so they never crowd out an op.
PYTHON_KIND = "python_function"
MAX_PYTHON_DEPTH = 3
# Annotations copied onto the device timeline repeat host ranges; they are not work on a stream.
SKIPPED_KINDS = ("gpu_user_annotation",)
COLUMNS = ["row", "kind", "name", "start_us", "end_us", "dur_us", "busy_us", "events"]


@dataclass
class StepTimeline:
    """One step of one rank: `intervals` holds what to draw (times from the step's start, in µs);
    `events` counts the step's events before thinning (ops nested too deep to draw included)."""

    rank: int
    step: int
    step_time_us: int
    intervals: pd.DataFrame
    events: int

    @property
    def rows(self) -> list[str]:
        """The rows top to bottom: host threads by depth, then device streams, numbers in numeric order."""
        return sorted(self.intervals["row"].unique(), key=_row_key)


def _row_key(row: str) -> tuple:
    return row.startswith("stream"), [int(part) if part.isdigit() else part for part in re.findall(r"\d+|\D+", row)]


def trace_steps(trace: Trace, rank: int) -> list[int]:
    """The profiler steps of `rank` in `trace` (a trace without step markers is one step, -1)."""
    return step_windows(_rank_trace(trace, rank))["step"].tolist()


def step_timeline(trace: Trace, step: int, rank: int, max_intervals: int = MAX_INTERVALS,
                  width_px: int = WIDTH_PX) -> StepTimeline:
    """The timeline of profiler step `step` on `rank` of a loaded trace (loader.load_trace)."""
    rank_trace = _rank_trace(trace, rank)
    windows = step_windows(rank_trace).set_index("step")
    if step not in windows.index:
        raise GpuprofError(f"step {step} is not in this trace (steps {windows.index.tolist()})")
    start_us, end_us = int(windows.at[step, "start_us"]), int(windows.at[step, "end_us"])
    intervals = step_intervals(rank_trace, start_us, end_us)
    return StepTimeline(rank, step, end_us - start_us, thin(intervals, end_us - start_us, max_intervals, width_px),
                        len(intervals))


def _rank_trace(trace: Trace, rank: int) -> RankTrace:
    if rank not in trace.ranks:
        raise GpuprofError(f"rank {rank} is not in this trace (ranks {sorted(trace.ranks)})")
    return trace.ranks[rank]


def step_intervals(rank_trace: RankTrace, start_us: int, end_us: int) -> pd.DataFrame:
    """Every event overlapping [start_us, end_us), one row each, times relative to start_us; `row` is
    None for host ops nested deeper than MAX_HOST_DEPTH (counted, not drawn)."""
    events = rank_trace.events
    inside = (events["ts_us"].to_numpy() < end_us) & (events["end_us"].to_numpy() > start_us)
    events = events[inside & ~events["kind"].isin(SKIPPED_KINDS).to_numpy()]
    device = events["is_device"].to_numpy()
    frame = pd.DataFrame({
        "row": np.where(device, _stream_rows(events), _thread_rows(events)),
        "kind": events["kind"].astype(str).to_numpy(),
        "name": events["name"].astype(str).to_numpy(),
        "start_us": events["ts_us"].to_numpy() - start_us,
        "end_us": events["end_us"].to_numpy() - start_us,
    })
    frame["dur_us"] = frame["end_us"] - frame["start_us"]
    return frame.assign(busy_us=frame["dur_us"], events=1)[COLUMNS].reset_index(drop=True)


def _stream_rows(events: pd.DataFrame) -> np.ndarray:
    stream = events["stream"].to_numpy()
    tid = events["tid"].astype(str).to_numpy()
    return np.array([f"stream {s}" if s >= 0 else f"stream {t}" for s, t in zip(stream, tid)], dtype=object)


def _thread_rows(events: pd.DataFrame) -> np.ndarray:
    """`thread T · depth D` for host ops, `thread T · python D` for Python frames; None past their
    deepest lane (and for device events)."""
    rows = np.full(len(events), None, dtype=object)
    host = np.flatnonzero(~events["is_device"].to_numpy())
    tids = events["tid"].astype(str).to_numpy()[host]
    python = (events["kind"].astype(str).to_numpy() == PYTHON_KIND)[host]
    starts = events["ts_us"].to_numpy()[host]
    ends = events["end_us"].to_numpy()[host]
    lanes = {False: ("depth", MAX_HOST_DEPTH), True: ("python", MAX_PYTHON_DEPTH)}
    for tid, is_python in dict.fromkeys(zip(tids.tolist(), python.tolist())):
        lane, deepest = lanes[is_python]
        on_lane = np.flatnonzero((tids == tid) & (python == is_python))
        order = on_lane[np.lexsort((-(ends[on_lane]), starts[on_lane]))]  # parents before children
        for position, depth in zip(order, nesting_depths(starts[order], ends[order])):
            if depth < deepest:
                rows[host[position]] = f"thread {tid} · {lane} {depth}"
    return rows


def nesting_depths(starts: np.ndarray, ends: np.ndarray) -> list[int]:
    """How many earlier intervals still enclose each one (input sorted by start, longest first)."""
    open_ends: list[int] = []
    depths = []
    for start, end in zip(starts.tolist(), ends.tolist()):
        while open_ends and open_ends[-1] <= start:
            open_ends.pop()
        depths.append(len(open_ends))
        open_ends.append(end)
    return depths


def thin(intervals: pd.DataFrame, span_us: int, max_intervals: int = MAX_INTERVALS,
         width_px: int = WIDTH_PX) -> pd.DataFrame:
    """At most `max_intervals` rows that draw like `intervals` on `width_px` pixels for `span_us`.

    Intervals shorter than a pixel merge per row and pixel into one spanning them all (named
    after the longest, `events` counting them, `busy_us` their summed time); then the longest
    rows are kept. Rows without a `row` are not drawn."""
    intervals = intervals[intervals["row"].notna()]
    pixel_us = max(1.0, span_us / width_px)
    short = intervals["dur_us"].to_numpy() < pixel_us
    merged = _merge_per_pixel(intervals[short], pixel_us)
    drawn = pd.concat([intervals[~short], merged], ignore_index=True)
    if len(drawn) > max_intervals:
        drawn = drawn.nlargest(max_intervals, "dur_us", keep="first")
    return drawn.sort_values(["row", "start_us"], kind="stable", ignore_index=True)[COLUMNS]


def _merge_per_pixel(short: pd.DataFrame, pixel_us: float) -> pd.DataFrame:
    if short.empty:
        return short
    pixel = (short["start_us"] // pixel_us).astype(np.int64)
    groups = short.sort_values("dur_us", ascending=False, kind="stable").groupby(["row", pixel], sort=False)
    merged = groups.agg(kind=("kind", "first"), name=("name", "first"), start_us=("start_us", "min"),
                        end_us=("end_us", "max"), busy_us=("busy_us", "sum"), events=("events", "sum"))
    merged = merged.reset_index(level=0).reset_index(drop=True)
    several = merged["events"] > 1
    merged.loc[several, "name"] = merged.loc[several, "name"] + " and " + (merged.loc[several, "events"] - 1).astype(
        str) + " more"
    return merged.assign(dur_us=merged["end_us"] - merged["start_us"])
