"""karpathy/minGPT's chargpt.py, unmodified: its own Trainer class keeps the optimizer as an attribute (out of
the script's frames' reach at the first backward()), its model returns `(logits, loss)`, its DataLoader runs
4 workers, and after every iteration it calls `trigger_callbacks`, whose callback prints the loss every 10
iterations and samples 500 characters from the model in evaluation once in 500."""

from __future__ import annotations

import re

import numpy as np
import pytest
from script_corpus import CHARGPT_CONFIG, assert_recorded, run_chargpt

from gpuprof.report import build_report

pytestmark = [pytest.mark.slow,  # real scripts in child processes
              pytest.mark.newest_torch]  # run again on the newest torch tested (scripts/test.sh)

PRINTED = re.compile(r"iter (\d+): train loss ([\d.]+)")
ITERATIONS = CHARGPT_CONFIG["trainer.max_iters"]


@pytest.fixture(scope="module")
def chargpt(tmp_path_factory):
    return run_chargpt(tmp_path_factory.mktemp("chargpt"))


def test_its_trainer_is_recorded_from_the_end_of_its_first_iteration(chargpt):
    run = assert_recorded(chargpt, steps=ITERATIONS - 1)  # no one optimizer in reach at the first backward()
    assert run.meta["model"]["class"] == "GPT"
    assert run.meta["config"]["first_iteration"].startswith("not recorded")
    batch = CHARGPT_CONFIG["trainer.batch_size"] * CHARGPT_CONFIG["data.block_size"]
    assert (run.steps["tokens"] == batch).all()


def test_each_steps_loss_is_the_one_of_the_models_tuple_the_script_prints(chargpt):
    printed = {int(iteration): float(loss) for iteration, loss in PRINTED.findall(chargpt.stdout)}
    assert sorted(printed) == list(range(0, ITERATIONS, 10))
    losses = chargpt.run.steps.set_index("step")["loss"]
    recorded = [printed[iteration] for iteration in printed if iteration > 0]
    np.testing.assert_allclose([losses[iteration - 1] for iteration in printed if iteration > 0], recorded, atol=1e-5)


def test_a_callback_that_evaluates_once_in_500_iterations_is_not_evaluation_every_step(chargpt):
    """trigger_callbacks runs after every iteration and is found as the evaluator at the first sampling (in
    step 0): the steps whose call of it ran no evaluation have no evaluation time (all 28 had some, before)."""
    report = build_report(chargpt.run.path)
    assert report.meta["phase_sources"] == [{"role": "eval", "function": "Trainer.trigger_callbacks",
                                             "file": str(chargpt.workdir / "mingpt" / "trainer.py"), "line": 57}]
    steps = report.run.steps
    assert steps.loc[steps["eval_time_s"].notna(), "step"].tolist() == [0]  # iteration 0's sampling
    assert not report.summary.evaluation and "Evaluation" not in report.verdict.why
