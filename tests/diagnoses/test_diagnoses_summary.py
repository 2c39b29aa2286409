"""Run summary, and the comparison of two runs' reports, on real recorded runs of the reference workload."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from gpuprof.analysis.run import summarize
from gpuprof.analysis.run.summary import WARMUP_MAX_FRACTION, WARMUP_MIN_RUN_STEPS, detect_warmup, step_times
from gpuprof.report import build_report, compare
from gpuprof.run.schema import SPLIT_PHASES


def test_summary_excludes_warmup_and_says_why(recorded_runs):
    run = recorded_runs["baseline"]
    summary = summarize(run)
    times = step_times(run.steps)
    assert summary.n_steps == len(times) == run.meta["config"]["steps"]
    assert summary.warmup.n_steps >= 1 and "first step" in summary.warmup.reason
    assert summary.measured_steps == summary.n_steps - summary.warmup.n_steps
    measured = times.iloc[summary.warmup.n_steps:]
    assert summary.step_time_p50_s == pytest.approx(measured.median())
    assert summary.step_time_p50_s <= summary.step_time_p90_s <= summary.step_time_p99_s <= measured.max()


def test_summary_figures_of_a_cpu_run(recorded_runs):
    run = recorded_runs["baseline"]
    summary = summarize(run)
    config = run.meta["config"]
    tokens_per_step = config["batch_size"] * config["seq_len"]
    assert summary.tokens_per_s == pytest.approx(tokens_per_step / summary.step_time_mean_s, rel=1e-6)
    assert sum(summary.phase_split_pct[phase] for phase in SPLIT_PHASES) == pytest.approx(100, abs=1)
    assert summary.mfu is None and summary.gpu_util_mean_pct is None, "CPU: no peak FLOP/s, no NVML"
    assert summary.health["nonfinite_loss_steps"] == 0
    # A freshly initialised LM predicts uniformly: loss about ln(vocabulary size).
    assert summary.health["loss_first"] == pytest.approx(math.log(config["vocab_size"]), abs=1.0)


def test_per_rank_figures_of_a_two_rank_run(recorded_runs):
    summary = summarize(recorded_runs["ddp_straggler"])
    assert summary.world_size == 2 and list(summary.per_rank["rank"]) == [0, 1]
    forward = summary.per_rank.set_index("rank")["forward_time_p50_s"]
    assert forward[1] > forward[0], "rank 1 sleeps inside its forward phase"
    # The run's throughput counts both ranks, paced by the slower one.
    assert summary.per_rank["tokens_per_s"].max() < summary.tokens_per_s <= summary.per_rank["tokens_per_s"].sum() * 1.01


def test_to_dict_is_plain_json(recorded_runs):
    data = summarize(recorded_runs["ddp"]).to_dict()
    assert data["warmup"]["n_steps"] >= 1 and len(data["per_rank"]) == 2
    pd.io.json.ujson_dumps(data)  # raises on numpy scalars


@pytest.mark.parametrize(
    "times, expected",
    [
        ([9, 1, 1, 1, 1, 1, 1, 1], 1),  # only step 0 slow
        ([9, 8, 7, 1, 1, 1, 1, 1, 1, 1, 1, 1], 3),  # compile-like: three slow steps
        ([9] * 4 + [1] * 4, int(8 * WARMUP_MAX_FRACTION)),  # capped share of the run
        ([9, 1, 1], 0),  # too short to exclude anything
    ],
)
def test_detect_warmup(times, expected):
    warmup = detect_warmup(pd.Series(times, dtype=float))
    assert warmup.n_steps == warmup.first_measured_step == expected
    assert (warmup.n_steps == 0) == (len(times) < WARMUP_MIN_RUN_STEPS)


def test_detect_warmup_of_a_resumed_run():
    """A run resumed from a checkpoint starts at a later step number; its warm-up is still its first steps."""
    warmup = detect_warmup(pd.Series([9.0, 1, 1, 1, 1, 1], index=range(100, 106)))
    assert (warmup.n_steps, warmup.first_measured_step) == (1, 101)


def test_compare_baseline_with_slow_loader(recorded_runs):
    comparison = compare(build_report(recorded_runs.path("baseline")), build_report(recorded_runs.path("data_delay")))
    figures = {figure.name: figure for figure in comparison.figures}
    # Shares compare in percentage points, with their interval: the loader's sleep is most of B's step.
    data_share = figures["Data share of step time"]
    assert data_share.change_unit == "pp" and data_share.change.low > 10 and data_share.call == "higher in B"
    assert data_share.b.point - data_share.a.point == pytest.approx(data_share.change.point)
    assert "MFU" not in figures, "unknown on CPU runs"
    # speedup and throughput come from the same steps: with the same tokens per step, the same number
    throughput, step_time = figures["Throughput"].change, figures["Step time, mean"].change
    assert throughput.point == pytest.approx(1 / step_time.point)
    assert (throughput.low, throughput.high) == pytest.approx((1 / step_time.high, 1 / step_time.low), rel=0.05)
    assert comparison.slowdown.low > 1 and "slower" in comparison.conclusion
    assert not comparison.blocking
    assert "dataloader-bound" in [finding.rule for finding in comparison.appeared]
    assert "attention-not-fused" in comparison.persisted
    assert "dataloader-bound" not in [finding.rule for finding in comparison.disappeared]
