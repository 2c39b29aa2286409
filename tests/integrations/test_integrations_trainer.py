"""The transformers Trainer callback on real tiny Trainer runs on CPU."""

from __future__ import annotations

import numpy as np
from tiny_gpt2 import BATCH, SEQ, RandomTokens, assert_phases_cover_the_steps, tiny_model
from transformers import Trainer, TrainingArguments

import gpuprof
from gpuprof.diagnoses import diagnose
from gpuprof.integrations.transformers import GpuprofCallback


def train(tmp_path, *, steps=4, accumulation=2, delay_s=0.0, eval_delay_s=None, **callback_options):
    evaluate = {"eval_strategy": "steps", "eval_steps": 1} if eval_delay_s is not None else {}
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=BATCH,
                             gradient_accumulation_steps=accumulation, max_steps=steps, logging_steps=1,
                             report_to=[], use_cpu=True, save_strategy="no", max_grad_norm=1.0, learning_rate=1e-3,
                             per_device_eval_batch_size=BATCH, **evaluate)
    trainer = Trainer(model=tiny_model(), args=args, train_dataset=RandomTokens(delay_s=delay_s),
                      eval_dataset=RandomTokens(n_items=BATCH, delay_s=eval_delay_s or 0.0),
                      callbacks=[GpuprofCallback(**callback_options)])
    trainer.train()
    return trainer, gpuprof.load_run(tmp_path / "out" / "gpuprof")


def test_trainer_callback_records_what_the_trainer_logs(tmp_path):
    trainer, run = train(tmp_path, layer_interval=2)
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    steps = run.steps
    assert steps["step"].tolist() == [0, 1, 2, 3]
    np.testing.assert_allclose(steps["loss"], [entry["loss"] for entry in logged], rtol=1e-5)
    np.testing.assert_allclose(steps["grad_norm"], [entry["grad_norm"] for entry in logged], rtol=1e-5)
    np.testing.assert_allclose(steps["lr"], [entry["learning_rate"] for entry in logged], rtol=1e-6)
    assert steps["micro_batches"].tolist() == [2, 2, 2, 2]
    assert (steps["tokens"] == 2 * BATCH * SEQ).all()
    assert_phases_cover_the_steps(steps)
    assert run.meta["config"]["gradient_accumulation_steps"] == 2
    assert run.meta["loop"]["loader"]["pin_memory"] == trainer.args.dataloader_pin_memory
    assert run.meta["status"] == "finished"
    assert sorted(run.layers["step"].unique()) == [0, 2]


def test_a_slow_trainer_loader_is_found_dataloader_bound(tmp_path):
    _, run = train(tmp_path, steps=5, accumulation=1, delay_s=0.1, sample_interval_s=0)
    finding = next(f for f in diagnose(run, strict=True) if f.rule == "dataloader-bound")
    assert finding.evidence["num_workers"] == 0


def test_evaluation_between_steps_is_not_data_time(tmp_path):
    _, run = train(tmp_path, steps=3, accumulation=1, eval_delay_s=0.1, sample_interval_s=0)
    steps = run.steps
    assert (steps["data_time_s"] < 0.5 * BATCH * 0.1).all()  # an evaluation (0.4 s of loading) ran before each
    # the eval phase of the next step (docs/capture.md): whole from the second evaluation, once the Trainer's evaluation
    # call is found at the first; the first's loading, before its first call of the model, is the step's other time
    assert (steps["eval_time_s"] + steps["other_time_s"] > BATCH * 0.1).iloc[1:].all()
    assert (steps["eval_time_s"] > BATCH * 0.1).iloc[2:].all()
