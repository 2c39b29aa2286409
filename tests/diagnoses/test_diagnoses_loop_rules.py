"""Numerical and step-time rules on small real training loops recorded with gpuprof.profile.

The reference workload has no knob for a corrupt batch, a NaN input, an fp16 overflow or a
vanishing gradient, so each problem is made by a real 16-step loop (conftest.LOOPS) and
paired with the healthy loop, where the rule must stay silent.
"""

from __future__ import annotations

import pytest

from gpuprof.diagnoses.context import RunContext
from gpuprof.diagnoses.registry import RULES, all_rules

all_rules()


def fired(run, rule_id):
    return RULES[rule_id].findings(RunContext.of(run))


@pytest.mark.parametrize(
    "rule_id, problem, silent",
    [
        ("loss-spike", "corrupt_batch", "healthy"),
        ("exploding-gradients", "corrupt_batch", "healthy"),
        ("nonfinite-values", "nan_input", "healthy"),
        ("gradscaler-trouble", "fp16_overflow", "fp16_guarded"),
        ("lr-step-on-skipped", "fp16_overflow", "fp16_guarded"),
        ("vanishing-gradients", "vanishing", "healthy"),
        ("warmup-pollution", "slow_first_step", "healthy"),
        ("step-time-variance", "periodic_stall", "healthy"),
    ],
)
def test_rule_fires_on_problem_and_not_on_healthy(loop_runs, rule_id, problem, silent):
    assert len(fired(loop_runs[problem], rule_id)) == 1
    assert not fired(loop_runs[silent], rule_id)


def test_loss_spike_points_at_the_corrupt_batch(loop_runs):
    (finding,) = fired(loop_runs["corrupt_batch"], "loss-spike")
    assert finding.evidence["spikes"][0]["step"] == 12


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


def test_warmup_pollution_says_how_many_steps_and_why(loop_runs):
    (finding,) = fired(loop_runs["slow_first_step"], "warmup-pollution")
    assert finding.evidence["warmup_steps"] == 1
    # One 1 s step among 15 of about 30 ms at least doubles the mean.
    assert finding.evidence["inflation_pct"] > 100


def test_dataparallel(loop_runs):
    (finding,) = fired(loop_runs["dataparallel"], "dataparallel")
    assert finding.evidence["model_class"] == "DataParallel"
    assert not fired(loop_runs["healthy"], "dataparallel")
