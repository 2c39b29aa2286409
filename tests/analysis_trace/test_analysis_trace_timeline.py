"""The step timeline: every event of a step on its row, thinned within bounds, on a real tiny GPT-2
trace recorded by gpuprof, on synthetic traces with known answers, and on the shared GPU traces."""

from __future__ import annotations

import gzip
import json
import math
import time

import numpy as np
import pytest

from gpuprof.analysis.trace.loader import load_trace
from gpuprof.analysis.trace.timeline import (
    MAX_HOST_DEPTH, MAX_INTERVALS, WIDTH_PX, step_intervals, step_timeline, thin, trace_steps,
)
from gpuprof.analysis.trace.events import step_windows
from gpuprof.errors import GpuprofError

EVERYTHING = 10**9  # a bound no step reaches: nothing is dropped


@pytest.fixture(scope="module")
def gpt2_trace(tmp_path_factory):
    """The trace window (steps 1-2) of a tiny GPT-2 loop recorded by gpuprof.profile."""
    from gpt2_runs import record

    import gpuprof

    run_dir = record(tmp_path_factory.mktemp("timeline") / "run", steps=4, trace_steps=range(1, 3))
    return gpuprof.load_run(run_dir).trace_files


def raw_events_in_step(path, step: int) -> int:
    """Complete events overlapping the step's window, counted from the JSON itself (the loader's
    whole-µs rounding inward), annotations copied onto device rows left out."""
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    complete = [e for e in events if e.get("ph") == "X" and e.get("cat") != "Trace"]
    marks = sorted(math.ceil(e["ts"]) for e in complete if str(e["name"]).startswith("ProfilerStep#"))
    base = min(math.ceil(e["ts"]) for e in complete)
    steps = [int(e["name"].split("#")[1]) for e in sorted(complete, key=lambda e: e["ts"])
             if str(e["name"]).startswith("ProfilerStep#")]
    start = marks[steps.index(step)]
    window = step_windows(load_trace(path).ranks[0]).set_index("step")
    end = int(window.at[step, "end_us"]) + base
    return sum(1 for e in complete if e.get("cat") != "gpu_user_annotation"
               and math.ceil(e["ts"]) < end and math.floor(e["ts"] + e["dur"]) > start)


def test_gpt2_step_timeline_holds_every_event_of_the_step_on_nested_rows(gpt2_trace):
    trace = load_trace(gpt2_trace)
    assert trace_steps(trace, 0) == [1, 2]
    # a pixel of 1 µs: only events shorter than a µs merge
    timeline = step_timeline(trace, 1, 0, max_intervals=EVERYTHING, width_px=10**9)
    intervals = timeline.intervals
    assert timeline.events == raw_events_in_step(gpt2_trace[0], 1)
    window = step_windows(trace.ranks[0]).set_index("step").loc[1]
    too_deep = step_intervals(trace.ranks[0], window["start_us"], window["end_us"])["row"].isna().sum()
    assert intervals["events"].sum() == timeline.events - too_deep
    assert intervals["row"].str.extract(r"depth (\d+)$")[0].dropna().astype(int).max() == MAX_HOST_DEPTH - 1
    assert (intervals.loc[intervals["events"] > 1, "dur_us"] <= 1).all()
    step_row = intervals[intervals["name"] == "ProfilerStep#1"]
    assert step_row["row"].str.endswith("· depth 0").all() and step_row["start_us"].tolist() == [0]
    names = set(intervals["name"])
    assert {"aten::addmm", "AddmmBackward0"} <= names  # forward and backward
    assert any(name.startswith("Optimizer.step#AdamW") for name in names)
    # an op inside an op goes one row down: no two ops overlap on a row
    for row, part in intervals[intervals["events"] == 1].groupby("row"):
        part = part.sort_values("start_us")
        assert (part["end_us"].to_numpy()[:-1] <= part["start_us"].to_numpy()[1:]).all(), row
    assert intervals["row"].str.contains(r"· depth 3$").any()


def test_gpt2_step_thinned_to_a_bound_keeps_the_longest(gpt2_trace):
    trace = load_trace(gpt2_trace)
    full = step_timeline(trace, 2, 0, max_intervals=EVERYTHING)
    kept = step_timeline(trace, 2, 0, max_intervals=40)
    assert len(kept.intervals) == 40 < len(full.intervals)
    assert kept.intervals["dur_us"].min() >= full.intervals["dur_us"].nlargest(40).min()
    assert kept.events == full.events


def test_sub_pixel_kernels_merge_per_row_and_pixel_and_long_ones_stay_whole(builder, tmp_path):
    builder.step(1, 0, 100_000).step(2, 100_000, 10)
    for i in range(20_000):  # 20,000 kernels of 2 µs, back to back over 60 ms of stream 7
        builder.launch("tiny", ts=10 + 3 * i, dur=2)
    builder.launch("big_gemm", ts=70_000, dur=20_000, stream=9)
    trace = load_trace(builder.write(tmp_path / "rank-0.json"))
    timeline = step_timeline(trace, 1, 0, max_intervals=EVERYTHING, width_px=1000)  # a pixel is 100 µs
    stream7 = timeline.intervals[timeline.intervals["row"] == "stream 7"]
    assert stream7["events"].sum() == 20_000 and stream7["busy_us"].sum() == 40_000
    assert len(stream7) <= 601  # one bar per pixel the kernels touch
    assert (stream7["name"].str.startswith("tiny and ")).all()
    big = timeline.intervals[timeline.intervals["row"] == "stream 9"]
    assert big[["name", "start_us", "dur_us", "events"]].values.tolist() == [["big_gemm", 70_000, 20_000, 1]]


def test_thin_keeps_at_most_the_bound_and_accounts_every_merged_event(builder, tmp_path):
    rng = np.random.default_rng(0)
    builder.step(1, 0, 50_000).step(2, 50_000, 10)
    for start, duration, stream in zip(rng.integers(0, 49_000, 5000), rng.integers(1, 900, 5000), rng.integers(7, 11, 5000)):
        builder.launch(f"k{duration}", ts=int(start), dur=int(duration), stream=int(stream))
    intervals = step_intervals(load_trace(builder.write(tmp_path / "rank-0.json")).ranks[0], 0, 50_000)
    merged_only = thin(intervals, 50_000, max_intervals=EVERYTHING, width_px=200)
    assert merged_only["events"].sum() == len(intervals)
    assert merged_only["busy_us"].sum() == intervals["dur_us"].sum()
    bounded = thin(intervals, 50_000, max_intervals=300, width_px=200)
    assert len(bounded) == 300
    assert bounded["dur_us"].min() >= merged_only["dur_us"].nlargest(300).min()


def test_a_step_or_rank_not_in_the_trace_is_a_clear_error(gpt2_trace):
    trace = load_trace(gpt2_trace)
    with pytest.raises(GpuprofError, match=r"step 7 is not in this trace \(steps \[1, 2\]\)"):
        step_timeline(trace, 7, 0)
    with pytest.raises(GpuprofError, match=r"rank 3 is not in this trace \(ranks \[0\]\)"):
        step_timeline(trace, 1, 3)


@pytest.mark.parametrize("name", ["v100_ns_timestamps", "a100_2rank_nccl", "sampled_world128", "rocm_mi250"])
def test_shared_gpu_traces_every_step_within_bounds(shared_traces, name):
    trace = load_trace(shared_traces / name)
    rank = min(trace.ranks)
    started = time.perf_counter()
    timelines = [step_timeline(trace, step, rank) for step in trace_steps(trace, rank)]
    elapsed_s = time.perf_counter() - started
    assert elapsed_s < 60 * len(timelines)  # ~0.05 s each on a 2-core machine: only a hang fails this
    assert any(row.startswith("stream ") for timeline in timelines for row in timeline.rows)
    for timeline in timelines:
        intervals = timeline.intervals
        assert 0 < len(intervals) <= MAX_INTERVALS and intervals["events"].sum() <= timeline.events
        assert intervals["row"].str.extract(r"depth (\d+)$")[0].dropna().astype(int).max() < MAX_HOST_DEPTH
        # the longest kernel of the step is drawn whole
        events = trace.ranks[rank].events
        window = step_windows(trace.ranks[rank]).set_index("step").loc[timeline.step]
        kernels = events[events["is_device"] & (events["ts_us"] < window["end_us"]) & (events["end_us"] > window["start_us"])]
        if len(kernels) and kernels["dur_us"].max() >= timeline.step_time_us / WIDTH_PX:
            assert kernels["dur_us"].max() in set(intervals.loc[intervals["events"] == 1, "dur_us"])
