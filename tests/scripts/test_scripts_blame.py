"""NaN faults in the Accelerate CLM example and the Lightning transformer example, unmodified
(script_corpus.py), patched in at run time: the blame names the step, phase, module and op, and for an
lr spike at batch 64 the step whose update caused it with the lr that update ran with. Each script sets
(Accelerate's LR scheduler after the update) or keeps (Lightning, no scheduler) its lr in its own way; the
spike comes inside the model's forward, after the step began, where a loop that sets its lr late would."""

from __future__ import annotations

import pytest
from script_corpus import nonfinite_event, run_accelerate_clm, run_lightning_transformer

pytestmark = pytest.mark.slow  # real scripts in child processes

CLM_MODEL = "transformers.models.gpt2.modeling_gpt2:GPT2LMHeadModel"  # what the example's Auto class builds
LIGHTNING_MODEL = "lightning.pytorch.demos.transformer:Transformer"  # the example's LanguageModel.model
LR_SPIKE = "corpus_patches:lr_spike"


def test_accelerate_lr_spike_at_batch_64_is_blamed_with_the_lr_of_its_update(tmp_path):
    """128 lines at 64 a batch: 2 optimizer steps an epoch, 6 in all. Step 1's update runs at lr 1e30 (its
    constant schedule puts 2e-5 back after it), so step 2's forward overflows in the first layer norm."""
    result = run_accelerate_clm(tmp_path, patches=[(LR_SPIKE, {"model": CLM_MODEL, "at_call": 1, "lr": 1e30})],
                                lines=128, args=["--per_device_batch_size", "64"])
    event = nonfinite_event(result)
    steps = result.run.steps
    assert steps["loss_finite"].tolist() == [True, True, False, False, False, False]
    assert (steps["tokens"] >= 64 * 10).all()  # every row, the first iteration's included (64 lines of 10 words)
    assert (event["step"], event["phase"], event["module"], event["op"], event["first"]) == (
        2, "forward", "transformer.h.0.ln_1", "aten::native_layer_norm", "nan")
    cause = event["cause"]
    assert (cause["step"], cause["lr"]) == (1, 1e30) and cause["median_lr"] == pytest.approx(2e-5)


def test_lightning_lr_spike_at_batch_64_is_blamed_with_the_lr_of_its_update(tmp_path):
    """Lightning runs the training step inside optimizer.step(closure): the spike set in the forward is the lr
    of that same update (SGD, gradients clipped to 0.25), and step 3's forward overflows in the first
    encoder layer's input projection."""
    result = run_lightning_transformer(
        tmp_path, max_steps=5, patches=[("corpus_patches:loader_batch_size", {"batch_size": 64}),
                                        (LR_SPIKE, {"model": LIGHTNING_MODEL, "at_call": 2, "lr": 1e30})])
    event = nonfinite_event(result)
    steps = result.run.steps
    assert (steps["tokens"] == 64 * 35).all()  # WikiText2's blocks of 35 words
    assert steps["loss_finite"].tolist() == [True, True, True, False, False]
    assert (event["step"], event["phase"], event["module"], event["op"], event["first"]) == (
        3, "forward", "model.transformer.encoder.layers.0.self_attn", "aten::mm", "inf")
    cause = event["cause"]
    assert (cause["step"], cause["lr"]) == (2, 1e30) and cause["median_lr"] == pytest.approx(0.1)


def test_lightning_attention_overflow_is_blamed_on_the_attention_scores(tmp_path):
    """The first encoder layer's query/key/value projection scaled by 1e25 before step 2: finite
    projections whose product, the attention scores, overflows (nn.MultiheadAttention's bmm)."""
    weight = "transformer.encoder.layers.0.self_attn.in_proj_weight"
    result = run_lightning_transformer(tmp_path, max_steps=3, patches=[
        ("corpus_patches:attention_overflow", {"model": LIGHTNING_MODEL, "weight": weight, "at_call": 2})])
    event = nonfinite_event(result)
    assert (event["step"], event["phase"], event["module"], event["op"], event["first"]) == (
        2, "forward", "model.transformer.encoder.layers.0.self_attn", "aten::bmm", "inf")
    assert 1e20 < event["input_absmax"] < float("inf") and event["cause"] is None
