"""Hugging Face transformers' run_clm.py, unmodified (corpus_hf_run_clm.py): the `Trainer` it builds gets gpuprof's
callback under `gpuprof run`, which records one row per optimizer step with the loss the Trainer logs; the
evaluation it runs after training is no training step, one run inside training is evaluation; a slow DataLoader is
input, and NaN faults are blamed at their step, module and pass. Faults and slowdowns are patched in at run time."""

from __future__ import annotations

import math

import numpy as np
import pytest
from corpus_hf_run_clm import (HF_RUN_CLM_BATCH, HF_RUN_CLM_BLOCK, HF_RUN_CLM_EVAL_BATCH, HF_RUN_CLM_MODEL,
                               HF_RUN_CLM_STEPS, run_hf_run_clm, written_by_trainer)
from script_corpus import assert_recorded, nonfinite_event

from gpuprof.analysis.run import summarize
from gpuprof.report import build_report

pytestmark = pytest.mark.slow  # real scripts in child processes

SLOW_EVALUATION = ("phase_patches:slow_evaluation_calls", {"model": HF_RUN_CLM_MODEL, "delay_s": 0.25})
EVAL_EVERY = 10  # optimizer steps, where the Trainer evaluates during training
DATA_DELAY_S = 0.2


@pytest.fixture(scope="module")
def clm(tmp_path_factory):
    """run_clm.py as run by hand, its closing evaluation made slow: 0.25 s more for each evaluation batch."""
    return run_hf_run_clm(tmp_path_factory.mktemp("run_clm"), patches=[SLOW_EVALUATION])


def logged_losses(result) -> list[float]:
    """The `loss` the Trainer logged at each optimizer step (every step: --logging_steps=1), at full precision."""
    history = written_by_trainer(result, "trainer_state.json")["log_history"]
    logged = {entry["step"]: entry["loss"] for entry in history if "loss" in entry}
    assert sorted(logged) == list(range(1, HF_RUN_CLM_STEPS + 1))
    return [logged[step] for step in sorted(logged)]


def evaluation_batches(result) -> int:
    return math.ceil(written_by_trainer(result, "eval_results.json")["eval_samples"] / HF_RUN_CLM_EVAL_BATCH)


def test_run_clm_is_recorded_one_row_per_optimizer_step(clm):
    assert "***** eval metrics *****" in clm.stdout  # the script ran to its end, evaluation included
    run = assert_recorded(clm, steps=HF_RUN_CLM_STEPS)
    assert run.meta["model"]["class"] == "GPT2LMHeadModel"
    assert run.meta["config"]["max_steps"] == HF_RUN_CLM_STEPS  # the Trainer's TrainingArguments
    assert run.meta["loop"]["optimizer"]["class"] == "AdamW"
    assert (run.steps["micro_batches"] == 1).all()
    assert (run.steps["tokens"] == HF_RUN_CLM_BATCH * HF_RUN_CLM_BLOCK).all()


def test_each_recorded_loss_is_the_loss_the_trainer_logs(clm):
    np.testing.assert_allclose(clm.run.steps["loss"], logged_losses(clm), rtol=1e-6)


def test_with_gradient_accumulation_a_step_is_two_micro_batches_and_the_loss_their_mean(tmp_path):
    """The Trainer scales each micro-batch's loss by the step's token count before backward(): the sum of what
    backward() ran on, which gpuprof records, is the step's mean loss that the Trainer logs."""
    result = run_hf_run_clm(tmp_path, args=["--gradient_accumulation_steps=2"])
    run = assert_recorded(result, steps=HF_RUN_CLM_STEPS)
    assert (run.steps["micro_batches"] == 2).all()
    assert (run.steps["tokens"] == 2 * HF_RUN_CLM_BATCH * HF_RUN_CLM_BLOCK).all()
    np.testing.assert_allclose(run.steps["loss"], logged_losses(result), rtol=1e-6)


def test_the_evaluation_after_training_is_no_training_step(clm):
    """trainer.evaluate() runs after trainer.train() returned, when the recording is closed: none of its slow
    batches is in a step, and the verdict is the training step's own, with no evaluation in it."""
    delay_s = SLOW_EVALUATION[1]["delay_s"]
    runtime_s = written_by_trainer(clm, "eval_results.json")["eval_runtime"]
    assert runtime_s >= evaluation_batches(clm) * delay_s  # the evaluation was slow
    steps = clm.run.steps
    assert steps["eval_time_s"].isna().all() and steps["step_time_s"].iloc[-1] < delay_s
    report = build_report(clm.run.path)
    assert not report.summary.evaluation
    verdict = report.verdict
    assert verdict.evaluation is None and "Evaluation" not in verdict.why
    # a tiny model on the CPU: bound by its work, the model's or the Trainer's Python around it, not by data
    assert verdict.bound in ("compute", "host"), verdict.why


def test_evaluation_during_training_is_evaluation_and_not_the_bound(tmp_path):
    """--eval_strategy=steps: the Trainer evaluates after optimizer step 10, inside recorded step 10; its slow
    batches are that step's evaluation time, neither data nor host work, and the verdict leaves it out."""
    delay_s = SLOW_EVALUATION[1]["delay_s"]
    result = run_hf_run_clm(tmp_path, patches=[SLOW_EVALUATION],
                            args=["--eval_strategy=steps", f"--eval_steps={EVAL_EVERY}"])
    run = assert_recorded(result, steps=HF_RUN_CLM_STEPS)
    steps = run.steps.set_index("step")
    assert steps.index[steps["eval_time_s"].notna()].tolist() == [EVAL_EVERY]
    evaluating = steps.loc[EVAL_EVERY]
    assert evaluating["eval_time_s"] >= evaluation_batches(result) * delay_s
    assert evaluating["data_time_s"] < delay_s and evaluating["other_time_s"] < delay_s
    verdict = build_report(run.path).verdict
    assert verdict.evaluation["steps_with_eval"] == 1
    assert "Evaluation inside the loop is left out of the step's bound: 1 time(s)" in verdict.why
    assert verdict.bound in ("compute", "host"), verdict.why


def test_a_slow_dataloader_makes_it_input_bound(tmp_path):
    """The Trainer fetches each step's batches before on_step_begin: with every batch 0.2 s slower to fetch, that
    wait is data, the verdict is input, and its fix names the TrainingArguments the Trainer builds its loader from."""
    result = run_hf_run_clm(tmp_path, patches=[("phase_patches:slow_dataloader_fetch", {"delay_s": DATA_DELAY_S})])
    report = build_report(assert_recorded(result, steps=HF_RUN_CLM_STEPS).path)
    steps = report.run.steps
    measured = steps[steps["step"] >= report.summary.warmup.first_measured_step]
    assert (measured["data_time_s"] >= DATA_DELAY_S).all() and (measured["forward_time_s"] < DATA_DELAY_S).all()
    verdict = report.verdict
    assert verdict.bound == "input" and verdict.share_pct >= 60, verdict.why
    [finding] = report.findings_in("input")
    assert finding.rule == "dataloader-bound" and finding.evidence["num_workers"] == 0
    workers = finding.evidence["estimate_workers"]  # as many as the host's cores allow, what the estimate assumes
    assert verdict.next_step.startswith(finding.fix) and f"TrainingArguments(dataloader_num_workers={workers}" in finding.fix


def test_an_lr_spike_is_blamed_on_the_update_of_the_step_before(tmp_path):
    """lr 1e30 set in the forward of step 3, after the Trainer's scheduler set that step's lr: step 3's update
    runs with it (the scheduler puts its own back after), and step 4's forward turns NaN in the first layer norm.
    The Trainer logs a stand-in for a non-finite loss (logging_nan_inf_filter); gpuprof records the NaN."""
    result = run_hf_run_clm(tmp_path, patches=[
        ("corpus_patches:lr_spike", {"model": HF_RUN_CLM_MODEL, "at_call": 3, "lr": 1e30})])
    event = nonfinite_event(result)
    steps = result.run.steps
    assert steps["loss_finite"].tolist() == [True] * 4 + [False] * (HF_RUN_CLM_STEPS - 4)
    assert np.isfinite(logged_losses(result)).all()
    assert (event["step"], event["phase"], event["module"], event["op"], event["first"]) == (
        4, "forward", "transformer.h.0.ln_1", "aten::native_layer_norm", "nan")
    cause = event["cause"]
    assert (cause["step"], cause["lr"]) == (3, 1e30)
    assert cause["median_lr"] == pytest.approx(steps["lr"].iloc[:3].median())  # the schedule's, before the spike


def test_a_bad_embedding_row_is_blamed_on_the_weight_before_the_step(tmp_path):
    fault = {"model": HF_RUN_CLM_MODEL, "weight": "transformer.wte.weight", "at_call": 4}
    result = run_hf_run_clm(tmp_path, patches=[("corpus_patches:bad_embedding_row", fault)])
    assert summarize(result.run).health["nonfinite_loss_steps"] == HF_RUN_CLM_STEPS - 4  # steps 4 to the last
    event = nonfinite_event(result)
    assert (event["step"], event["phase"], event["module"], event["tensor"], event["first"]) == (
        4, "state", "transformer.wte", "transformer.wte.weight", "nan")
