"""The loss is what backward() is called on (gpuprof.capture.losses): a loop passes none and gets it,
scaled by a GradScaler or not; a loop whose loss gpuprof never sees says n/a, never 0 non-finite."""

from __future__ import annotations

import pytest
import torch

import gpuprof
from gpuprof.analysis.run import summarize
from gpuprof.cli.run_report import summary_lines


def linear_loop(run_dir, steps: int, backward, accumulation: int = 1) -> list[float]:
    """A loop calling prof.step() with no loss; returns the losses it computed, per step summed."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    with gpuprof.profile(run_dir, model=model, optimizer=optimizer, sample_interval_s=0) as prof:
        for _ in range(steps):
            step_loss = 0.0
            for _ in range(accumulation):
                loss = model(torch.randn(8, 4)).square().mean() / accumulation
                backward(model, loss)
                step_loss += loss.item()
            optimizer.step()
            optimizer.zero_grad()
            prof.step()
            losses.append(step_loss)
    return losses


def plain(model, loss):
    loss.backward()


def test_the_loss_is_the_tensor_backward_ran_on_summed_over_micro_batches(tmp_path):
    losses = linear_loop(tmp_path / "run", steps=3, backward=plain, accumulation=2)
    assert gpuprof.load_run(tmp_path / "run").steps["loss"].tolist() == pytest.approx(losses, rel=1e-6)


def test_under_a_grad_scaler_the_loss_is_the_unscaled_one(tmp_path):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    losses = linear_loop(tmp_path / "run", steps=2, backward=lambda model, loss: scaler.scale(loss).backward())
    assert gpuprof.load_run(tmp_path / "run").steps["loss"].tolist() == pytest.approx(losses, rel=1e-6)


def test_a_loop_whose_loss_gpuprof_never_sees_says_n_a(tmp_path):
    def by_autograd_grad(model, loss):  # no backward(): the gradients are set by hand
        for param, grad in zip(model.parameters(), torch.autograd.grad(loss, list(model.parameters()))):
            param.grad = grad

    linear_loop(tmp_path / "run", steps=2, backward=by_autograd_grad)
    summary = summarize(gpuprof.load_run(tmp_path / "run"))
    assert summary.health["nonfinite_loss_steps"] is None
    assert "non-finite loss/grad steps n/a/0" in "\n".join(summary_lines(summary))
