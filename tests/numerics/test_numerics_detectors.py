"""GradScaler timeline from a real fp16 GradScaler, loss / gradient-norm spikes, per-layer gradients."""

from __future__ import annotations

import torch
from numerics_helpers import events

import gpuprof
from gpuprof.numerics.detectors import LayerGradients, SpikeDetector


def _scaled_run(run_dir, scaler: torch.amp.GradScaler, steps: int, poisoned=()):
    """A Linear model under fp16 autocast with a real GradScaler; `poisoned` steps feed an Inf input."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with gpuprof.profile(run_dir, model=model, optimizer=optimizer, scaler=scaler, sample_interval_s=0,
                         loss_fn=lambda m, x: m(x).float().pow(2).mean()) as prof:
        for step in range(steps):
            x = torch.randn(4, 8)
            if step in poisoned:
                x[0, 0] = float("inf")
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            prof.step(loss=loss, batch=x)


def test_warm_up_backoffs_are_benign(tmp_path):
    _scaled_run(tmp_path, torch.amp.GradScaler("cpu", init_scale=2.0**30), steps=24)
    backoffs = events(tmp_path, "scaler_backoff")
    assert backoffs and all(e["warm_up"] and e["severity"] == "info" for e in backoffs)
    assert [e["step"] for e in backoffs] == list(range(len(backoffs)))  # the first steps, in a row
    assert events(tmp_path, "scaler_persistent_overflow") == [] and events(tmp_path, "nonfinite") == []


def test_persistent_overflow_scale_below_one_and_recovery(tmp_path):
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=1000)
    _scaled_run(tmp_path, scaler, steps=9, poisoned=range(3, 7))
    [overflow] = events(tmp_path, "scaler_persistent_overflow")
    [below_one] = events(tmp_path, "scaler_scale_below_one")
    [recovery] = events(tmp_path, "scaler_recovery")
    assert (overflow["step"], overflow["skipped_steps"]) == (5, 3)
    assert (below_one["step"], below_one["scale"], below_one["severity"]) == (5, 0.5, "critical")
    assert (recovery["step"], recovery["skipped_steps"]) == (7, 4)
    [nonfinite] = events(tmp_path, "nonfinite")  # the Inf came in with the batch
    assert (nonfinite["step"], nonfinite["phase"], nonfinite["tensor"]) == (3, "state", "batch")


def test_spike_is_a_rolling_z_score():
    detector = SpikeDetector("loss_spike", "loss", z=6.0, window=20)
    steady = [detector.observe(step, 2.0 + 0.01 * (step % 3)) for step in range(15)]
    assert not any(steady)
    [spike] = detector.observe(15, 5.0)
    assert spike["kind"] == "loss_spike" and spike["step"] == 15 and spike["details"]["z_score"] > 6
    assert detector.observe(16, 2.01) == []


def test_exploding_and_vanishing_blocks_are_reported_once():
    names = [f"transformer.h.{i}.mlp.weight" for i in range(4)]
    layers = LayerGradients(names, factor=1e3)
    found = layers.observe(10, [1.0, 2.0e4, 1.5, 1e-5])
    assert {(e["kind"], e["details"]["layer"]) for e in found} == {
        ("exploding_gradient", "transformer.h.1"), ("vanishing_gradient", "transformer.h.3")}
    assert layers.observe(20, [1.0, 2.0e4, 1.5, 1e-5]) == []
