"""x-transformers' train_enwik8.py (corpus_x_transformers.py): its batches are drawn with `next(train_loader)` from
`cycle(DataLoader(...))`, a generator the script defines, and it samples with `model.generate(...)` in its loop.
What the generator spends is data, wherever inside it the time goes; generation is evaluation, apart from the
training step, never its bound."""

from __future__ import annotations

import pytest
from corpus_x_transformers import SHRINK, run_x_transformers
from script_corpus import assert_recorded

from gpuprof.report import build_report

pytestmark = pytest.mark.slow  # a real script in a child process

DELAY_S = 0.08  # a train item's extra time inside the generator: 4 a step, several times the tiny model's step
GENERATE = dict(GENERATE_EVERY=2, GENERATE_LENGTH=64, VALIDATE_EVERY=1000)  # validation at iteration 0 alone


def measured(report):
    steps = report.run.steps
    return steps[steps["step"] >= report.summary.warmup.first_measured_step]


def test_time_inside_the_cycle_generator_is_data_and_bounds_the_step(tmp_path):
    result = run_x_transformers(tmp_path, patches=[("x_transformers_patches:slow_train_cycle",
                                                    {"delay_s": DELAY_S})])
    assert_recorded(result, steps=SHRINK["NUM_BATCHES"])
    report = build_report(result.run.path)
    steps = measured(report)
    per_step_s = DELAY_S * SHRINK["GRADIENT_ACCUMULATE_EVERY"]
    assert (steps["data_time_s"] >= per_step_s).all(), steps["data_time_s"]
    assert (steps["other_time_s"] < per_step_s / 2).all(), steps["other_time_s"]
    assert {"role": "data", "function": "cycle", "file": str(tmp_path / "work" / "train_enwik8.py"),
            "line": 26} in report.meta["phase_sources"]
    verdict = report.verdict
    assert verdict.bound == "input" and verdict.share_pct >= 60, verdict.why
    assert "cycle (train_enwik8.py:26)" in verdict.why


def test_model_generate_in_the_loop_is_evaluation_not_the_training_step(tmp_path):
    result = run_x_transformers(tmp_path, **GENERATE)
    assert_recorded(result, steps=SHRINK["NUM_BATCHES"])
    report = build_report(result.run.path)
    steps = report.run.steps
    # an iteration's generation comes after its optimizer step: in the next step; the last iteration's ends no step
    generating = {i + 1 for i in range(0, SHRINK["NUM_BATCHES"] - 1, GENERATE["GENERATE_EVERY"])}
    evaluated = steps[steps["eval_time_s"].notna()]
    assert set(evaluated["step"]) == generating
    assert (evaluated["eval_time_s"] > 3 * evaluated["other_time_s"]).all(), evaluated[["eval_time_s", "other_time_s"]]
    quiet_other_s = steps.loc[~steps["step"].isin(generating) & (steps["step"] > 0), "other_time_s"].median()
    assert evaluated["other_time_s"].median() < 4 * quiet_other_s + 0.01
    assert {"role": "eval", "function": "AutoregressiveWrapper.generate"}.items() <= report.meta["phase_sources"][
        -1].items()
    verdict = report.verdict
    # generation never decides the bound: a host share that held it would be most of a generating step, while the
    # loop's own host work (its print of loss.item(), tqdm) may still bound a run on a loaded machine
    assert verdict.bound != "host" or verdict.share_pct < report.summary.evaluation["share_pct"] / 2, verdict.why
    assert "Timed as evaluation: AutoregressiveWrapper.generate (autoregressive_wrapper.py:151)" in verdict.why
    assert report.summary.evaluation["steps_with_eval"] == len(generating & set(measured(report)["step"]))
