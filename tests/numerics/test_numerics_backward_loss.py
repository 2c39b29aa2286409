"""A loop that passes prof.step() a loss of its own still has every loss backward() ran on watched: under
fp16 and a GradScaler, a NaN in an earlier micro-batch, with only the last micro-batch's (finite) loss
passed, is a `nonfinite` event at that step. The scaler skips such a step as if it had overflowed, so
nothing else would say so."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from numerics_helpers import events

import gpuprof
from gpuprof.run.schema import EventKind

VOCAB, WIDTH, BATCH, SEQ, STEPS, BAD_STEP, ACCUMULATION = 32, 16, 2, 8, 5, 2, 2


def run_loop(run_dir, precision: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, WIDTH), torch.nn.Linear(WIDTH, VOCAB))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, enabled=precision == "fp16")
    dtype = torch.float16 if precision == "fp16" else None
    generator = torch.Generator().manual_seed(1)
    with gpuprof.profile(run_dir, model=model, optimizer=optimizer, scaler=scaler, sample_interval_s=0) as prof:
        for step in range(STEPS):
            for micro in range(ACCUMULATION):
                tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
                with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                    loss = F.cross_entropy(model(tokens).reshape(-1, VOCAB), tokens.roll(-1, 1).reshape(-1))
                if step == BAD_STEP and micro == 0:
                    loss = loss * float("nan")  # the first micro-batch's loss only
                scaler.scale(loss / ACCUMULATION).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach())  # the last micro-batch's: finite


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_a_nan_in_an_earlier_micro_batch_is_found_though_prof_step_was_given_a_finite_loss(tmp_path, precision):
    run_loop(tmp_path / "run", precision)
    run = gpuprof.load_run(tmp_path / "run")
    assert math.isfinite(run.steps.set_index("step").loss[BAD_STEP])  # the loop's own loss is what is recorded
    found = events(tmp_path / "run", EventKind.NONFINITE)
    assert [event["step"] for event in found] == [BAD_STEP], found
    assert found[0]["trigger"] == "backward_loss"
