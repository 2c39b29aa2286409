"""Numerical rules on small real training loops recorded with gpuprof.profile; step-time rules
on written step streams.

The reference workload has no knob for a corrupt batch, a NaN input, an fp16 overflow or a
vanishing gradient, so each problem is made by a real 16-step loop (conftest.LOOPS) and
paired with the healthy loop, where the rule must stay silent.
"""

from __future__ import annotations

import pytest
from diagnoses_helpers import fired, second_rank

from gpuprof.analysis.run import summarize
from gpuprof.cli.run_report import summary_lines
from gpuprof.diagnoses.registry import all_rules
from gpuprof.diagnoses.rules import step_time

all_rules()


@pytest.mark.parametrize(
    "rule_id, problem, silent",
    [
        ("loss-spike", "corrupt_batch", "healthy"),
        ("exploding-gradients", "corrupt_batch", "healthy"),
        ("nonfinite-values", "nan_input", "healthy"),
        ("gradscaler-trouble", "fp16_overflow", "fp16_guarded"),
        ("lr-step-on-skipped", "fp16_overflow", "fp16_guarded"),
        ("vanishing-gradients", "vanishing", "healthy"),
    ],
)
def test_rule_fires_on_problem_and_not_on_healthy(loop_runs, rule_id, problem, silent):
    assert len(fired(loop_runs[problem], rule_id)) == 1
    assert not fired(loop_runs[silent], rule_id)


def test_loss_spike_points_at_the_corrupt_batch(loop_runs):
    (finding,) = fired(loop_runs["corrupt_batch"], "loss-spike")
    assert finding.evidence["spikes"][0]["step"] == 12


def test_exploding_gradients_advises_clipping_only_to_a_loop_that_does_not_clip(loop_runs):
    (unclipped,) = fired(loop_runs["corrupt_batch"], "exploding-gradients")
    assert unclipped.fix.startswith("Clip gradients: torch.nn.utils.clip_grad_norm_")
    assert unclipped.evidence["loop_clips_to"] is None
    clipped_run = loop_runs["corrupt_batch_clipped"]
    assert clipped_run.meta["gradient_clipping"] == {"clipped_steps": 16, "max_norm": 1.0}
    (clipped,) = fired(clipped_run, "exploding-gradients")  # the norm before the clip still spikes
    assert clipped.fix.startswith("The loop already clips gradients to 1, which bounds each update")
    assert clipped.evidence["loop_clips_to"] == 1.0 and "clip_grad_norm_" not in clipped.fix


def test_nonfinite_values_names_the_first_bad_step(loop_runs):
    (finding,) = fired(loop_runs["nan_input"], "nonfinite-values")
    assert finding.evidence["first_nonfinite_step"] == 6
    assert finding.severity == "critical"


def test_gradscaler_trouble_after_warmup_backoffs(loop_runs):
    (finding,) = fired(loop_runs["fp16_overflow"], "gradscaler-trouble")
    assert finding.evidence["events"][0]["step"] >= 8, "overflow starts at step 8; earlier backoffs are warm-up"
    (lr,) = fired(loop_runs["fp16_overflow"], "lr-step-on-skipped")
    assert min(lr.evidence["steps"]) >= 8


def test_vanishing_gradients_names_the_early_blocks(loop_runs):
    (finding,) = fired(loop_runs["vanishing"], "vanishing-gradients")
    assert {block["layer"] for block in finding.evidence["vanishing_blocks"]} <= {"blocks.0", "blocks.1", "blocks.2"}


# Step-time rules on written step streams: live step times on a loaded machine are not steady
# enough to keep a healthy run below their thresholds.
STEADY_S = 0.03


def step_times(write_cpu_run, times):
    return write_cpu_run(step=lambda i: {"step_time_s": times[i]}, steps=len(times))


def test_warmup_pollution_says_how_many_steps_and_why(write_cpu_run):
    (finding,) = fired(step_times(write_cpu_run, [1.0] + [STEADY_S] * 15), "warmup-pollution")
    assert finding.evidence["warmup_steps"] == 1
    # One 1 s step among 15 of 30 ms: the mean of all 16 is 0.0906 s, three times the measured one.
    assert finding.evidence["inflation_pct"] == pytest.approx(100 * (1.45 / 16 / STEADY_S - 1))


def test_warmup_pollution_threshold(write_cpu_run):
    """A first step that raises the mean by just under / over WARMUP_INFLATION_INFO_PCT."""
    steps = 16
    for factor, fires in ((0.9, False), (1.1, True)):
        extra_s = factor * step_time.WARMUP_INFLATION_INFO_PCT / 100 * STEADY_S * steps
        run = step_times(write_cpu_run, [STEADY_S + extra_s] + [STEADY_S] * (steps - 1))
        assert bool(fired(run, "warmup-pollution")) is fires


def test_step_time_variance_on_a_periodic_stall(write_cpu_run):
    stalled = [0.25 if i % 4 == 3 else STEADY_S for i in range(16)]
    (finding,) = fired(step_times(write_cpu_run, stalled), "step-time-variance")
    assert finding.evidence["slowest_steps"] == [3, 7, 11, 15]
    assert finding.evidence["step_time_cv"] >= step_time.STEP_TIME_CV_WARNING
    jitter = [STEADY_S * (1.1 if i % 2 else 0.9) for i in range(16)]  # cv 0.1
    assert not fired(step_times(write_cpu_run, jitter), "step-time-variance")


def test_periodic_evaluation_is_left_out_of_every_step_time_figure(write_cpu_run):
    """Every fourth step also evaluates for 0.25 s: the summary's step-time figures are the training step's,
    as the variance rule's are (a cv of 1.4 with evaluation in), and the headline says so."""
    eval_s = 0.25

    def step(i):
        evaluates = i % 4 == 3
        return {"step_time_s": STEADY_S + (eval_s if evaluates else 0.0), "eval_time_s": eval_s if evaluates else None}

    run = write_cpu_run(step=step, steps=16)
    summary = summarize(run)
    assert summary.measured_step_times.std(ddof=0) / summary.measured_step_times.mean() > 1
    assert summary.step_time_p99_s == pytest.approx(STEADY_S) and summary.step_time_cv == pytest.approx(0, abs=1e-9)
    assert summary.evaluation["steps_with_eval"] == 4
    assert "(evaluation left out)" in next(line for line in summary_lines(summary) if "step time   p50" in line)
    assert not fired(run, "step-time-variance")


def test_an_evaluation_on_every_rank_is_one_evaluating_step_lasting_its_slowest_ranks(write_cpu_run):
    """Both ranks of a 2-rank run evaluate in steps 3, 7, 11 and 15, rank 1 for 0.05 s longer: 4 evaluations
    (8 rows), each as long as rank 1's."""
    def evaluating(rank):
        def step(i):
            eval_s = 0.25 + 0.05 * rank if i % 4 == 3 else None
            return {"step_time_s": STEADY_S + (eval_s or 0.0), "eval_time_s": eval_s}
        return step

    run = second_rank(write_cpu_run(meta={"world_size": 2}, step=evaluating(0), steps=16), step=evaluating(1), steps=16)
    evaluation = summarize(run).evaluation
    assert (evaluation["steps_with_eval"], evaluation["every_steps"]) == (4, 4)  # steps 3, 7, 11, 15: every 4th
    assert evaluation["mean_s"] == pytest.approx(0.3)


def test_step_time_variance_says_which_phase_the_slow_steps_spend_it_in(write_cpu_run):
    """Every fourth step waits 0.2 s more for its batch: the finding says the slowest steps' extra time is data."""
    stall_s, phases = 0.2, {"forward_time_s": 0.01, "backward_time_s": 0.015, "optimizer_time_s": 0.003}

    def step(i):
        data_s = 0.002 + (stall_s if i % 4 == 3 else 0.0)
        return {"step_time_s": data_s + sum(phases.values()), "data_time_s": data_s, "other_time_s": 0.0, **phases}

    (finding,) = fired(write_cpu_run(step=step, steps=16), "step-time-variance")
    evidence = finding.evidence
    assert evidence["slow_steps_phase"] == "data" and evidence["slow_steps_excess_s"] == pytest.approx(stall_s)
    assert (evidence["slow_steps_evaluating"], evidence["slow_steps_samples"], evidence["slow_steps_sites"]) == (0, 0, {})
    assert finding.title.endswith("; the slowest steps take +0.2s more in data")
    assert finding.fix == step_time.VARIANCE_FIX  # no stack samples: no line to name


def test_step_time_variance_names_the_lines_holding_the_slow_steps_extra_time_not_a_stray_sample(write_cpu_run):
    """Every fourth step saves for 0.3 s more in other (6 stack samples at line 286); one of those steps also
    has one sample at the print the loop runs every step (line 327): under MIN_SITE_SHARE, it is not named."""
    def step(i):
        other_s = 0.002 + (0.3 if i % 4 == 3 else 0.0)
        return {"step_time_s": 0.03 + other_s, "forward_time_s": 0.01, "backward_time_s": 0.02,
                "optimizer_time_s": 0.0, "data_time_s": 0.0, "other_time_s": other_s}

    def sample(i, line):
        return {"time_unix_s": 1000.0 + i, "rank": 0, "step": i, "phase": "other", "function": "<module>",
                "file": "train.py", "line": line}

    def stacks(i):
        saving = [sample(i, 286)] * 6 if i % 4 == 3 else []
        return saving + ([sample(i, 327)] if i == 7 else [])

    (finding,) = fired(write_cpu_run(step=step, steps=16, stacks=stacks), "step-time-variance")
    evidence = finding.evidence
    assert evidence["slow_steps_phase"] == "other" and evidence["slow_steps_samples"] == 6 * 4 + 1
    assert evidence["slow_steps_sites"] == {"<module> (train.py:286)": 24}
    assert finding.fix.startswith("In the slowest steps' other time the loop was at <module> (train.py:286) (24 of 25")


def test_dataparallel(loop_runs):
    (finding,) = fired(loop_runs["dataparallel"], "dataparallel")
    assert finding.evidence["model_class"] == "DataParallel"
    assert not fired(loop_runs["healthy"], "dataparallel")
