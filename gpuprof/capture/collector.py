"""The collector interface: how a part of capture (built in or plugged in) sees a step.

A collector is any object with a `name` and some of these methods (all optional):

    on_start(prof)                      once, when the profiler starts
    on_step_start(prof, step)           an optimizer step begins
    on_after_backward(prof, step)       a backward pass finished (once per micro-batch)
    on_step_end(prof, state) -> dict    the step ended; extra fields for the step record.
                                        Values may be device tensors (fetched later without a
                                        sync), plain values, or callables; names starting with
                                        "_" reach on_step_record but are not written.
    on_step_record(prof, record)        the step's record with host values (a few steps later
                                        on CUDA), before it is written
    on_join_at_backward(prof, step)     the Profiler started inside step `step`'s first backward()
                                        (gpuprof run): that step's forward was not seen
    on_close(prof)                      once, at close
    on_phase_begin(prof, name), on_phase_end(prof, name)   around prof.phase(name)
    on_exception(prof, exc)             an exception is leaving the training loop (then re-raised)
    meta(prof) -> dict                  run-level facts merged into meta.json
    stop_training (attribute)           an exception set on purpose; prof.step() raises it once

The first exception a collector raises is logged once, recorded as a `collector_disabled`
event, and that collector is switched off; training goes on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gpuprof import module_hooks
from gpuprof.torch_compat import run_eagerly


@dataclass
class StepState:
    """What a collector sees at the end of step `step`. Accelerator tensors stay on the device; the
    loss and gradient norm of a CPU run are already read into floats (no sync there)."""

    step: int
    loss: torch.Tensor | float | None = None
    tokens: torch.Tensor | int | None = None
    grad_norm: torch.Tensor | float | None = None
    batch: Any = None  # what prof.step(batch=...) was given
    # the sum of the losses backward() ran on this step, when prof.step() was given a loss of its own
    # (gpuprof.capture.losses): a micro-batch's loss the loop did not pass is still watched
    backward_loss: torch.Tensor | float | None = None
    # under a GradScaler, whose skips otherwise decide whether gradients count as non-finite: an optimizer
    # it did not skip stepped with non-finite gradients (the loop changed them after unscaling)
    stepped_nonfinite_grads: bool = False


class Collector:
    """Optional base class; any object with a `name` and the hook methods it needs will do."""

    name = "collector"


class CollectorSet:
    """Calls a hook on every enabled collector; the first failure switches that collector off."""

    def __init__(self, on_failure):
        self._collectors: list[Any] = []
        self._ever_added: list[Any] = []
        self._on_failure = on_failure
        self._by_hook: dict[str, list[tuple[Any, Any]]] = {}  # hook -> (collector, bound method), enabled ones
        self._stoppers: list[Any] | None = None  # enabled collectors that may set stop_training
        self._shared: dict[tuple[int, str], _SharedHook] = {}  # (id(target), event) -> its one torch hook

    def add(self, collector: Any) -> None:
        self._collectors.append(collector)
        self._ever_added.append(collector)
        self._forget_lookups()

    def close_all(self, prof) -> None:
        """on_close for every collector, switched-off ones too, so each removes its hooks."""
        for collector in self._ever_added:
            try:
                if hasattr(collector, "on_close"):
                    collector.on_close(prof)
            except Exception as error:  # noqa: BLE001
                if collector in self._collectors:
                    self.disable(collector, "on_close", error)

    def stop_all(self, prof) -> None:
        """Every collector off at once and closed, its hooks removed: the Profiler itself broke, so none of
        its code may run in the loop again. A collector failing to close now is not reported."""
        self._collectors.clear()
        self._forget_lookups()
        self.close_all(prof)
        self._ever_added.clear()

    def __iter__(self):
        return iter(self._collectors)

    def call(self, hook: str, *args) -> list[Any]:
        """The results of the enabled collectors that have `hook`, in their order."""
        return [self._invoke(collector, hook, method, args) for collector, method in self._methods(hook)]

    def call_one(self, collector: Any, hook: str, *args) -> Any:
        method = getattr(collector, hook, None)
        return None if method is None else self._invoke(collector, hook, method, args)

    def _methods(self, hook: str) -> list[tuple[Any, Any]]:
        """Looked up once per hook (several hooks run every step), again after a collector comes or goes."""
        methods = self._by_hook.get(hook)
        if methods is None:
            methods = self._by_hook[hook] = [(collector, getattr(collector, hook)) for collector in self._collectors
                                             if getattr(collector, hook, None) is not None]
        return methods

    def stop_requests(self) -> list[tuple[Any, BaseException]]:
        """(collector, error) for each enabled collector whose stop_training is set now."""
        if self._stoppers is None:
            self._stoppers = [collector for collector in self._collectors if hasattr(collector, "stop_training")]
        return [(collector, collector.stop_training) for collector in self._stoppers
                if collector.stop_training is not None]

    def _forget_lookups(self) -> None:
        self._by_hook.clear()
        self._stoppers = None

    def _invoke(self, collector: Any, hook: str, method, args: tuple) -> Any:
        if collector not in self._collectors:  # switched off earlier in this round
            return None
        try:
            return method(*args)
        except Exception as error:  # noqa: BLE001 - a collector must never stop training
            self.disable(collector, hook, error)
            return None

    def hook(self, collector: Any, target: Any, event: str, function, hook_name: str | None = None) -> "_Entry":
        """`function` run at `event` of `target` (SHARED_EVENTS: "forward_pre" on a module, with its
        arguments and keywords; "step_pre" / "step_post" on an optimizer), guarded like `guard`. Every
        collector's function for one target and event shares one torch hook, run in the order added:
        one boundary into gpuprof per torch event instead of one per collector. Returns its handle."""
        key = (id(target), event)
        shared = self._shared.get(key)
        if shared is None:
            shared = self._shared[key] = _SharedHook(self, target, event, lambda: self._shared.pop(key, None))
        return shared.add(collector, hook_name or event, function)

    def guard(self, collector: Any, hook: str, function):
        """`function` made safe to run inside the user's code (autograd, model, optimizer, scaler hooks),
        and run eagerly under torch.compile: traced into a compiled model or optimizer step, gpuprof's
        code would recompile it whenever gpuprof's own state changed (and warn)."""

        def guarded(*args, **kwargs):
            if collector not in self._collectors:
                return None
            try:
                return function(*args, **kwargs)
            except Exception as error:  # noqa: BLE001 - never raise into the training loop
                self.disable(collector, hook, error)
                return None

        return run_eagerly(guarded)

    def disable(self, collector: Any, hook: str, error: BaseException) -> None:
        if collector in self._collectors:
            self._collectors.remove(collector)
            self._forget_lookups()
            self._on_failure(collector, hook, error)


SHARED_EVENTS = {
    # first among the module's own pre-hooks: FSDP2's gathers the root's parameters (waiting for every rank) in
    # one, which is the forward's time, not the data's before it
    "forward_pre": lambda module, run: module_hooks.register(module, "forward_pre", run, with_kwargs=True,
                                                             prepend=True),
    "step_pre": lambda optimizer, run: optimizer.register_step_pre_hook(run),
    "step_post": lambda optimizer, run: optimizer.register_step_post_hook(run),
}


class _Entry:
    """One collector's function in a shared hook; `remove()` takes it out (and the torch hook with the last)."""

    __slots__ = ("collector", "name", "function", "_owner")

    def __init__(self, collector, name: str, function, owner: "_SharedHook"):
        self.collector, self.name, self.function, self._owner = collector, name, function, owner

    def remove(self) -> None:
        self._owner.remove(self)


class _SharedHook:
    """The one torch hook of a (target, event): runs the enabled collectors' functions in turn, eagerly
    under torch.compile (see CollectorSet.guard); a function that raises switches its collector off."""

    def __init__(self, collectors: CollectorSet, target, event: str, forget):
        self._collectors, self._target, self._forget = collectors, target, forget
        self._entries: tuple[_Entry, ...] = ()
        self._handle = SHARED_EVENTS[event](target, run_eagerly(self._run))

    def add(self, collector, name: str, function) -> _Entry:
        entry = _Entry(collector, name, function, self)
        self._entries += (entry,)
        return entry

    def remove(self, entry: _Entry) -> None:
        self._entries = tuple(e for e in self._entries if e is not entry)
        if not self._entries and self._handle is not None:
            self._handle.remove()
            self._handle = None
            self._forget()

    def _run(self, *args) -> None:
        enabled = self._collectors._collectors
        for entry in self._entries:  # a tuple: an entry removed while running does not shift the others
            if entry.collector not in enabled:
                continue
            try:
                entry.function(*args)
            except Exception as error:  # noqa: BLE001 - never raise into the training loop
                self._collectors.disable(entry.collector, entry.name, error)
