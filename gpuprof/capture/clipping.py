"""The total gradient norm the loop's own clip computes, seen as it is computed.

Most training loops clip (nanoGPT, the Hugging Face Trainer, torchtitan, Lightning with
`gradient_clip_val`), and clipping computes exactly the norm gpuprof records: reading it saves a
pass over every gradient per step (1-2% of a step on a CPU). A clip reaches the norm in one of two
ways: `clip_grad_norm_` looks its helper `_get_total_norm` up in its module at every call, and
loops that split the clip (Accelerate >= 1.16: `get_total_norm`, then `clip_grads_with_norm_`, as
torch documents it) look `torch.nn.utils.get_total_norm` up where they call it. Wrapping both
module attributes sees the call also where the loop imported `clip_grad_norm_` by name before
gpuprof started. The wrappers return what the originals return and are removed when the last
watcher leaves.

A clip inside torch.compile'd code (a whole training step compiled) runs as part of a
graph, where no listener can run: it only sets a flag, which dynamo replays on every run of that
code, and `compiled_clip_ran()` reads. gpuprof then takes its own norm at the end of each backward
pass, before the clip (gpuprof.capture.gradients).
"""

from __future__ import annotations

import threading
from typing import Callable

import torch
from torch.nn.utils import clip_grad

# (gradients, norm_type, total_norm) -> None; must not raise
Listener = Callable[[list, float, torch.Tensor], None]

_lock = threading.Lock()
_listeners: list[Listener] = []
# where a clip looks the total norm up: (module, attribute)
_PLACES = ((clip_grad, "_get_total_norm"), (torch.nn.utils, "get_total_norm"))
_wrapped: dict[tuple[object, str], tuple[Callable, Callable]] = {}  # (module, attribute) -> (original, wrapper)


class _CompiledClip:
    ran = False


_compiled_clip = _CompiledClip()


def compiled_clip_ran() -> bool:
    """Whether a clip ran inside compiled code since the last call (one reader per process)."""
    ran, _compiled_clip.ran = _compiled_clip.ran, False
    return ran


def _seen(original: Callable) -> Callable:
    def total_norm_seen(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        total = original(tensors, norm_type, error_if_nonfinite, foreach)
        if torch.compiler.is_compiling():
            _compiled_clip.ran = True  # traced: an attribute store, which the compiled code repeats every run
        else:
            for listener in tuple(_listeners):
                listener(tensors, norm_type, total)
        return total

    return total_norm_seen


def watch(listener: Listener) -> Callable[[], None]:
    """Calls `listener` after every total norm a clip computes; returns the function that stops it."""
    with _lock:
        if not _listeners:
            _compiled_clip.ran = False  # a compiled clip that ran while nobody watched
        for module, attribute in _PLACES:
            if (module, attribute) not in _wrapped:  # one left under someone else's wrapper still reports
                original = getattr(module, attribute)
                _wrapped[module, attribute] = original, _seen(original)
                setattr(module, attribute, _wrapped[module, attribute][1])
        _listeners.append(listener)
    return lambda: _unwatch(listener)


def _unwatch(listener: Listener) -> None:
    """The last watcher leaving puts the originals back, except where someone wrapped a wrapper
    since (that one stays, passing calls through)."""
    with _lock:
        if listener in _listeners:
            _listeners.remove(listener)
        if _listeners:
            return
        for (module, attribute), (original, wrapper) in list(_wrapped.items()):
            if getattr(module, attribute) is wrapper:
                setattr(module, attribute, original)
                del _wrapped[module, attribute]
