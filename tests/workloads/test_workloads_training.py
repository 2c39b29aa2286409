"""The workload trains: loss falls, runs repeat exactly, variants agree at step 0, resume continues."""

from __future__ import annotations

import math

import pytest

from gpuprof.workloads.gpt2 import train


def test_loss_decreases_over_a_few_dozen_steps(small):
    result = train(small(steps=24, batch_size=4, lr=3e-3, warmup_steps=3))
    assert result.steps_run == 24
    assert all(math.isfinite(loss) for loss in result.losses)
    first, last = sum(result.losses[:3]) / 3, sum(result.losses[-3:]) / 3
    assert last < first - 1.0, (first, last)
    assert result.tokens_per_s > 0 and result.peak_memory_bytes > 0


def test_same_seed_same_losses_other_seed_other_losses(small):
    first = train(small(steps=3, dropout=0.1)).losses
    assert train(small(steps=3, dropout=0.1)).losses == first
    assert train(small(steps=1, dropout=0.1, seed=7)).losses[0] != first[0]


def test_baseline_and_optimized_start_from_the_same_loss(small):
    baseline = train(small(steps=1, variant="baseline"))
    optimized = train(small(steps=1, variant="optimized", num_workers=0))
    assert optimized.config.grad_accum > 1  # the same 8 sequences, as micro-batches
    assert optimized.losses[0] == pytest.approx(baseline.losses[0], abs=0.02)


@pytest.mark.parametrize("variant", ["baseline", "optimized"])
def test_resume_continues_the_same_losses(small, tmp_path, variant):
    # the optimized variant adds a DataLoader worker, autocast and accumulation to restore
    knobs = {"variant": variant, "steps": 6, "batch_size": 4, "dropout": 0.1,
             "num_workers": 0 if variant == "baseline" else 1}
    full = train(small(**knobs, checkpoint_every=3, checkpoint_dir=str(tmp_path)))
    resumed = train(small(**knobs, resume=str(tmp_path / "step-000003.pt")))
    assert resumed.start_step == 3
    assert resumed.losses == full.losses[3:]
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == ["step-000003.pt", "step-000006.pt"]


def test_resume_from_a_folder_takes_the_latest_checkpoint(small, tmp_path):
    train(small(steps=2, batch_size=2, checkpoint_every=1, checkpoint_dir=str(tmp_path)))
    resumed = train(small(steps=3, batch_size=2, resume=str(tmp_path)))
    assert resumed.start_step == 2 and resumed.steps_run == 1
