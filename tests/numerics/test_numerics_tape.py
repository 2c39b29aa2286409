"""The tape records a loss's torch calls with every tensor replaced by a reference, at any depth of
the call's arguments (lists, tuples, dicts, keywords), and the replay computes the same loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from numerics_helpers import started_tape
from transformers import GPT2Config, GPT2LMHeadModel

from gpuprof.numerics.tape import REFERENCES, Const, LossCall, Output, Param, Result, replay_loss

VOCAB, SEQ, BATCH = 256, 16, 2


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # a replay computes the same
    return GPT2LMHeadModel(config)


def nested_loss(model: GPT2LMHeadModel, logits: torch.Tensor, x: torch.Tensor, weights: torch.Tensor):
    """A loss whose calls take tensors flat, inside an index tuple, in a list, as a keyword, and a Size."""
    shifted = logits[..., :-1, None:].flatten(0, 1)
    rows = shifted[torch.arange(shifted.shape[0]), :]
    both = torch.cat([rows[:BATCH], rows[BATCH:]], dim=0)
    reshaped = both.view(torch.Size([both.shape[0], VOCAB]))
    loss = F.cross_entropy(reshaped, x[:, 1:].flatten(), weight=weights, reduction="mean")
    return loss + model.lm_head.weight.square().mean() * 1e-3


def references_in(value) -> list:
    if isinstance(value, REFERENCES):
        return [value]
    if isinstance(value, (list, tuple)):
        return [ref for item in value for ref in references_in(item)]
    if isinstance(value, dict):
        return [ref for item in value.values() for ref in references_in(item)]
    assert not isinstance(value, torch.Tensor), "a tensor was recorded by value"
    return []


def one_recorded_step(model, loop):
    """(the StepTape of one step that `loop()` runs under a Tape of `model`, what loop() returned)."""
    tape = started_tape(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    try:
        result = loop()
        return tape.take(), result
    finally:
        tape.on_close(None)


def test_a_loss_with_nested_arguments_is_recorded_by_reference_and_replays_exactly():
    model = tiny_gpt2()
    x, weights = torch.randint(0, VOCAB, (BATCH, SEQ)), torch.rand(VOCAB)

    def loop():
        loss = nested_loss(model, model(x).logits, x, weights)
        loss.backward()
        return loss

    step, loss = one_recorded_step(model, loop)
    assert step.replayable, step.error
    [micro] = step.micro_batches
    calls = [item for item in micro.items if isinstance(item, LossCall)]
    refs = [ref for call in calls for ref in references_in((call.args, call.kwargs))]
    assert {type(ref) for ref in refs} == {Output, Result, Param, Const}
    [cat] = [call for call in calls if call.func is torch.cat]
    assert isinstance(cat.args[0], list) and [type(ref) for ref in cat.args[0]] == [Result, Result]
    indexings = [tuple(map(type, call.args[1])) for call in calls if type(call.args[-1]) is tuple]
    # torch.arange is not on the path from the model's outputs: its result enters by reference
    assert (Const, slice) in indexings and (type(Ellipsis), slice, slice) in indexings
    [cross_entropy] = [call for call in calls if call.func is F.cross_entropy]
    weight = cross_entropy.kwargs["weight"]
    assert isinstance(weight, Const) and micro.consts[weight.index] is weights
    assert all(call.where is not None and call.where[2] == "nested_loss" for call in calls)
    with torch.no_grad():
        assert torch.equal(replay_loss(model, micro), loss)


def next_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """nanoGPT's get_batch: about 8 torch calls a sample."""
    data = torch.randint(0, VOCAB, (10 * SEQ,))
    starts = torch.randint(len(data) - SEQ - 1, (batch_size,))
    x = torch.stack([data[i:i + SEQ].clone().to(torch.int64) for i in starts])
    y = torch.stack([data[i + 1:i + 1 + SEQ].clone().to(torch.int64) for i in starts])
    return x, y


def test_the_loss_program_is_what_the_loss_depends_on_not_the_window():
    """A batch fetch of 64 samples and a metric between forward and backward: neither is kept, and
    the replay computes the loss exactly."""
    model = tiny_gpt2()

    def loop():
        x, y = next_batch(2)
        logits = model(x).logits
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) / 2
        accuracy = (logits.argmax(-1) == y).float().mean()  # a metric: the loss does not depend on it
        next_x, _ = next_batch(64)
        loss.backward()
        return loss, accuracy, next_x

    step, (loss, accuracy, next_x) = one_recorded_step(model, loop)
    assert step.replayable, step.error
    [micro] = step.micro_batches
    calls = [item.func.__name__ for item in micro.items if isinstance(item, LossCall)]
    assert calls == ["flatten", "cross_entropy", "div"]
    with torch.no_grad():
        assert torch.equal(replay_loss(model, micro), loss)
    assert torch.isfinite(accuracy) and next_x.shape == (64, SEQ)
