"""The transformers Trainer callback on a real tiny Trainer run on CPU."""

from __future__ import annotations

import numpy as np
import torch
from capture_loop import SEQ, VOCAB, tiny_model
from transformers import Trainer, TrainingArguments

import gpuprof
from gpuprof.integrations.transformers import GpuprofCallback


class RandomTokens(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, index):
        tokens = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": tokens, "labels": tokens}


def test_trainer_callback_records_what_the_trainer_logs(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, max_steps=4, logging_steps=1, report_to=[],
                             use_cpu=True, save_strategy="no", max_grad_norm=1.0, learning_rate=1e-3)
    trainer = Trainer(model=tiny_model(), args=args, train_dataset=RandomTokens(),
                      callbacks=[GpuprofCallback(layer_interval=2)])
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    run = gpuprof.load_run(tmp_path / "out" / "gpuprof")
    steps = run.steps
    assert steps["step"].tolist() == [0, 1, 2, 3]
    np.testing.assert_allclose(steps["loss"], [entry["loss"] for entry in logged], rtol=1e-5)
    np.testing.assert_allclose(steps["grad_norm"], [entry["grad_norm"] for entry in logged], rtol=1e-5)
    np.testing.assert_allclose(steps["lr"], [entry["learning_rate"] for entry in logged], rtol=1e-6)
    assert steps["micro_batches"].tolist() == [2, 2, 2, 2]
    assert (steps["tokens"] == 2 * 4 * SEQ).all()
    assert (steps[["forward_time_s", "backward_time_s", "optimizer_time_s"]] > 0).all().all()
    assert run.meta["config"]["gradient_accumulation_steps"] == 2
    assert run.meta["status"] == "finished"
    assert sorted(run.layers["step"].unique()) == [0, 2]
