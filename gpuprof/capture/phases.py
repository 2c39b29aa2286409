"""Automatic phases: every step split into data / forward / backward / optimizer / eval with no markup.

From hooks on the objects the loop hands to the Profiler, with the Profiler's clock, and from what
the step does (gpuprof.capture.producers), in whatever order the loop does it:
- data: host time in every `next()` of a torch DataLoader iterator, in every call of the user's
  functions whose results become the model's inputs (found at the first training call: nanoGPT's
  `get_batch`) and in every item drawn from an iterator the loop holds by name whose items the model is
  given (`next(train_loader)` of a generator, an itertools chain, an IterableDataset's iterator: told at a
  later training call), wherever in the step they run: before the forward, between the forward and
  `backward()` (that time is taken out of the forward) or after the optimizer. Only the outermost
  call counts; inside the model's own call, or inside an evaluation, it is not data. A step in which
  no such call ran (batches from a list, a generator object) falls back to the time from the start
  of the step (the previous `prof.step()`) to its first call of the model.
- eval: evaluation inside the loop, on the host clock: each call, from the loop, of a function or method under which
  the model runs in evaluation (no grad or `model.eval()`; found at its first such call, then
  wrapped: nanoGPT's `estimate_loss()`, x-transformers' `model.generate()`, whose model runs only
  through its child `net`, seen by a pre-hook on each child of the model that returns at once inside the
  model's own call; a call in which the model does not run in evaluation is not:
  minGPT's `trigger_callbacks` evaluates once in 500 iterations), else from the start of the first evaluation call of the
  model to the end of the last one before the step's training work goes on (a loop calling the model
  in evaluation itself, as the Accelerate example does). Reported apart; never data or forward.
- forward: a training call of the root module (`module.training` and grad enabled), from its
  forward pre-hook to the loop's `backward()` call that follows it (seen in `torch.autograd.backward`,
  where every backward() ends: gpuprof.capture.losses; a hook registered on each step's output
  graph cost about 70 us a step on a CPU). A loss computed outside the model therefore counts as
  forward, and so does the rest of what the loop does between the model call and `backward()`, data
  excepted; the loss's own backward counts as backward, as for a loss the model computes. With no
  backward() after it, the forward ends at the module's forward hook.
- backward: from that start to the end of the autograd pass (gpuprof.capture.backward, seen as
  `on_after_backward`); from the end of the forward when no backward() call was seen (a pass run by
  `torch.autograd.grad`, or by a `backward` the loop bound before gpuprof started).
- optimizer: `optimizer.step()` itself, from its step pre-hook to its step post-hook.
Clipping, `zero_grad`, logging and the rest are `other`, which the stack sampler
(gpuprof.capture.stack_sampler) names by the user's functions.

Explicit `prof.phase(name)` spans win, per step and name (the Profiler merges the two).
Each hook does constant work (a clock stamp, a few attribute writes): nothing per parameter.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import torch

from gpuprof import module_hooks
from gpuprof.capture import losses
from gpuprof.capture.producers import (Drawn, Found, Span, Wrapped, call_stack, draw_places, find_evaluator,
                                       find_producers, found, model_inputs, unwatch_dataloaders, watch_dataloaders)
from gpuprof.capture.timing import PhaseTimes
from gpuprof.capture.usercode import user_frames
from gpuprof.optimizers import has_step_hooks
from gpuprof.run.schema import MODEL_PHASES, EventKind

logger = logging.getLogger("gpuprof")

MAX_PROBED_CALLS = 8  # training calls an iterator the loop holds is watched for feeding the model before it is put back


def is_training_call(module: torch.nn.Module) -> bool:
    """A forward call that builds a graph for a training backward (not eval, no_grad or inference_mode)."""
    return module.training and torch.is_grad_enabled()


class PhaseHooks:
    """A collector timing the phases of each step from model, autograd and optimizer hooks."""

    name = "phases"

    def __init__(self, model: Any, optimizer: Any, clock):
        self._model, self._optimizer, self._clock = model, optimizer, clock
        self._handles: list = []
        self._stop_watching_backward = lambda: None
        self._times: PhaseTimes | None = None
        self._data_start: float | None = None
        self._forward_start = self._forward_end = self._backward_start = self._optimizer_start = None
        self._data: Span | None = None
        self._eval: Span | None = None
        self._wrapped: list[Wrapped] = []
        self.found: list[Found] = []  # the user functions timed as data or eval, for meta.json
        self._loop_codes: set | None = None  # the user code calling the model in training, once seen
        self._training_stack: set = set()  # every code on the stack of that first training call
        self._eval_stacks: list[tuple] = []  # evaluation calls' stacks (call_stack) not searched yet
        self._searched_stacks: set[tuple] = set()
        self._drawn: list[Drawn] = []  # the iterators the loop holds, rebound at its first training call
        self._probed_calls = 0  # training calls since, while none of them is seen to feed the model
        self._in_model = 0
        self._step_spans = _StepSpans()

    # ------------------------------------------------------------------ collector hooks
    def on_start(self, prof) -> None:
        unavailable = [gap for gap in (self._hook_model(prof), self._hook_optimizer(prof)) if gap]
        if unavailable:
            self._report(prof, unavailable)

    def _hook_model(self, prof) -> tuple[tuple[str, ...], str] | None:
        """None once hooked (or no model given), else the phases lost and why."""
        phases = MODEL_PHASES
        if not isinstance(self._model, torch.nn.Module):
            return None if self._model is None else (phases, f"the model is a {type(self._model).__name__}, "
                                                               "not a torch.nn.Module")
        guard = prof.collectors.guard
        try:
            self._handles.append(prof.collectors.hook(self, self._model, "forward_pre", self._forward_begins))
            self._handles.append(module_hooks.register(
                self._model, "forward", guard(self, "forward_hook", self._forward_ends), always_call=True))
        except Exception as error:  # noqa: BLE001 - e.g. a scripted module
            return phases, f"cannot hook the model: {error!r}"
        self._data = Span(guard(self, "data_begins", self._data_begins), guard(self, "data_ends", self._data_ends),
                          guard(self, "data_produced", self._data_produced))
        self._eval = Span(guard(self, "eval_begins", self._eval_begins), guard(self, "eval_ends", self._eval_ends))
        watch_dataloaders(self._data)
        if not _compiled(self._model):  # a compiled model's children run inside its graph: no hook of ours there
            for child in filter(_saved_without_our_hooks, self._model.children()):
                self._handles.append(module_hooks.register(child, "forward_pre", self._outside_call_hook(guard),
                                                           with_kwargs=True))
        self._stop_watching_backward = losses.watch_starts(guard(self, "backward_begins", self._backward_begins))
        return None

    def _hook_optimizer(self, prof) -> tuple[tuple[str, ...], str] | None:
        if self._optimizer is None:
            return None
        if not has_step_hooks(self._optimizer):
            return ("optimizer",), f"the optimizer ({type(self._optimizer).__name__}) has no step hooks"
        hook = prof.collectors.hook
        try:
            self._handles.append(hook(self, self._optimizer, "step_pre", self._optimizer_begins))
            self._handles.append(hook(self, self._optimizer, "step_post", self._optimizer_ends))
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

    def meta(self, prof) -> dict:
        return {"phase_sources": [item.to_dict() for item in self.found]}

    def on_close(self, prof) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._stop_watching_backward()
        if self._data is not None:
            unwatch_dataloaders(self._data)
        for wrapped in [*self._wrapped, *self._drawn]:
            wrapped.restore()
        self._wrapped.clear()
        self._drawn.clear()

    def on_step_start(self, prof, step: int) -> None:
        self._times = PhaseTimes(self._clock)
        self._data_start = time.perf_counter()
        self._step_spans = _StepSpans()
        self._forward_start = self._forward_end = self._backward_start = self._optimizer_start = None
        self._data_unseen = False  # gpuprof run joined the step at its first backward()

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
        self._data_unseen = True  # a later micro-batch's fetch is only part of it: the step's data stays unseen

    def finish_step(self) -> PhaseTimes | None:
        """The step's automatic spans; the Profiler calls this at `prof.step()`."""
        self._close_forward()
        if self._times is not None:
            self._step_spans.close_window()
            for name, seconds in self._step_spans.totals_s().items():
                if name == "data" and getattr(self, "_data_unseen", False):
                    continue
                self._times.add_host(name, seconds)
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

    @property
    def loop_codes(self) -> set | None:
        """The code objects of the user frames that called the model in training (the loop), once seen."""
        return self._loop_codes

    @property
    def current_phase(self) -> str:
        """What the training thread is doing now, by these hooks: the stack sampler's label for a sample. Between
        the calls of an evaluation window, the phase it would be in were it not evaluating (see
        `between_evaluation_calls`)."""
        spans = self._step_spans
        if self._eval is not None and ((self._eval.open and spans.evaluated) or (spans.window_open and self._in_model)):
            return "eval"
        if self._data is not None and self._data.open and not self._in_model:
            return "data"
        if self._backward_start is not None:
            return "backward"
        if self._optimizer_start is not None:
            return "optimizer"
        return "forward" if self._forward_start is not None or self._in_model else "other"

    @property
    def producing(self):
        """The code of the loop's own batch function running now (its outermost call), else None."""
        return self._data.code if self._data is not None and self._data.open else None

    @property
    def evaluation_window(self) -> list[float] | None:
        """The evaluation window open now (no evaluator function wraps the loop's evaluation): [start, end so far]
        on the perf_counter clock, the one list while it is open; its end is that of its last call."""
        return self._step_spans.window

    @property
    def between_evaluation_calls(self) -> bool:
        """In an evaluation window, outside the model: evaluation if another evaluation call follows before the
        training work goes on, not if none does, which only a later moment tells."""
        return self._step_spans.window is not None and not self._in_model

    # ------------------------------------------------------------------ torch hooks
    def _forward_begins(self, module, args, kwargs) -> None:
        self._in_model += 1
        if self._step_spans.data_start is not None:  # a function that calls the model is no batch function
            self._step_spans.data_start, self._step_spans.forward_paused = None, False
        if self._data_start is not None:  # the fallback data span ends at the first call, evaluation or not
            self._step_spans.gap_s = time.perf_counter() - self._data_start
            self._data_start = None
        if not is_training_call(module):
            self._evaluation_call(args, kwargs)
            return
        self._step_spans.close_window()
        if self._loop_codes is None:
            self._find_producers(args, kwargs)
        elif self._drawn and self._drawn[0].state == "probing":
            self._searching(lambda: self._decide_drawn(args, kwargs))
        self._close_forward()
        self._forward_start = self._clock.stamp()

    def _forward_ends(self, module, args, output) -> None:
        self._in_model = max(0, self._in_model - 1)
        if not is_training_call(module):
            self._step_spans.evaluation_call_ended()
        if self._forward_start is None or self._forward_end is not None:  # not a training call
            return
        self._forward_end = self._clock.stamp()

    def _backward_begins(self) -> None:
        """A backward() call: the training forward that ended before it ends here, unless a pass began
        already (a second forward's loss in the same pass, a backward inside the pass)."""
        if self._backward_start is not None or self._forward_end is None:
            return
        self._backward_start = self._clock.stamp()
        self._times.add("forward", self._forward_start, self._backward_start)
        self._forward_start = self._forward_end = None

    def _optimizer_begins(self, optimizer, args, kwargs) -> None:
        self._step_spans.close_window()
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

    # ------------------------------------------------------------------ data and evaluation
    def _data_begins(self) -> None:
        if self._in_model or self._eval.open or self._times is None:
            self._step_spans.data_start = None
            return
        self._step_spans.data_start = time.perf_counter()
        if self._forward_start is not None and self._forward_end is not None:  # between forward and backward
            paused_at = self._clock.stamp()
            self._times.add("forward", self._forward_start, paused_at)
            self._forward_start = self._forward_end = None
            self._step_spans.forward_paused = True

    def _data_ends(self) -> None:
        self._step_spans.data_ended()
        if self._step_spans.forward_paused:  # the forward goes on until backward() or its close
            self._forward_start = self._forward_end = self._clock.stamp()
            self._step_spans.forward_paused = False

    def _data_produced(self, batch) -> None:
        if self._step_spans.data_start is not None:
            self._step_spans.last_batch = model_inputs((batch,), {})

    def _eval_begins(self) -> None:
        self._step_spans.eval_began()

    def _eval_ends(self) -> None:
        self._step_spans.eval_ended()

    def _outside_call_hook(self, guard):
        """A forward pre-hook for a child of the model: a child called while the model itself is not running, in
        evaluation, is an evaluation call of the model (`model.generate` runs `self.net`, never `model`'s forward).
        Inside the model's own call it returns at once."""
        child_called = guard(self, "child_called", self._child_called)

        def hook(module, args, kwargs):
            if not self._in_model and not is_training_call(module):
                child_called(args, kwargs)

        return hook

    def _child_called(self, args, kwargs) -> None:
        self._evaluation_call(args, kwargs)
        self._step_spans.evaluation_call_ended()

    def _evaluation_call(self, args, kwargs) -> None:
        if self._eval is not None and self._eval.open:
            self._step_spans.evaluated = True
            return
        frame = sys._getframe()
        self._search_evaluator(call_stack(frame), frame)
        self._step_spans.evaluation_call_began(model_inputs(args, kwargs))

    def _find_producers(self, args, kwargs) -> None:
        """Once, at the first training call: the user frames calling the model, and the calls and iterators feeding
        it (those the loop draws from by name are told at a later training call, `_decide_drawn`)."""
        frame = sys._getframe()
        frames = user_frames(frame)
        self._loop_codes = {user_frame.f_code for user_frame in frames}
        self._training_stack = set(call_stack(frame))

        def wrap_producers():
            for binding in find_producers(frame, model_inputs(args, kwargs)):
                self._wrap(binding, "data", self._data)

        self._searching(wrap_producers)
        self._searching(lambda: self._drawn.extend(Drawn(place, self._data) for place in draw_places(frames)))
        for stack in self._eval_stacks:
            self._search_evaluator(stack, frame)
        self._eval_stacks.clear()

    def _decide_drawn(self, args, kwargs) -> None:
        """The iterators whose last item the model is given now feed it: timed from now on; the others are put back,
        once one is told or after MAX_PROBED_CALLS training calls."""
        inputs = model_inputs(args, kwargs)
        feeding = [drawn for drawn in self._drawn if drawn.last & inputs]
        self._probed_calls += 1
        if not feeding and self._probed_calls < MAX_PROBED_CALLS:
            return
        for drawn in self._drawn:
            if drawn in feeding:
                drawn.state = "timed"
                self.found.append(drawn.found())
            else:
                drawn.restore()
        self._drawn = feeding

    def _search_evaluator(self, stack: tuple, frame) -> None:
        """Once per kind of evaluation call (its stack), once the loop's code is known: the callable evaluating, its
        caller one of the frames of the stack ending at `frame`."""
        if self._loop_codes is None:
            if stack not in self._eval_stacks:
                self._eval_stacks.append(stack)
            return
        if stack in self._searched_stacks:
            return
        self._searched_stacks.add(stack)
        self._searching(lambda: self._wrap(find_evaluator(stack, self._loop_codes, self._training_stack,
                                                          _stack(frame)), "eval", self._eval))

    @staticmethod
    def _searching(search) -> None:
        """A search of the user's code that fails leaves the phases as they are (data from the step's start
        to its first model call) rather than switching them off."""
        try:
            search()
        except Exception as error:  # noqa: BLE001 - reading the user's frames and source is best effort
            logger.warning("gpuprof: could not find what feeds the model (%r); data is timed up to its first call",
                           error)

    def _wrap(self, binding, role: str, span: Span) -> None:
        if binding is None or span is None:
            return
        owner, name, value = binding
        if any(wrapped.owner is owner and wrapped.name == name for wrapped in self._wrapped):
            return
        self._wrapped.append(Wrapped(owner, name, span))
        self.found.append(found(role, value, owner, name))


def _stack(frame) -> list:
    """The frames of the stack ending at `frame`, innermost first."""
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames


def _saved_without_our_hooks(module: torch.nn.Module) -> bool:
    """A module whose class pickles and copies it through `Module.__getstate__` (gpuprof.module_hooks leaves our hooks
    out there), not its own (an LSTM's: `torch.save(model)` would fail on a hook of ours)."""
    return type(module).__getstate__ is torch.nn.Module.__getstate__


def _compiled(module: torch.nn.Module) -> bool:
    return (isinstance(module, torch._dynamo.eval_frame.OptimizedModule)
            or getattr(module, "_compiled_call_impl", None) is not None)


class _StepSpans:
    """One step's host-clock data and evaluation spans; data inside an evaluation is evaluation."""

    def __init__(self):
        self.data_spans: list[tuple[float, float]] = []
        self.eval_spans: list[tuple[float, float]] = []
        self.data_start: float | None = None
        self.eval_start: float | None = None
        self.evaluated = False  # whether the model ran in evaluation inside the evaluator's call open now
        self.forward_paused = False
        self.gap_s: float | None = None  # the fallback: from the step's start to its first model call
        self.last_batch: set[int] = set()  # the tensors the last data span returned
        self.window: list[float] | None = None  # [first evaluation call's start, last one's end]

    def data_ended(self) -> None:
        if self.data_start is not None:
            self.data_spans.append((self.data_start, time.perf_counter()))
            self.data_start = None

    def eval_began(self) -> None:
        self.close_window()
        self.eval_start, self.evaluated = time.perf_counter(), False

    def eval_ended(self) -> None:
        """A call of the evaluator is evaluation if the model ran in evaluation inside it: a function that
        evaluates only now and then (minGPT's `trigger_callbacks`, every 500 iterations) is not, otherwise."""
        if self.eval_start is not None and self.evaluated:
            self.eval_spans.append((self.eval_start, time.perf_counter()))
        self.eval_start = None

    @property
    def window_open(self) -> bool:
        return self.window is not None

    def evaluation_call_began(self, inputs: set[int]) -> None:
        """The first evaluation call of a window; the batch fetched for it (the last data span, when it
        returned this call's inputs) is evaluation too."""
        if self.window is None:
            now = time.perf_counter()
            fetched_for_it = self.data_spans and inputs & self.last_batch
            self.window = [self.data_spans[-1][0] if fetched_for_it else now, now]

    def evaluation_call_ended(self) -> None:
        if self.window is not None:
            self.window[1] = time.perf_counter()

    def close_window(self) -> None:
        """The training work goes on: the evaluation calls so far are one span."""
        if self.window is not None:
            self.eval_spans.append(tuple(self.window))
            self.window = None

    def totals_s(self) -> dict[str, float]:
        evaluation_s = sum(end - start for start, end in self.eval_spans)
        data_s = sum(end - start - _overlap_s((start, end), self.eval_spans) for start, end in self.data_spans)
        if not self.data_spans and self.gap_s is not None:
            data_s = self.gap_s
        totals = {"data": data_s} if self.data_spans or self.gap_s is not None else {}
        return {**totals, "eval": evaluation_s} if self.eval_spans else totals


def _overlap_s(span: tuple[float, float], others: list[tuple[float, float]]) -> float:
    start, end = span
    return sum(max(0.0, min(end, other_end) - max(start, other_start)) for other_start, other_end in others)
