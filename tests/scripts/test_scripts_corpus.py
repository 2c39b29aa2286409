"""Real public training scripts, unmodified, under `gpuprof run` (script_corpus.py): each is recorded."""

from __future__ import annotations

import numpy as np
from script_corpus import CLM_LINES, run_accelerate_clm, run_lightning_transformer, run_nanogpt


def assert_recorded(result, steps: int):
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.run is not None and result.run.meta["status"] == "finished"
    assert len(result.run.steps) == steps
    assert np.isfinite(result.run.steps["grad_norm"]).all()
    return result.run


def test_nanogpt_train_py_is_recorded(tmp_path):
    result = run_nanogpt(tmp_path, max_iters=6)
    assert "iter 6: loss" in result.stdout  # the script ran as itself: iterations 0..6
    run = assert_recorded(result, steps=7)  # from the first iteration on
    assert run.meta["model"]["class"] == "GPT"


def test_accelerate_clm_example_is_recorded(tmp_path):
    result = run_accelerate_clm(tmp_path)
    assert "eval perplexity" in result.stdout
    run = assert_recorded(result, steps=3 * CLM_LINES // 2)  # 3 epochs, 2 lines a batch, the first included
    assert run.steps["loss_finite"].all()  # what accelerator.backward() was given
    assert run.meta["model"]["class"] == "GPT2LMHeadModel"


def test_lightning_transformer_example_is_recorded(tmp_path):
    result = run_lightning_transformer(tmp_path, max_steps=6)
    run = assert_recorded(result, steps=6)
    assert run.meta["model"]["class"] == "LanguageModel"
