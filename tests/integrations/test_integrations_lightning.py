"""The Lightning callback on real tiny GPT-2 fits on CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision
from lightning_gpt2 import TinyGpt2Module, quiet_trainer
from numerics.numerics_helpers import events
from tiny_gpt2 import BATCH, SEQ, RandomTokens, assert_phases_cover_the_steps

import gpuprof
from gpuprof.analysis.run import summarize
from gpuprof.diagnoses import diagnose
from gpuprof.integrations.lightning import GpuprofCallback
from gpuprof.report import build_report


def fit(tmp_path, *, steps=4, accumulation=2, delay_s=0.0, val_delay_s=None, **trainer_options):
    module = TinyGpt2Module()
    loader = torch.utils.data.DataLoader(RandomTokens(delay_s=delay_s), batch_size=BATCH)
    validation = None
    if val_delay_s is not None:
        validation = torch.utils.data.DataLoader(RandomTokens(n_items=BATCH, delay_s=val_delay_s), batch_size=BATCH)
        trainer_options.update(val_check_interval=1, num_sanity_val_steps=0)
    trainer = quiet_trainer(max_steps=steps, accumulate_grad_batches=accumulation, default_root_dir=tmp_path,
                            callbacks=[GpuprofCallback(tmp_path / "run", layer_interval=2, sample_interval_s=0)],
                            **trainer_options)
    trainer.fit(module, loader, validation)
    return module, trainer, gpuprof.load_run(tmp_path / "run")


def step_means(values: list[float], accumulation: int) -> np.ndarray:
    return np.asarray(values).reshape(-1, accumulation).mean(axis=1)


def test_one_row_per_optimizer_step_with_norms_before_clipping(tmp_path):
    module, trainer, run = fit(tmp_path, gradient_clip_val=0.05)
    steps = run.steps
    assert steps["step"].tolist() == [0, 1, 2, 3]
    assert steps["micro_batches"].tolist() == [2, 2, 2, 2]
    assert (steps["tokens"] == 2 * BATCH * SEQ).all()
    np.testing.assert_allclose(steps["loss"], step_means(module.step_losses, 2), rtol=1e-5)
    np.testing.assert_allclose(steps["grad_norm"], module.norms_before_clipping, rtol=1e-4)
    assert (steps["grad_norm"] > 0.05).all()  # so these are the norms Lightning then clipped
    assert_phases_cover_the_steps(steps)
    assert run.meta["status"] == "finished"
    assert run.meta["config"]["accumulate_grad_batches"] == 2
    assert run.meta["compute_dtype"] == "fp32"
    assert run.meta["loop"]["loader"]["batch_size"] == BATCH
    assert sorted(run.layers["step"].unique()) == [0, 2]


def test_fp16_mixed_records_the_grad_scaler(tmp_path):
    # precision="16-mixed" on a CPU Trainer falls back to bf16; the plugin keeps fp16 and its GradScaler
    module, trainer, run = fit(tmp_path, steps=3, plugins=[MixedPrecision("16-mixed", "cpu")])
    steps = run.steps
    scaler = trainer.precision_plugin.scaler
    assert run.meta["compute_dtype"] == "fp16"
    assert steps["scaler_scale"].iloc[-1] == scaler.get_scale()
    assert not steps["step_skipped"].any()
    np.testing.assert_allclose(steps["grad_norm"], module.norms_before_clipping, rtol=1e-3)
    np.testing.assert_allclose(steps["loss"], step_means(module.step_losses, 2), rtol=1e-3)


def test_a_slow_loader_is_found_dataloader_bound(tmp_path):
    _, _, run = fit(tmp_path, steps=5, accumulation=1, delay_s=0.1)
    finding = next(f for f in diagnose(run, strict=True) if f.rule == "dataloader-bound")
    assert finding.evidence["num_workers"] == 0


def test_validation_between_steps_is_eval_not_data_nor_host(tmp_path):
    _, _, run = fit(tmp_path, steps=3, accumulation=1, val_delay_s=0.1)
    steps = run.steps
    assert (steps["data_time_s"] < 0.5 * BATCH * 0.1).all()  # a validation (0.4 s of loading) ran before each
    assert (steps["eval_time_s"] > BATCH * 0.1).iloc[1:].all()
    assert (steps["other_time_s"] < steps["eval_time_s"]).iloc[1:].all()
    report = build_report(run.path)
    assert report.summary.evaluation["steps_with_eval"] >= 1 and report.verdict.bound != "host"
    assert "Evaluation inside the loop is left out of the step's bound" in report.verdict.why


def test_a_failing_fit_leaves_a_failed_run(tmp_path):
    class Failing(TinyGpt2Module):
        def training_step(self, batch, batch_idx):
            if self.global_step == 2:
                raise RuntimeError("failing on purpose")
            return super().training_step(batch, batch_idx)

    trainer = quiet_trainer(max_steps=4, callbacks=[GpuprofCallback(tmp_path / "run")])
    with pytest.raises(RuntimeError, match="on purpose"):
        trainer.fit(Failing(), torch.utils.data.DataLoader(RandomTokens(), batch_size=BATCH))
    run = gpuprof.load_run(tmp_path / "run")
    assert run.meta["status"] == "failed"
    assert run.steps["step"].tolist() == [0, 1]


MANUAL_STEPS, ALL_PADDING_BATCH = 4, 2


class PaddedAt(RandomTokens):
    """Batch `batch` of the loader is all padding: every label ignored (-100), so its mean cross-entropy is 0/0."""

    def __init__(self, batch: int):
        super().__init__(n_items=MANUAL_STEPS * BATCH)
        self.padded = range(batch * BATCH, (batch + 1) * BATCH)

    def __getitem__(self, index):
        item = super().__getitem__(index)
        return {**item, "labels": torch.full_like(item["labels"], -100)} if index in self.padded else item


class ManualZLoss(TinyGpt2Module):
    """Manual optimization, as a user writes it: the model returns a tuple (`return_dict=False`), the step
    computes the cross-entropy outside it, backpropagates it plus a z-loss (PaLM's) through `manual_backward`,
    and returns a dict of the two parts for logging, so neither what the model nor what the step returns
    is the tensor backward ran on."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.backward_losses: list[float] = []

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        (logits,) = self.model(input_ids=batch["input_ids"], return_dict=False, use_cache=False)
        cross_entropy = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())
        z_loss = 1e-2 * torch.logsumexp(logits, dim=-1).pow(2).mean()
        optimizer.zero_grad()
        self.manual_backward(cross_entropy + z_loss)
        optimizer.step()
        self.backward_losses.append((cross_entropy + z_loss).item())
        return {"loss": cross_entropy, "z_loss": z_loss}


@pytest.fixture(scope="module")
def manual_fit(tmp_path_factory):
    """A manual-optimization fit whose batch ALL_PADDING_BATCH is all padding: that step's loss is 0/0, its
    gradients finite (no target, no gradient), so the steps after it are finite again."""
    root = tmp_path_factory.mktemp("manual")
    module = ManualZLoss()
    trainer = quiet_trainer(max_steps=MANUAL_STEPS, default_root_dir=root,
                            callbacks=[GpuprofCallback(root / "run", sample_interval_s=0)])
    trainer.fit(module, torch.utils.data.DataLoader(PaddedAt(ALL_PADDING_BATCH), batch_size=BATCH))
    return module, gpuprof.load_run(root / "run")


def test_manual_optimization_records_the_loss_manual_backward_was_given(manual_fit):
    """Each row's loss is the cross-entropy plus the z-loss, NaN only at the padded batch: the step after it
    is finite again (the forensic re-run of the bad step runs a backward of its own, which is not the loop's)."""
    module, run = manual_fit
    steps = run.steps
    assert steps["step"].tolist() == list(range(MANUAL_STEPS))
    np.testing.assert_allclose(steps["loss"], module.backward_losses, rtol=1e-5, equal_nan=True)
    assert steps["loss_finite"].tolist() == [step != ALL_PADDING_BATCH for step in range(MANUAL_STEPS)]
    assert summarize(run).health["nonfinite_loss_steps"] == 1


def test_a_nan_loss_under_manual_optimization_is_blamed_on_the_loss(manual_fit):
    """The forensic re-run takes the loss at manual_backward on its copy of the module: the 0/0 of the
    cross-entropy the training step computes outside the model."""
    _, run = manual_fit
    [event] = events(run.path, "nonfinite")
    assert (event["step"], event["phase"], event["op"], event["first"]) == (
        ALL_PADDING_BATCH, "loss", "aten::nll_loss_forward", "nan")
    assert "in training_step: cross_entropy = " in event["source"]
