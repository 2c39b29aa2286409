"""An Accelerate loop wrapped the way docs/capture.md says, on CPU."""

from __future__ import annotations

import numpy as np
import torch
from accelerate import Accelerator
from tiny_gpt2 import BATCH, SEQ, RandomTokens, assert_phases_cover_the_steps, tiny_model

import gpuprof


def test_accelerate_loop_with_accumulation(tmp_path):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(RandomTokens(n_items=8 * BATCH), batch_size=BATCH)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    clip_norms, step_losses, micro_losses = [], [], []
    with gpuprof.profile(tmp_path / "run", model=model, optimizer=optimizer, scaler=accelerator.scaler,
                         loader=loader, sample_interval_s=0) as prof:
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                micro_losses.append(loss.detach())
                if accelerator.sync_gradients:
                    clip_norms.append(accelerator.clip_grad_norm_(model.parameters(), 0.1).item())
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                step_losses.append(torch.stack(micro_losses).mean())
                prof.step(loss=step_losses[-1], tokens=len(micro_losses) * batch["input_ids"].numel())
                micro_losses = []
    run = gpuprof.load_run(tmp_path / "run")
    steps = run.steps
    assert steps["step"].tolist() == [0, 1, 2, 3]
    assert run.meta["gradient_clipping"] == {"clipped_steps": 4, "max_norm": 0.1}  # however Accelerate clips
    assert steps["micro_batches"].tolist() == [2, 2, 2, 2]
    assert (steps["tokens"] == 2 * BATCH * SEQ).all()
    np.testing.assert_allclose(steps["grad_norm"], clip_norms, rtol=1e-5)  # the norms before clipping
    np.testing.assert_allclose(steps["loss"], [loss.item() for loss in step_losses], rtol=1e-6)
    assert not steps["step_skipped"].any()
    assert_phases_cover_the_steps(steps)  # no prof.phase() in the loop: the automatic phases
