"""The total gradient norm the loop's own `torch.nn.utils.clip_grad_norm_` computes, seen as it is computed.

Most training loops clip (nanoGPT, the Hugging Face Trainer, torchtitan, Lightning with
`gradient_clip_val`), and clipping computes exactly the norm gpuprof records: reading it saves a
pass over every gradient per step (1-2% of a step on a CPU). `clip_grad_norm_` looks its helper
`_get_total_norm` up in its module at every call, so wrapping that module attribute sees the call
also where the loop imported `clip_grad_norm_` by name before gpuprof started. The wrapper returns
what the original returns and is removed when the last watcher leaves.

A `clip_grad_norm_` inside torch.compile'd code (a whole training step compiled) runs as part of a
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
_original = None


class _CompiledClip:
    ran = False


_compiled_clip = _CompiledClip()


def compiled_clip_ran() -> bool:
    """Whether a clip ran inside compiled code since the last call (one reader per process)."""
    ran, _compiled_clip.ran = _compiled_clip.ran, False
    return ran


def _total_norm_seen(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    total = _original(tensors, norm_type, error_if_nonfinite, foreach)
    if torch.compiler.is_compiling():
        _compiled_clip.ran = True  # traced: an attribute store, which the compiled code repeats every run
    else:
        for listener in tuple(_listeners):
            listener(tensors, norm_type, total)
    return total


def watch(listener: Listener) -> Callable[[], None]:
    """Calls `listener` after every total norm `clip_grad_norm_` computes; returns the function that stops it."""
    global _original
    with _lock:
        if _original is None:
            _original = clip_grad._get_total_norm
            clip_grad._get_total_norm = _total_norm_seen
            _compiled_clip.ran = False  # a compiled clip that ran while nobody watched
        _listeners.append(listener)
    return lambda: _unwatch(listener)


def _unwatch(listener: Listener) -> None:
    """The last watcher leaving puts the original back, unless someone wrapped the wrapper since
    (then it stays, passing calls through)."""
    global _original
    with _lock:
        if listener in _listeners:
            _listeners.remove(listener)
        if not _listeners and clip_grad._get_total_norm is _total_norm_seen:
            clip_grad._get_total_norm = _original
            _original = None
