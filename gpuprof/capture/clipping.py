"""The loop's own gradient clipping, seen as it runs: the total norm it computes and the max_norm it clips to.

Most training loops clip (nanoGPT, the Hugging Face Trainer, torchtitan, Lightning with
`gradient_clip_val`), and clipping computes exactly the norm gpuprof records: reading it saves a
pass over every gradient per step (1-2% of a step on a CPU). A clip is two calls, which a loop
reaches in one of two ways: `clip_grad_norm_` looks its helpers `_get_total_norm` and
`_clip_grads_with_norm_` up in its module at every call, and loops that split the clip
(Accelerate >= 1.16, as torch documents it) look `torch.nn.utils.get_total_norm` and
`clip_grads_with_norm_` up where they call them. Wrapping those four module attributes sees the
calls also where the loop imported `clip_grad_norm_` by name before gpuprof started. The wrappers
return what the originals return and are removed when the last watcher leaves.

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

# (gradients, norm_type, total_norm) -> None, after a total norm is computed; must not raise
NormListener = Callable[[list, float, torch.Tensor], None]
# (max_norm, or None where it is a tensor) -> None, after gradients are clipped to it; must not raise
ClipListener = Callable[[float | None], None]

_lock = threading.Lock()
_listeners: list[tuple[NormListener, ClipListener]] = []


class _CompiledClip:
    ran = False


_compiled_clip = _CompiledClip()


def compiled_clip_ran() -> bool:
    """Whether a clip ran inside compiled code since the last call (one reader per process)."""
    ran, _compiled_clip.ran = _compiled_clip.ran, False
    return ran


def _norm_seen(original: Callable) -> Callable:
    def total_norm_seen(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        total = original(tensors, norm_type, error_if_nonfinite, foreach)
        if torch.compiler.is_compiling():
            _compiled_clip.ran = True  # traced: an attribute store, which the compiled code repeats every run
        else:
            for on_norm, _ in tuple(_listeners):
                on_norm(tensors, norm_type, total)
        return total

    return total_norm_seen


def _clip_seen(original: Callable) -> Callable:
    def clip_seen(parameters, max_norm, total_norm, foreach=None):
        original(parameters, max_norm, total_norm, foreach)
        if torch.compiler.is_compiling():
            _compiled_clip.ran = True
        else:
            for _, on_clip in tuple(_listeners):
                on_clip(float(max_norm) if isinstance(max_norm, (int, float)) else None)  # a tensor: no read

    return clip_seen


# where a clip looks its two helpers up: (module, attribute) -> the wrapper that reports the call
_PLACES = {(clip_grad, "_get_total_norm"): _norm_seen, (torch.nn.utils, "get_total_norm"): _norm_seen,
           (clip_grad, "_clip_grads_with_norm_"): _clip_seen, (torch.nn.utils, "clip_grads_with_norm_"): _clip_seen}
_wrapped: dict[tuple[object, str], tuple[Callable, Callable]] = {}  # (module, attribute) -> (original, wrapper)


def watch(on_norm: NormListener, on_clip: ClipListener) -> Callable[[], None]:
    """Calls `on_norm` after every total norm a clip computes and `on_clip` after every clip; returns the
    function that stops both."""
    listeners = (on_norm, on_clip)
    with _lock:
        if not _listeners:
            _compiled_clip.ran = False  # a compiled clip that ran while nobody watched
        for (module, attribute), wrap in _PLACES.items():
            if (module, attribute) not in _wrapped:  # one left under someone else's wrapper still reports
                original = getattr(module, attribute, None)  # torch_compat lists the private ones
                if original is None:  # an older torch: that way of clipping is not seen
                    continue
                _wrapped[module, attribute] = original, wrap(original)
                setattr(module, attribute, _wrapped[module, attribute][1])
        _listeners.append(listeners)
    return lambda: _unwatch(listeners)


def _unwatch(listeners: tuple[NormListener, ClipListener]) -> None:
    """The last watcher leaving puts the originals back, except where someone wrapped a wrapper
    since (that one stays, passing calls through)."""
    with _lock:
        if listeners in _listeners:
            _listeners.remove(listeners)
        if _listeners:
            return
        for (module, attribute), (original, wrapper) in list(_wrapped.items()):
            if getattr(module, attribute) is wrapper:
                setattr(module, attribute, original)
                del _wrapped[module, attribute]
