"""A loop may save its whole model (`torch.save(model, f)`) or copy it (`copy.deepcopy`, an EMA) while gpuprof
records: neither the file nor the copy carries gpuprof's hooks, the loop's own hooks go along, and the
model itself goes on being recorded."""

from __future__ import annotations

import copy
import io

import torch
from capture_loop import batch, optimizer_step, tiny_model

import gpuprof

STEPS = 4
SAVED_AT = 1


def count_calls(module, args) -> None:
    """The loop's own forward pre-hook (a module-level function: picklable)."""
    module.calls = getattr(module, "calls", 0) + 1


def hook_names(module: torch.nn.Module) -> list[str]:
    return [getattr(hook, "__name__", type(hook).__name__) for hook in
            [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]]


def test_the_saved_and_the_copied_model_carry_the_loops_hooks_and_none_of_gpuprofs(tmp_path):
    model = tiny_model()
    model.register_forward_pre_hook(count_calls)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with gpuprof.profile(tmp_path / "run", model=model, optimizer=optimizer) as prof:
        for step in range(STEPS):
            optimizer_step(model, optimizer, step)
            if step == SAVED_AT:
                hooked = hook_names(model)
                saved = io.BytesIO()
                torch.save(model, saved)
                copied = copy.deepcopy(model)
            prof.step()
    assert len(hooked) > 1 and "count_calls" in hooked  # gpuprof's hooks were on the model when it was saved
    assert b"gpuprof" not in saved.getvalue()
    loaded = torch.load(io.BytesIO(saved.getvalue()), weights_only=False)
    for module in (loaded, copied):
        assert hook_names(module) == ["count_calls"]
        assert not module._forward_pre_hooks_with_kwargs and not module._forward_hooks_always_called
        inputs = batch(0)
        module(input_ids=inputs, labels=inputs).loss.backward()  # trains as the loop's model would
        assert module.calls == SAVED_AT + 2
    assert hook_names(model) == ["count_calls"]  # gpuprof's hooks left with the Profiler
    assert len(gpuprof.load_run(tmp_path / "run").steps) == STEPS
