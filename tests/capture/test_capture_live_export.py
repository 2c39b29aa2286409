"""`profile(..., live_export=DIR)`: a real loop's steps stream to TensorBoard as it trains, read back with
TensorBoard's own reader; a backend that cannot be written switches itself off and the loop goes on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import GPT2Config, GPT2LMHeadModel

import gpuprof
from gpuprof.run.schema import EventKind

STEPS = 6


def train(run_dir, live_export) -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                       bos_token_id=0, eos_token_id=0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with gpuprof.profile(run_dir, model=model, optimizer=optimizer, live_export=live_export) as prof:
        for _ in range(STEPS):
            tokens = torch.randint(0, 64, (2, 16))
            logits = model(input_ids=tokens[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            prof.step(tokens=tokens.numel())


def test_every_step_streams_once_with_the_values_the_run_records(tmp_path):
    train(tmp_path / "run", tmp_path / "live")
    run = gpuprof.load_run(tmp_path / "run")
    accumulator = EventAccumulator(str(tmp_path / "live" / "rank-0"), size_guidance={"scalars": 0})
    accumulator.Reload()
    for column in ("step_time_s", "loss", "grad_norm", "tokens_per_s"):
        scalars = accumulator.Scalars(f"steps/{column}")
        assert [scalar.step for scalar in scalars] == list(range(STEPS))
        np.testing.assert_allclose([scalar.value for scalar in scalars], run.steps[column].astype(float), rtol=1e-6)
    assert run.meta["live_export"] == {"to": "tensorboard", "log_dir": str(tmp_path / "live")}


@pytest.mark.capture_may_switch_off
def test_a_folder_that_cannot_be_written_switches_the_stream_off_and_the_loop_records_every_step(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    train(tmp_path / "run", blocker / "live")
    run = gpuprof.load_run(tmp_path / "run")
    assert run.steps["step"].tolist() == list(range(STEPS)) and run.steps["loss"].notna().all()
    [off] = run.events[run.events["kind"] == EventKind.COLLECTOR_DISABLED]["details"]
    assert off["collector"] == "live_export"


def test_gpuprof_run_streams_an_unmodified_script(tmp_path):
    script = Path(__file__).resolve().parents[1] / "tune" / "slow_loader.py"
    done = subprocess.run([sys.executable, "-m", "gpuprof", "run", "--run-dir", str(tmp_path / "run"), "--live-export",
                           str(tmp_path / "live"), str(script), "--item-delay-ms", "0", "--steps", "4"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    run = gpuprof.load_run(tmp_path / "run")
    accumulator = EventAccumulator(str(tmp_path / "live" / "rank-0"), size_guidance={"scalars": 0})
    accumulator.Reload()
    assert len(run.steps) == 4
    assert [scalar.step for scalar in accumulator.Scalars("steps/step_time_s")] == run.steps["step"].tolist()
