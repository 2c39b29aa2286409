"""benchmarks/overhead.py's `entries` component: its empty hooks are entered from every torch event it
names, once per step as gpuprof's are, and leave the loop's numerics, hooks and mode stack as they were."""

from __future__ import annotations

import collections
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.overrides import _get_current_function_mode_stack
from repo_scripts import load_script
from transformers import GPT2Config, GPT2LMHeadModel

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "overhead.py"


def _overhead_module():
    return load_script(SCRIPT, "overhead_benchmark")


def _train(prof, model, optimizer, tokens, steps: int, seen_modes: list[tuple[int, int]]) -> list[float]:
    losses = []
    for _ in range(steps):
        logits = model(input_ids=tokens).logits
        after_forward = len(_get_current_function_mode_stack())
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        seen_modes.append((after_forward, len(_get_current_function_mode_stack())))
        optimizer.zero_grad(set_to_none=True)
        prof.step(loss=loss, tokens=tokens.numel())
        losses.append(loss.item())
    return losses


def _model_and_optimizer():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_empty_entries_are_entered_every_step_and_change_nothing(monkeypatch):
    overhead = _overhead_module()
    calls = collections.Counter()
    monkeypatch.setattr(overhead, "_nothing", lambda *args, **kwargs: calls.update([len(args)]))
    tokens = torch.randint(0, 64, (2, 16))
    bare_model, bare_optimizer = _model_and_optimizer()
    bare = _train(overhead.Bare(), bare_model, bare_optimizer, tokens, 3, [])
    model, optimizer = _model_and_optimizer()
    backward, hooks = torch.autograd.backward, dict(model._forward_pre_hooks)
    modes: list[tuple[int, int]] = []
    with overhead.EmptyEntries(model, optimizer) as entries:
        assert torch.autograd.backward is not backward
        entered = _train(entries, model, optimizer, tokens, 3, modes)
    assert entered == bare  # bitwise: the hooks do nothing to the loop
    assert modes == [(1, 0)] * 3  # the window is open from the forward's end until the optimizer's step
    # per step: the forward pre-hook and the optimizer's post-hook (3 arguments each), two engine callbacks
    # and prof.step (none: keyword arguments only)
    assert calls == {3: 2 * 3, 0: 3 * 3}
    assert torch.autograd.backward is backward and dict(model._forward_pre_hooks) == hooks
    assert _get_current_function_mode_stack() == []
