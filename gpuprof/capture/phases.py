"""Automatic phases: every step split into data / forward / backward / optimizer with no markup.

From hooks on the objects the loop hands to the Profiler, with the Profiler's clock:
- forward: a training call of the root module (`module.training` and grad enabled), from its
  forward pre-hook to the start of the backward pass through its output (a prehook on the
  grad_fn of the first output tensor: a Hugging Face model's loss, else its logits). A loss computed outside the model therefore counts as forward, and
  so does anything else the loop does between the model call and `backward()`. With no backward
  through the outputs, the forward ends at the module's forward hook.
- backward: from that start to the end of the autograd pass (gpuprof.capture.backward, seen as
  `on_after_backward`); from the end of the forward when the pass did not start at its outputs.
- optimizer: `optimizer.step()` itself, from its step pre-hook to its step post-hook.
- data: host time from the start of the step (the previous `prof.step()`) to its first call of
  the model (an evaluation call ends it too). Later micro-batches' loading, evaluation, clipping,
  `zero_grad` and logging are `other`.

Explicit `prof.phase(name)` spans win, per step and name (the Profiler merges the two).
Each hook does constant work (a clock stamp, a few attribute writes): nothing per parameter.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from gpuprof.capture.timing import PhaseTimes
from gpuprof.optimizers import has_step_hooks
from gpuprof.run.schema import EventKind


def is_training_call(module: torch.nn.Module) -> bool:
    """A forward call that builds a graph for a training backward (not eval, no_grad or inference_mode)."""
    return module.training and torch.is_grad_enabled()


def _first_graph_output(output: Any) -> torch.Tensor | None:
    """The first tensor with a grad_fn that a forward returned: itself, or the first at the top level of a
    tuple, list, dict or ModelOutput (a Hugging Face model's loss when it computed one, else its logits)."""
    values = [output] if isinstance(output, torch.Tensor) else output.values() if isinstance(output, Mapping) \
        else output if isinstance(output, (tuple, list)) else ()
    return next((value for value in values if isinstance(value, torch.Tensor) and value.grad_fn is not None), None)


class PhaseHooks:
    """A collector timing the phases of each step from model, autograd and optimizer hooks."""

    name = "phases"

    def __init__(self, model: Any, optimizer: Any, clock):
        self._model, self._optimizer, self._clock = model, optimizer, clock
        self._handles: list = []
        self._backward_prehook = None
        self._times: PhaseTimes | None = None
        self._data_start: float | None = None
        self._forward_start = self._forward_end = self._backward_start = self._optimizer_start = None

    # ------------------------------------------------------------------ collector hooks
    def on_start(self, prof) -> None:
        unavailable = [gap for gap in (self._hook_model(prof), self._hook_optimizer(prof)) if gap]
        if unavailable:
            self._report(prof, unavailable)

    def _hook_model(self, prof) -> tuple[tuple[str, ...], str] | None:
        """None once hooked (or no model given), else the phases lost and why."""
        phases = ("data", "forward", "backward")
        if not isinstance(self._model, torch.nn.Module):
            return None if self._model is None else (phases, f"the model is a {type(self._model).__name__}, "
                                                               "not a torch.nn.Module")
        guard = prof.collectors.guard
        self._backward_prehook = guard(self, "grad_fn_prehook", self._backward_begins)
        try:
            self._handles.append(self._model.register_forward_pre_hook(
                guard(self, "forward_pre_hook", self._forward_begins)))
            self._handles.append(self._model.register_forward_hook(
                guard(self, "forward_hook", self._forward_ends), always_call=True))
        except Exception as error:  # noqa: BLE001 - e.g. a scripted module
            return phases, f"cannot hook the model: {error!r}"
        return None

    def _hook_optimizer(self, prof) -> tuple[tuple[str, ...], str] | None:
        if self._optimizer is None:
            return None
        if not has_step_hooks(self._optimizer):
            return ("optimizer",), f"the optimizer ({type(self._optimizer).__name__}) has no step hooks"
        guard = prof.collectors.guard
        try:
            self._handles.append(self._optimizer.register_step_pre_hook(
                guard(self, "optimizer_pre_hook", self._optimizer_begins)))
            self._handles.append(self._optimizer.register_step_post_hook(
                guard(self, "optimizer_post_hook", self._optimizer_ends)))
        except Exception as error:  # noqa: BLE001
            return ("optimizer",), f"cannot hook the optimizer: {error!r}"
        return None

    @staticmethod
    def _report(prof, unavailable: list[tuple[tuple[str, ...], str]]) -> None:
        """One event for everything gpuprof cannot hook; capture goes on without those phases."""
        reasons = "; ".join(f"{', '.join(phases)}: {why}" for phases, why in unavailable)
        prof.event(EventKind.PHASE_UNAVAILABLE, f"automatic phases unavailable ({reasons}); prof.phase() can time them",
                   severity="warning", phases=[name for phases, _ in unavailable for name in phases],
                   reasons=[why for _, why in unavailable])

    def on_close(self, prof) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def on_step_start(self, prof, step: int) -> None:
        self._times = PhaseTimes(self._clock)
        self._data_start = time.perf_counter()
        self._forward_start = self._forward_end = self._backward_start = self._optimizer_start = None

    def on_after_backward(self, prof, step: int) -> None:
        end = self._clock.stamp()
        start = self._backward_start
        if start is None and self._forward_end is not None:  # the pass did not start at the model's outputs
            start = self._forward_end
            self._close_forward()
        if start is not None:
            self._times.add("backward", start, end)
        self._backward_start = None

    def join_at_backward(self, forward_start) -> None:
        """Hooked at the step's first backward() (gpuprof run starts there): its forward ran from
        `forward_start` (a stamp of this clock) to now, its backward starts now, and its data phase
        was not seen (None)."""
        now = self._clock.stamp()
        self._times.add("forward", forward_start, now)
        self._backward_start, self._data_start = now, None

    def finish_step(self) -> PhaseTimes | None:
        """The step's automatic spans; the Profiler calls this at `prof.step()`."""
        self._close_forward()
        return self._times

    @property
    def current(self) -> str | None:
        """The phase the step is in now, from the hooks' state: data until the first model call, then
        forward, backward, optimizer, and `other` between them (clipping, zero_grad, logging)."""
        if self._optimizer_start is not None:
            return "optimizer"
        if not isinstance(self._model, torch.nn.Module):
            return None
        if self._backward_start is not None:
            return "backward"
        if self._forward_start is not None:
            return "forward"
        return "data" if self._data_start is not None else "other"

    @property
    def backward_unfinished(self) -> bool:
        """A backward pass through the model's outputs began and its end was not seen."""
        return self._backward_start is not None

    # ------------------------------------------------------------------ torch hooks
    def _forward_begins(self, module, args) -> None:
        if self._data_start is not None:  # an evaluation call ends it too: evaluation is not loading
            self._times.add_host("data", time.perf_counter() - self._data_start)
            self._data_start = None
        if not is_training_call(module):
            return
        self._close_forward()
        self._forward_start = self._clock.stamp()

    def _forward_ends(self, module, args, output) -> None:
        if self._forward_start is None or self._forward_end is not None:  # not a training call
            return
        self._forward_end = self._clock.stamp()
        tensor = _first_graph_output(output)
        if tensor is not None:  # one prehook: each costs a few microseconds
            tensor.grad_fn.register_prehook(self._backward_prehook)

    def _backward_begins(self, grad_outputs) -> None:
        if self._backward_start is not None:  # a second forward's output in the same pass
            return
        self._backward_start = self._clock.stamp()
        if self._forward_start is not None:
            self._times.add("forward", self._forward_start, self._backward_start)
        self._forward_start = self._forward_end = None

    def _optimizer_begins(self, optimizer, args, kwargs) -> None:
        self._close_forward()
        self._optimizer_start = self._clock.stamp()

    def _optimizer_ends(self, optimizer, args, kwargs) -> None:
        if self._optimizer_start is not None:
            self._times.add("optimizer", self._optimizer_start, self._clock.stamp())
            self._optimizer_start = None

    def _close_forward(self) -> None:
        """A forward no backward started from ends where the module returned."""
        if self._forward_start is not None and self._forward_end is not None:
            self._times.add("forward", self._forward_start, self._forward_end)
        self._forward_start = self._forward_end = None
