"""NaN blame on nanoGPT's train.py, unmodified, at batch 4 to 128 (block 64): an lr spike set before training call
SPIKE_STEP is the lr of that step's update, and the blame names where the first non-finite value appeared, as a
witness outside gpuprof saw it (corpus_patches.first_nonfinite: every update's parameters and every module's
training output checked with plain hooks):
- lr 1e12: the update leaves finite weights near 1e12, and the next step's forward overflows in the first
  attention's SDPA op; the spike's step and lr are its cause (the loop evaluating in between shifts no step);
- lr nan: the update itself writes NaN into the weights, and that update is blamed (pass "optimizer", the
  parameter named), not the next step, where the loss first shows it."""

from __future__ import annotations

import json
import math

import pytest
from script_corpus import nonfinite_event, run_nanogpt

from gpuprof.cli import main
from gpuprof.run.schema import bundle_in_run

pytestmark = pytest.mark.slow  # real scripts in child processes

GPT = "model:GPT"  # nanoGPT's model class, in its model.py
SPIKE_STEP = 3  # the spiked update: one training call a step (no gradient accumulation)
BATCHES = [4, 16, 64, 128]


def spiked_run(tmp_path, batch_size: int, lr: float, **config):
    """(the run, its nonfinite event, where the witness saw the first non-finite values): iterations 0..SPIKE_STEP+1."""
    witness = tmp_path / "first_nonfinite.json"
    spike = ("corpus_patches:lr_spike", {"model": GPT, "at_call": SPIKE_STEP, "lr": lr})
    watch = ("corpus_patches:first_nonfinite", {"model": GPT, "path": str(witness)})
    result = run_nanogpt(tmp_path, patches=[spike, watch], max_iters=SPIKE_STEP + 1, batch_size=batch_size,
                         block_size=64, **config)
    return result, nonfinite_event(result), json.loads(witness.read_text())


@pytest.mark.parametrize("batch_size", BATCHES)
def test_an_lr_spike_is_blamed_in_the_forward_it_overflows(tmp_path, batch_size):
    # its own estimate_loss() at iterations 0 and SPIKE_STEP, before the spike: evaluations shift no step
    _, event, seen = spiked_run(tmp_path, batch_size, lr=1e12, eval_interval=SPIKE_STEP)
    step, module = seen["forward"]
    assert step == SPIKE_STEP + 1 and seen["update"][0] >= step  # the weights stayed finite until that forward
    assert (event["step"], event["phase"], event["module"]) == (step, "forward", module)
    assert "scaled_dot_product" in event["op"]
    assert (event["cause"]["step"], event["cause"]["lr"]) == (SPIKE_STEP, 1e12)


@pytest.mark.parametrize("batch_size", [BATCHES[0], BATCHES[-1]])
def test_an_update_that_writes_nan_is_blamed_at_that_update(tmp_path, batch_size):
    result, event, seen = spiked_run(tmp_path, batch_size, lr=math.nan)
    step, parameter = seen["update"]
    assert step == SPIKE_STEP and seen["forward"][0] == step + 1  # the loss shows it a step later
    assert (event["step"], event["phase"], event["tensor"]) == (step, "optimizer", parameter)
    assert event["module"] == parameter.rsplit(".", 1)[0] and event["first"] == "nan"
    assert event["cause"]["kind"] == "nonfinite_update" and math.isnan(event["cause"]["lr"])
    assert main(["replay", str(bundle_in_run(result.run_dir, event["bundle"]))]) == 0  # the bundle says the same
