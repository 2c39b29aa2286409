"""On CUDA, the always-on checks must not synchronize host and device on a healthy step."""

from __future__ import annotations

import contextlib

import pytest
import torch
from numerics_helpers import VOCAB, events

import gpuprof
from gpuprof.workloads.gpt2 import TrainConfig, build_model, lm_loss

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@contextlib.contextmanager
def _sync_check(enabled: bool):
    """Any host-device synchronization inside raises (torch.cuda.set_sync_debug_mode("error"))."""
    if enabled:
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_healthy_steps_do_not_sync(tmp_path, precision):
    torch.manual_seed(0)
    model = build_model(TrainConfig(model_size="tiny", vocab_size=VOCAB)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")
    dtype = torch.float16 if precision == "fp16" else torch.float32
    inputs = torch.randint(0, VOCAB, (4, 64), device="cuda")
    targets = inputs.roll(-1, 1)

    with gpuprof.profile(tmp_path, model=model, optimizer=optimizer, scaler=scaler if scaler.is_enabled() else None,
                         sample_interval_s=0, loss_fn=lambda m, b: lm_loss(m, *b),
                         numerics={"state_interval": 1}) as prof:  # every check, every step
        for step in range(6):
            checked = step >= 2  # after the first steps' allocations and lazy initialisation
            with _sync_check(checked):
                with torch.autocast("cuda", dtype=dtype, enabled=precision == "fp16"):
                    loss = lm_loss(model, inputs, targets)
                scaler.scale(loss).backward()
            if scaler.is_enabled():
                scaler.step(optimizer)  # GradScaler's own found-inf check syncs: not ours, not checked
                scaler.update()
            with _sync_check(checked):
                if not scaler.is_enabled():
                    optimizer.step()
                optimizer.zero_grad()
                prof.step(loss=loss, batch=(inputs, targets))
    assert events(tmp_path, "nonfinite") == []
    assert events(tmp_path, "collector_disabled") == []
