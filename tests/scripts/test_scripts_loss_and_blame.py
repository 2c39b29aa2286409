"""On nanoGPT's train.py, unmodified (its model returns `(logits, loss)`, its loop fetches the next batch
between forward and backward): it is recorded, every step carries the loss, from the first iteration on,
and at batch 64 a NaN is blamed with its step, phase, module, op and cause. Faults are patched in at run time."""

from __future__ import annotations

import numpy as np
import pytest
from script_corpus import assert_recorded, nonfinite_event, run_nanogpt

from gpuprof.analysis.run import summarize

pytestmark = [pytest.mark.slow,  # real scripts in child processes
              pytest.mark.newest_torch]  # run again on the newest torch tested (scripts/test.sh)

BATCH_64 = dict(batch_size=64, block_size=32)
GPT = "model:GPT"  # nanoGPT's model class, in its model.py


@pytest.fixture(scope="module")
def unpatched(tmp_path_factory):
    """train.py as it is, iterations 0..9: what the two tests below read."""
    return run_nanogpt(tmp_path_factory.mktemp("nanogpt"), max_iters=9)


def test_nanogpt_train_py_is_recorded(unpatched):
    assert "iter 9: loss" in unpatched.stdout  # the script ran as itself: iterations 0..9
    run = assert_recorded(unpatched, steps=10)  # from the first iteration on
    assert run.meta["model"]["class"] == "GPT"


def test_ten_optimizer_steps_are_ten_rows_each_with_the_loss_backward_ran_on(unpatched):
    assert unpatched.returncode == 0, unpatched.stderr[-3000:]
    steps = unpatched.run.steps
    assert steps["step"].tolist() == list(range(10))  # iterations 0..9, the first included
    printed = [float(line.split("loss ")[1].split(",")[0]) for line in unpatched.stdout.splitlines()
               if line.startswith("iter ")]
    np.testing.assert_allclose(steps["loss"], printed, atol=1e-4)  # the loss of the model's tuple
    assert (steps["tokens"] == 4 * 32).all() and np.isfinite(steps["grad_norm"]).all()
    assert summarize(unpatched.run).health["nonfinite_loss_steps"] == 0


def test_an_lr_spike_in_the_first_iteration_is_blamed_at_batch_64(tmp_path):
    result = run_nanogpt(tmp_path, patches=[("corpus_patches:lr_spike", {"model": GPT, "at_call": 0, "lr": 1e30})],
                         max_iters=5, **BATCH_64)
    assert result.returncode == 0, result.stderr[-3000:]
    run = result.run
    assert run.steps["loss_finite"].notna().all()  # every step recorded its loss, NaN ones too
    assert summarize(run).health["nonfinite_loss_steps"] == 5  # steps 1..5, after the update of step 0
    event = nonfinite_event(result)
    print(event)
    assert (event["step"], event["phase"]) == (1, "forward")
    assert event["module"].startswith("transformer.h.0") and event["op"]
    assert event["cause"]["step"] == 0 and event["cause"]["lr"] == 1e30


def test_an_overflow_in_attention_is_blamed_at_batch_64(tmp_path):
    fault = {"model": GPT, "weight": "transformer.h.0.attn.c_attn.weight", "at_call": 3}
    result = run_nanogpt(tmp_path, patches=[("corpus_patches:attention_overflow", fault)], max_iters=4, **BATCH_64)
    event = nonfinite_event(result)
    print(event)
    assert (event["step"], event["phase"], event["module"]) == (3, "forward", "transformer.h.0.attn")
    assert "scaled_dot_product" in event["op"] and event["input_absmax"] > 1e20


def test_a_bad_embedding_row_is_blamed_at_batch_64(tmp_path):
    fault = {"model": GPT, "weight": "transformer.wte.weight", "at_call": 2}
    result = run_nanogpt(tmp_path, patches=[("corpus_patches:bad_embedding_row", fault)], max_iters=3, **BATCH_64)
    assert summarize(result.run).health["nonfinite_loss_steps"] == 2  # steps 2 and 3
    event = nonfinite_event(result)
    print(event)
    assert (event["step"], event["phase"], event["module"], event["first"]) == (2, "state", "transformer.wte", "nan")
