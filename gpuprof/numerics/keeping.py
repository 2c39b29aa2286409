"""Keeping the state each step starts from, so that a bad step can be re-run (numerics keep_state).

"when_bad" (the default, "auto") keeps only what is small per step (RNG, hyperparameters, the batch
and tape by reference) and copies the weights once a step goes bad: when the step's gradient norm,
taken before the update (gpuprof.capture.gradients: also where the loop runs forward and backward
inside `optimizer.step(closure)`, as Lightning does), is not finite, else at the step's end.
- On the CPU the host reads those values at once (no device to wait for) and copies then.
- On a CUDA device with Triton the device decides and copies (device_keeper.py): no host wait.
- Elsewhere "auto" means "every_step", and an explicit "when_bad" reads the values on the host,
  a sync per step.
"every_step" copies the pre-step state of every step into a StateKeeper, frozen by the watched
values when they go non-finite: exact also when an update from finite gradients overflows, at the
cost of a read and a write of the state per step; on_nonfinite="skip" uses it to undo updates.
Either way `inputs_of(step)` and `state_before(step)` give the forensic re-run what it needs until
the step has been read.
"""

from __future__ import annotations

import logging
import math

import torch

from gpuprof.modules import eager_model, local_tensor, named_parameters
from gpuprof.numerics import budget, device_copy
from gpuprof.numerics.device_keeper import ConditionalKeeper
from gpuprof.torch_compat import foreach_norm
from gpuprof.numerics.state import (
    OPTIMIZER_KEY_SEPARATOR, SCALER_PREFIX, StateKeeper, StepInputs, hyperparameters, live_tensors,
    non_tensor_optimizer_state, param_names, rng_states,
)
from gpuprof.numerics.tape import autocast_now

logger = logging.getLogger("gpuprof")


class StepKeeping:
    def __init__(self, model: torch.nn.Module, optimizer, scaler, keep_state, state_interval: int,
                 memory_budget_pct: float = budget.DEFAULT_BUDGET_PCT):
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self._keep_state, self._state_interval = keep_state, state_interval
        self._budget_pct = memory_budget_pct
        self.keeper: StateKeeper | None = None
        self.current: StepInputs | None = None
        self._kept: dict[int, StepInputs] = {}
        self.placements: list[budget.Placement] = []  # keep_state "when_bad": where the copy goes, from which step

    def start(self, device: torch.device, undo_updates: bool = False) -> None:
        """`undo_updates`: on_nonfinite="skip", which restores the state from a copy made every step."""
        model = self._eager = eager_model(self.model)  # once: looking through wrappers raises AttributeErrors
        self._names = param_names(model)  # once: the per-step path only looks names up
        self._param_names = frozenset(self._names.values())
        self._weights = _WeightSample(model, device, self._state_interval)
        self._signature = None
        self._non_tensor_state = False
        self.fallback: str | None = None  # why the device copy gave way to a copy every step
        self._zero, self._inf = torch.zeros(1, device=device), torch.full((1,), math.inf, device=device)
        if self._keep_state is False:
            return
        when_bad = self._keep_state == "when_bad" or (self._keep_state == "auto" and device.type != "cpu")
        if when_bad and not undo_updates and device_copy.available(device):
            self.keeper = ConditionalKeeper(device)
            self._device_keeping(self.keeper.warm_up)
        else:
            self.keeper = StateKeeper(device)

    @property
    def lazily(self) -> bool:
        """Kept when bad, as the host sees it: a copy when a value read on the host is not finite."""
        return isinstance(self.keeper, StateKeeper) and self.fallback is None and (
            self._keep_state == "when_bad" or (self._keep_state == "auto" and self.keeper.device.type == "cpu"))

    @property
    def mode(self) -> str:
        """How the state is kept, as the run's meta says it."""
        if self.keeper is None:
            return "off"
        if self.on_device:
            return "when_bad, decided on the device"
        if self.lazily:
            return "when_bad, decided on the host"
        return "every_step"

    @property
    def on_device(self) -> bool:
        """Kept when bad, as the device sees it (device_keeper.py)."""
        return isinstance(self.keeper, ConditionalKeeper)

    def begin(self, step: int) -> StepInputs:
        model = self._eager
        other = self._device_keeping(self._prepare_device_copy, model, step) if self.on_device else {}
        every_step = isinstance(self.keeper, StateKeeper) and not self.lazily  # also after a fallback
        if every_step:
            other = self._refresh_keeper(model, step, unread_steps=bool(self._kept))
        elif self.lazily and self._replan_due(step):
            self._plan(live_tensors(model, self.optimizer, self.scaler), step)
        wants_non_tensor = every_step or (self.on_device and self._non_tensor_state)
        non_tensor = non_tensor_optimizer_state(model, self.optimizer, self._names) if wants_non_tensor else {}
        self.current = StepInputs(
            step=step, rng=rng_states(), hyper=hyperparameters(self.optimizer), other_device=other,
            non_tensor=non_tensor, training=model.training, autocast=autocast_now(),
        )
        absmax = self.keeper.param_absmax() if every_step else None  # the copy just made
        self.current.param_absmax = absmax if absmax is not None else self._weights.absmax(step)
        return self.current

    def weight_sample_absmax(self) -> float | None:
        """The largest |weight| now, as each step's `param_absmax` measures it (its sample of each weight)."""
        return self._weights.now()

    def end(self, inputs: StepInputs, watched: torch.Tensor | list[float], flags: int) -> None:
        """The step ended with these watched values (the first `flags` of them are flags): a device
        vector, or host floats where reading costs no sync."""
        self._kept[inputs.step] = inputs
        if self.keeper is None:
            return
        flag_values = watched[:flags]
        if self.on_device:
            self._device_keeping(self.keeper.take_if, self._device_values(flag_values), inputs.step, True)
            return
        if not self.lazily:
            self.keeper.freeze_if(~torch.isfinite(torch.as_tensor(flag_values)).all())
            return
        if isinstance(flag_values, torch.Tensor):
            flag_values = flag_values.tolist()  # explicit keep_state="when_bad" on an accelerator: a sync (documented)
        if not inputs.state_kept and not all(map(math.isfinite, flag_values)):
            self._keep_now(inputs)  # no update happened, or its gradients looked finite

    def inputs_of(self, step: int) -> StepInputs | None:
        return self._kept.get(step)

    def state_before(self, step: int):
        if self.keeper is None or step not in self._kept:
            return None
        placement = self.placement_at(step)
        if placement is not None and not placement.kept:
            return None
        if self.on_device:  # an update ran before the copy only if the copy was made at the step's end
            self._kept[step].updated_first = self._kept[step].updated_first and self.keeper.taken_at_end()
        return self.keeper.state_before(step)

    def read(self, step: int, bad: bool) -> None:
        """Step `step` was read (and investigated when bad): what was kept for it can go."""
        if self.keeper is not None and bad:
            self.keeper.unfreeze()  # frozen means "an unread bad step": this one is read now
        kept = self._kept  # in step order: records are read in order
        while kept and next(iter(kept)) <= step:
            del kept[next(iter(kept))]
        if self.keeper is not None:
            self.keeper.release(step)

    def before_update(self, grad_norm: torch.Tensor | float) -> None:
        """The step's gradient norm, taken before the optimizer's update: the weights are still those the
        step started from, so gradients that went non-finite are the moment to copy them."""
        inputs = self.current
        if self.on_device and inputs is not None:
            inputs.updated_first = True  # an update follows; state_before() learns whether the copy preceded it
            self._device_keeping(self.keeper.take_if, self._device_values(grad_norm), inputs.step, False)
            return
        if not self.lazily or inputs is None or inputs.state_kept:
            return
        # a host read: free on the CPU; explicit keep_state="when_bad" on a GPU pays this sync (documented)
        if math.isfinite(grad_norm):
            inputs.updated_first = True  # an update may follow before anything else is seen to go bad
        else:
            self._keep_now(inputs)
            inputs.updated_first = False

    def after_update(self) -> None:
        """The settings the update ran with, read after it: a loop may set its lr after the step began
        (llm.c sets it after clipping; Lightning runs the forward inside optimizer.step), and these are
        what the re-run replays and what an lr cause names."""
        if self.current is not None:
            self.current.hyper = hyperparameters(self.optimizer)
            self.current.param_absmax_after = self._weights.after_update()

    def after_backward(self) -> None:
        """Without capture's gradient norms (grad_norms=False), the end of each backward pass stands in
        for the moment before the update."""
        grads = [local_tensor(p.grad) for p in self.model.parameters() if p.grad is not None]
        if grads and self.lazily:
            self.before_update(torch.linalg.vector_norm(torch.stack(foreach_norm(grads, 2.0))))

    def _keep_now(self, inputs: StepInputs) -> None:
        placement = self.placement_at(inputs.step)
        if placement is not None and not placement.kept:
            return  # over the memory budget: the event says so
        model = self._eager
        inputs.other_device = self._refresh_keeper(model, inputs.step, unread_steps=False)
        if self._whole_state(inputs.step):
            inputs.non_tensor = non_tensor_optimizer_state(model, self.optimizer, self._names)  # with the tensors
        inputs.state_kept = True

    def placement_at(self, step: int) -> budget.Placement | None:
        """Where the copy of the state `step` started from went (keep_state "when_bad"), or None."""
        return next((p for p in reversed(self.placements) if p.step <= step), None)

    def _whole_state(self, step: int) -> bool:
        placement = self.placement_at(step)
        return placement is None or placement.what == "state"

    def _replan_due(self, step: int) -> bool:
        """The copy's place is decided again when the state's set changes (its cheap signature: Adam's
        state appears after the first update) and once the run's first step has shown its peak."""
        signature = (len(self.optimizer.state) if self.optimizer is not None else 0,
                     getattr(self.scaler, "_scale", None) is not None)
        provisional = not self.placements or (not self.placements[-1].measured and step > 0)
        changed, self._signature = signature != self._signature, signature
        return changed or provisional

    def _plan(self, tensors: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
        """Decides from the memory measured now where the copy goes (budget.py); the tensors it keeps."""
        device = self.keeper.device
        copied = {n: t for n, t in tensors.items() if t.device == device}
        parameters = {n: t for n, t in copied.items() if _is_parameter_side(n)}
        held = self.keeper.held_bytes() if self.on_device else {}
        placement = budget.place({"state": budget.nbytes(copied.values()),
                                  "parameters": budget.nbytes(parameters.values())},
                                 budget.pools_for(device, measured=step > 0), self._budget_pct, step,
                                 measured=step > 0, held=held)
        last = self.placements[-1] if self.placements else None
        if last is None or (last.what, last.where, last.measured) != (placement.what, placement.where,
                                                                      placement.measured):
            self.placements.append(placement)
        return self._selected(tensors, step)

    def _selected(self, tensors: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
        """The tensors the placement of `step` keeps: all, or the parameters, buffers and scaler alone."""
        placement = self.placement_at(step)
        if placement is None or placement.what == "state":
            return tensors
        return {n: t for n, t in tensors.items() if _is_parameter_side(n)} if placement.kept else {}

    def _device_keeping(self, action, *args):
        """One step of the device copy. If it fails (gpuprof's failure, not the loop's), the state is
        copied every step from then on, so that a bad step can still be re-run."""
        try:
            return action(*args)
        except Exception as error:  # noqa: BLE001 - a detection must not be lost to the copy's failure
            self.fallback = f"the device-side copy failed ({error!r}); the state is copied every step instead"
            logger.warning("gpuprof: %s", self.fallback)
            self.keeper = StateKeeper(self.keeper.device)
            return {}

    def _prepare_device_copy(self, model: torch.nn.Module, step: int) -> dict[str, torch.Tensor]:
        """The device copy's tensors looked at again when their cheap signature changes (Adam's state
        appears after the first update) and every state_interval steps; this step's host copies."""
        replan = self._replan_due(step)
        if replan or (self._state_interval and step % self._state_interval == 0):
            tensors = live_tensors(model, self.optimizer, self.scaler)
            kept = self._plan(tensors, step) if replan else self._selected(tensors, step)
            self.keeper.prepare(kept, step, self.placement_at(step).where)
            self._non_tensor_state = self._whole_state(step) and bool(
                non_tensor_optimizer_state(model, self.optimizer, self._names))
        return self.keeper.per_step_copies()

    def _device_values(self, values) -> torch.Tensor:
        """Values as a device vector; host floats by their finiteness alone (no copy to the device)."""
        if isinstance(values, torch.Tensor):
            return values
        floats = [values] if isinstance(values, float) else values
        return self._zero if all(map(math.isfinite, floats)) else self._inf

    def _refresh_keeper(self, model: torch.nn.Module, step: int, unread_steps: bool) -> dict[str, torch.Tensor]:
        """Copies the live state into the keeper; returns the tensors kept per step instead."""
        tensors = self._selected(live_tensors(model, self.optimizer, self.scaler), step)
        return self.keeper.refresh(tensors, self._param_names, step, unread_steps=unread_steps)


def _is_parameter_side(name: str) -> bool:
    """A parameter, a buffer or the GradScaler's state: what a cheaper keep holds, without the optimizer's."""
    return OPTIMIZER_KEY_SEPARATOR not in name or name.startswith(SCALER_PREFIX)


def _local(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's shards of DTensors (FSDP2), empty ones left out."""
    return [t for t in map(local_tensor, tensors) if t.numel()]


def _absmax(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The largest |value| of every element of `tensors` (this rank's, not empty); NaN if any is NaN."""
    if device.type == "cpu":  # there the foreach inf-norm is a scalar loop, 5-15x slower than aminmax
        lows, highs = zip(*(torch.aminmax(tensor) for tensor in tensors))  # NaN propagates, like the norm
        return torch.maximum(torch.stack(lows).neg(), torch.stack(highs)).float().max()  # one op a tensor
    return torch.stack(foreach_norm(tensors, float("inf"))).float().max()


def absmax_of(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The largest |value| of this rank's floating tensors on `device` (0 for none); NaN if any is NaN."""
    floating = [t for t in _local(tensors) if t.is_floating_point() and t.device == device]
    return _absmax(floating, device) if floating else torch.zeros((), device=device)


WEIGHT_SAMPLE = 1024  # elements of each weight read per step for the largest |weight| when no copy is kept


class _WeightSample:
    """The largest |weight| over the first WEIGHT_SAMPLE elements of each weight, per step.

    What oversized_update compares from step to step; an oversized update moves every element
    it reaches. Where no copy of the state is kept (keep_state "when_bad", the CPU default), a
    pass over every weight would cost 11-63 ms a step for GPT-2 124M. The views, and the buffer they
    are copied into, are made once and re-made every `refresh_steps` steps (a weight replaced in
    between is seen late), so a step costs three small ops and no allocation. NumPy views of the weights were tried on the CPU: their code,
    which the loop itself never runs, is cold at every step and cost about four times as much.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device, refresh_steps: int):
        self._model, self._device, self._refresh_steps = model, device, refresh_steps
        self._views: list[torch.Tensor] | None = None
        self._sample: torch.Tensor | None = None  # the views' elements, copied: None without any

    def absmax(self, step: int) -> torch.Tensor:
        return self._read(refresh=self._views is None or bool(self._refresh_steps and step % self._refresh_steps == 0))

    def after_update(self) -> torch.Tensor:
        """The same largest |weight| right after the step's update, from the same views: tells an update that made a
        weight non-finite from a write after it (numerics.detectors.nonfinite_update)."""
        return self._read(refresh=self._views is None)

    def _read(self, refresh: bool) -> torch.Tensor:
        if refresh:
            self._sample = self._new_sample()
        elif self._sample is not None:
            torch.cat(self._views, out=self._sample)
        if self._sample is None:
            return torch.zeros((), device=self._device)
        return self._sample.abs_().max()  # NaN propagates; read with the step record

    def now(self) -> float | None:
        """The largest |weight| of the sample as the weights are now (a read: for a report, not per step)."""
        return None if self._sample is None else torch.cat(self._views).abs().max().item()

    def _new_sample(self) -> torch.Tensor | None:
        weights = _local([p.detach() for _, p in named_parameters(self._model)])  # FSDP2's shards
        self._views = [w.view(-1)[:WEIGHT_SAMPLE] for w in weights
                       if w.device == self._device and w.is_floating_point() and w.is_contiguous()]
        return torch.cat(self._views) if self._views else None
