"""gpuprof's hooks on the loop's modules, left out whenever a module is pickled or deep-copied.

A loop may save its whole model (`torch.save(model, f)`: pytorch/examples' word_language_model
does at every epoch) or copy it (`copy.deepcopy(model)` for an EMA or a reference model). torch
pickles a module's `__dict__`, its hooks with it: gpuprof's hooks, closures over a Profiler, made
that save fail ("Can't pickle local object") and the copy run gpuprof's hooks. So every hook
gpuprof puts on a module is registered here and marked, and `Module.__getstate__` (wrapped once,
at the first registration) leaves the marked ones out of the state it returns: what is saved or
copied is the module the loop would have had without gpuprof. A module class defining its own
`__getstate__` without calling `Module.__getstate__` is not covered.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Any, Callable

import torch

MARK = "_gpuprof_hook"
HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")
FLAG_DICTS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def register(module: torch.nn.Module, kind: str, hook: Callable, **options: Any):
    """`module.register_{kind}_hook(hook, **options)` (kind: forward_pre or forward), marked as gpuprof's."""
    _wrap_getstate()
    return getattr(module, f"register_{kind}_hook")(_marked(hook), **options)


def _marked(hook: Callable) -> Callable:
    try:
        setattr(hook, MARK, True)
    except AttributeError:  # a bound method: its partial carries the mark
        hook = functools.partial(hook)
        setattr(hook, MARK, True)
    return hook


def _wrap_getstate() -> None:
    original = torch.nn.Module.__getstate__
    if getattr(original, MARK, False):
        return

    @functools.wraps(original)
    def __getstate__(module):
        return _without_own_hooks(original(module))

    setattr(__getstate__, MARK, True)
    torch.nn.Module.__getstate__ = __getstate__


def _without_own_hooks(state: dict) -> dict:
    """`state` (a copy of a module's __dict__) with new hook dicts holding none of gpuprof's hooks; the
    module's own dicts are left as they are."""
    own = {key for name in HOOK_DICTS for key, hook in state.get(name, {}).items() if getattr(hook, MARK, False)}
    if not own:
        return state
    for name in (*HOOK_DICTS, *FLAG_DICTS):
        if name in state:
            state[name] = OrderedDict((key, value) for key, value in state[name].items() if key not in own)
    return state
