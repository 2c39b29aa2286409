"""The tape records a loss's torch calls with every tensor replaced by a reference, at any depth of
the call's arguments (lists, tuples, dicts, keywords), and the replay computes the same loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

from gpuprof.numerics.tape import REFERENCES, Const, LossCall, Output, Param, Result, Tape, replay_loss

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


def test_a_loss_with_nested_arguments_is_recorded_by_reference_and_replays_exactly():
    model = tiny_gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    tape = Tape(model)
    tape.on_start(type("Prof", (), {"optimizer": optimizer}))
    try:
        x, weights = torch.randint(0, VOCAB, (BATCH, SEQ)), torch.rand(VOCAB)
        loss = nested_loss(model, model(x).logits, x, weights)
        loss.backward()
        step = tape.take()
    finally:
        tape.on_close(None)

    assert step.replayable, step.error
    [micro] = step.micro_batches
    calls = [item for item in micro.items if isinstance(item, LossCall)]
    refs = [ref for call in calls for ref in references_in((call.args, call.kwargs))]
    assert {type(ref) for ref in refs} == {Output, Result, Param, Const}
    [cat] = [call for call in calls if call.func is torch.cat]
    assert isinstance(cat.args[0], list) and [type(ref) for ref in cat.args[0]] == [Result, Result]
    indexings = [tuple(map(type, call.args[1])) for call in calls if type(call.args[-1]) is tuple]
    assert (Result, slice) in indexings and (type(Ellipsis), slice, slice) in indexings
    [cross_entropy] = [call for call in calls if call.func is F.cross_entropy]
    weight = cross_entropy.kwargs["weight"]
    assert isinstance(weight, Const) and micro.consts[weight.index] is weights
    assert all(call.where is not None and call.where[2] == "nested_loss" for call in calls)
    with torch.no_grad():
        assert torch.equal(replay_loss(model, micro), loss)
