"""The numerics collector: always-on finiteness flags, and forensics on the first bad step.

Per step, on the device and without a host sync, one small vector of watched values whose
non-finiteness is the flag: the loss; the global gradient norm (the gradient collector's; with
a GradScaler its skips decide instead, see _OverflowStreak); every `state_interval` steps the
largest |parameter| and |optimizer state|; then the largest |weight| at the start of the step
(to point back at an oversized update). The state the step starts from (StateKeeper) is frozen
when any of them is non-finite. The values reach the host with the step record (a step or two
later on CUDA, at once on CPU); the first bad step is then re-run from the kept state in
forensic mode and reported as a `nonfinite` event plus a replay bundle in RUN/numerics/.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Any, Callable

import torch

from gpuprof.modules import eager_model, is_sharded, local_tensor
from gpuprof.numerics import bundle
from gpuprof.numerics.blame import NOT_REPRODUCED, Blame
from gpuprof.numerics.forensics import default_loss, load_state, private_copy, reenact
from gpuprof.numerics.options import NumericsOptions
from gpuprof.numerics.state import (
    StateKeeper, StepInputs, hyperparameters, live_tensors, non_tensor_optimizer_state, param_names, rng_states,
)
from gpuprof.numerics.tape import VERIFY_EVERY, Tape, TapeError, autocast_now, encode_micro_batch
from gpuprof.numerics.timeline import LayerGradients, ScalerTimeline, SpikeDetector, oversized_update
from gpuprof.run.schema import EventKind

logger = logging.getLogger("gpuprof")

_FLAGS = ("loss", "grads", "params", "optimizer_state", "scaler_overflow")
PERSISTENT_OVERFLOW_STEPS = 3  # GradScaler skips in a row, after warm-up, that make it a real problem


class NonFiniteError(RuntimeError):
    """on_nonfinite="raise": a step went non-finite (the event and bundle are already written)."""

    def __init__(self, blame: Blame):
        super().__init__(blame.message())
        self.blame = blame


class NumericsMonitor:
    name = "numerics"

    def __init__(self, model: torch.nn.Module, optimizer=None, scaler=None, *,
                 loss_fn: Callable | None = None, on_nonfinite: str = "record",
                 options: NumericsOptions | None = None, gradients=None, tape: Tape | None = None):
        self.options = options or NumericsOptions()
        self.model, self.optimizer = model, optimizer
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.loss_fn, self.policy = loss_fn, on_nonfinite
        self._gradients = gradients  # capture's GradientCollector: its norms say whether grads are finite
        self._tape = tape  # what each step computed, for the forensic re-run
        self.stop_training: NonFiniteError | None = None
        self._prof = None
        self._keeper: StateKeeper | None = None
        self._inputs: StepInputs | None = None
        self._kept: dict[int, StepInputs] = {}
        self._history: deque[dict[str, Any]] = deque(maxlen=100)
        self._reports = 0
        self._later_bad_steps = 0
        self._handles: list = []
        self._skip_bad: torch.Tensor | None = None
        self._scaler_timeline = ScalerTimeline()
        self._loss_spikes = SpikeDetector(EventKind.LOSS_SPIKE, "loss", self.options.spike_z, self.options.spike_window)
        self._grad_spikes = SpikeDetector(EventKind.GRAD_NORM_SPIKE, "gradient norm", self.options.spike_z,
                                          self.options.spike_window)
        self._layers: LayerGradients | None = None
        self._overflow = _OverflowStreak() if self.scaler is not None else None

    # ------------------------------------------------------------------ collector hooks
    def on_start(self, prof) -> None:
        self._prof = prof
        model = eager_model(self.model)
        self._names = param_names(model)  # once: the per-step path only looks names up
        self._param_names = frozenset(self._names.values())
        self._weights = _WeightSample(model, prof.device, self.options.state_interval)
        self._zero = torch.zeros((), device=prof.device)
        self._inf = torch.full((), math.inf, device=prof.device)
        if self.options.keep_state is not False:
            self._keeper = StateKeeper(prof.device)
        hook = torch._dynamo.disable(prof.collectors.guard(self, "forward_pre_hook", self._on_forward))
        self._handles.append(self.model.register_forward_pre_hook(hook, with_kwargs=True))
        if self._keeps_lazily and self.optimizer is not None:  # before the skip policy's hooks
            self._handles.append(self.optimizer.register_step_pre_hook(
                prof.collectors.guard(self, "optimizer_pre_hook", self._keep_if_grads_bad)))
        if self.policy == "skip" and self.optimizer is not None:
            guard = prof.collectors.guard
            self._handles += [
                self.optimizer.register_step_pre_hook(guard(self, "optimizer_pre_hook", self._check_grads)),
                self.optimizer.register_step_post_hook(guard(self, "optimizer_post_hook", self._undo_bad_update)),
            ]

    def on_close(self, prof) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._later_bad_steps:
            prof.event(EventKind.NONFINITE_STEPS, f"{self._later_bad_steps} more non-finite steps after the reported one",
                       severity="warning", count=self._later_bad_steps)

    def on_step_start(self, prof, step: int) -> None:
        self._inputs = None

    def on_step_end(self, prof, state) -> dict:
        inputs = self._inputs or self._begin_step(state.step)
        inputs.batch = state.batch
        inputs.tape = self._tape.take() if self._tape is not None else None
        self._kept[state.step] = inputs
        watched = self._watched_values(state, inputs)
        if self._keeper is not None:
            if not self._keeps_lazily:
                self._keeper.freeze_if(~torch.isfinite(watched[: len(_FLAGS)]).all())
            elif not inputs.state_kept and _nonfinite(watched.tolist()):  # a CPU tensor: no sync
                self._keep_state_now(inputs)  # no update happened, or its gradients looked finite
        return {"_numerics_values": watched, "_numerics_lr": _first_lr(inputs.hyper)}

    def on_step_record(self, prof, record: dict) -> None:
        step = record["step"]
        values = record.get("_numerics_values") or [0.0] * (len(_FLAGS) + 1)
        self._history.append({"step": step, "param_absmax": values[-1], "lr": record.get("_numerics_lr")})
        for event in self._observe(step, record):
            prof.event(event["kind"], event["message"], severity=event["severity"], step=event["step"],
                       **event["details"])
        bad = _nonfinite(values)
        if bad:
            self._on_nonfinite(prof, step, bad)
            if self._keeper is not None:
                self._keeper.unfreeze()  # frozen means "an unread bad step": this one is read now
        self._kept = {s: i for s, i in self._kept.items() if s > step}
        if self._keeper is not None:
            self._keeper.release(step)

    # ------------------------------------------------------------------ always-on path
    @property
    def _keeps_lazily(self) -> bool:
        keep = self.options.keep_state
        return self._keeper is not None and (
            keep == "when_bad" or (keep == "auto" and self._keeper.device.type == "cpu"))

    def _keep_if_grads_bad(self, optimizer, args, kwargs) -> None:
        """Just before the update the weights are still those the step started from."""
        if self._inputs is None:
            return
        if not all(map(math.isfinite, self._grad_norms(optimizer).tolist())):  # read on the host: no device ops
            self._keep_state_now(self._inputs)
        else:
            self._inputs.updated_first = True

    def _grad_norms(self, optimizer) -> torch.Tensor:
        """Per-tensor gradient 2-norms: capture's, when it computed them for this backward pass.
        (A 2-norm also trips on |g| > 1e19; the only cost of that is one copy not needed.)"""
        norms = self._gradients.latest_norms if self._gradients is not None else None
        if norms is not None:
            return norms
        grads = _grads(optimizer)
        return torch.stack(torch._foreach_norm(grads, 2.0)) if grads else torch.zeros(0)

    def _keep_state_now(self, inputs: StepInputs) -> None:
        model = eager_model(self.model)
        inputs.other_device = self._refresh_keeper(model, inputs.step, unread_steps=False)
        inputs.non_tensor = non_tensor_optimizer_state(model, self.optimizer, self._names)  # with the tensors
        inputs.state_kept = True

    def _refresh_keeper(self, model: torch.nn.Module, step: int, unread_steps: bool) -> dict[str, torch.Tensor]:
        """Copies the live state into the keeper; returns the tensors kept per step instead."""
        tensors = live_tensors(model, self.optimizer, self.scaler)
        return self._keeper.refresh(tensors, self._param_names, step, unread_steps=unread_steps)

    def _on_forward(self, module, args, kwargs) -> None:
        if not torch.is_grad_enabled():
            return  # evaluation inside the loop is not part of the step
        if self._inputs is None:
            self._begin_step(self._prof.step_index)

    def _begin_step(self, step: int) -> StepInputs:
        model = eager_model(self.model)
        keeps_every_step = self._keeper is not None and not self._keeps_lazily
        other = self._refresh_keeper(model, step, unread_steps=bool(self._kept)) if keeps_every_step else {}
        non_tensor = non_tensor_optimizer_state(model, self.optimizer, self._names) if keeps_every_step else {}
        self._inputs = StepInputs(
            step=step, rng=rng_states(), hyper=hyperparameters(self.optimizer), other_device=other,
            non_tensor=non_tensor, training=model.training, autocast=autocast_now(),
        )
        absmax = self._keeper.param_absmax() if keeps_every_step else None  # the copy just made
        self._inputs.param_absmax = absmax if absmax is not None else self._weights.absmax(step)
        return self._inputs

    def _watched_values(self, state, inputs: StepInputs) -> torch.Tensor:
        """One float vector, non-finite where a flag of _FLAGS is raised, then the largest |weight|.

        The values the step record carries anyway (loss, gradient norm) are their own flags: no
        device op per step tests them. Parameters and optimizer state are read every `state_interval`."""
        device, zero = self._prof.device, self._zero
        loss = state.loss if isinstance(state.loss, torch.Tensor) else zero
        grads = state.grad_norm if self.scaler is None and isinstance(state.grad_norm, torch.Tensor) else zero
        params = optimizer = zero
        interval = self.options.state_interval
        if interval and state.step % interval == 0:
            model = eager_model(self.model)
            params = _absmax_of([p.detach() for p in model.parameters()], device)
            optimizer = _absmax_of([t for n, t in live_tensors(model, self.optimizer).items() if "::" in n], device)
        overflow = self._overflow.update(self.scaler) if self._overflow is not None else None
        overflow = torch.where(overflow, self._inf, zero) if overflow is not None else zero
        absmax = inputs.param_absmax if inputs.param_absmax is not None else zero
        values = [loss if loss.dim() == 0 else loss.sum(), grads, params, optimizer, overflow, absmax]
        return torch.stack([value.to(device, torch.float32) for value in values])

    # ------------------------------------------------------------------ skip policy
    def _check_grads(self, optimizer, args, kwargs) -> None:
        grads = _grads(optimizer)
        self._skip_bad = ~torch.isfinite(_absmax_of(grads, self._prof.device)) if grads else None

    def _undo_bad_update(self, optimizer, args, kwargs) -> None:
        """Puts parameters and optimizer state back where the step's gradients were non-finite."""
        if self._skip_bad is None or self._keeper is None or self._inputs is None:
            return
        kept = self._keeper.current_views()
        live = {n: t for n, t in live_tensors(eager_model(self.model), self.optimizer).items()
                if t.device == self._keeper.device}
        with torch.no_grad():  # state this step created (Adam's first step) goes back to zeros
            before = [kept[n] if n in kept else torch.zeros_like(t) for n, t in live.items()]
            restored = [torch.where(self._skip_bad, old, t) for old, t in zip(before, live.values())]
            torch._foreach_copy_(list(live.values()), restored)
        self._skip_bad = None

    # ------------------------------------------------------------------ host side
    def _observe(self, step: int, record: dict) -> list[dict]:
        events = self._scaler_timeline.observe(step, record.get("step_skipped"), record.get("scaler_scale"))
        events += self._loss_spikes.observe(step, record.get("loss"))
        events += self._grad_spikes.observe(step, record.get("grad_norm"))
        if record.get("_param_grad_norms") is not None:
            if self._layers is None:
                names = [n for n, p in eager_model(self.model).named_parameters() if p.requires_grad]
                self._layers = LayerGradients(names, self.options.layer_factor)
            events += self._layers.observe(step, record["_param_grad_norms"])
        return events

    def _on_nonfinite(self, prof, step: int, flags: list[str]) -> None:
        if self._reports >= self.options.max_reports:
            self._later_bad_steps += 1
            return
        self._reports += 1
        blame = self.investigate(step, trigger=flags[0])
        details = {key: value for key, value in blame.details().items() if key != "step"}
        prof.event(EventKind.NONFINITE, blame.message(), severity="critical", step=step, **details)
        if self.policy == "raise":
            self.stop_training = NonFiniteError(blame)

    def investigate(self, step: int, trigger: str) -> Blame:
        """Re-runs `step` from its kept state in forensic mode; writes the replay bundle.

        Never raises: what the flags saw is the answer when the re-run cannot run or fails,
        with the reason in the notes (a detection is never lost to a forensic failure)."""
        blame = Blame(step=step, rank=self._prof.ranks.rank, trigger=trigger)
        try:
            return self._reenact(step, blame)
        except Exception as error:  # noqa: BLE001 - our failure, not the user's: report it, keep going
            logger.warning("gpuprof: forensic re-run of step %d failed: %r", step, error)
            blame.notes.append(f"{NOT_REPRODUCED}the forensic re-run failed ({error!r})")
            return blame

    def _reenact(self, step: int, blame: Blame) -> Blame:
        if is_sharded(self.model):
            origin = self._gradients.nonfinite_origin(step) if self._gradients is not None else None
            return _sharded_blame(blame, origin)
        inputs = self._kept.get(step)
        state = self._keeper.state_before(step) if self._keeper is not None and inputs else None
        if state is None:
            blame.notes.append(NOT_REPRODUCED + "the state before this step was not kept (numerics keep_state off?)")
            return blame
        micro_batches, loss_fn, loss_kind, missing = self._replay_plan(inputs)
        blame.notes += missing
        model, optimizer, scaler = private_copy(self.model, self.optimizer, self.scaler)
        load_state(model, optimizer, scaler, state, inputs)
        contents = self._bundle_contents(model, optimizer, scaler, inputs, micro_batches, loss_kind)
        found = reenact(model, optimizer, scaler, loss_fn, micro_batches, inputs, rank=blame.rank)
        found.trigger, found.notes = blame.trigger, blame.notes + found.notes
        found.cause = oversized_update(self._history, step)
        self._explain(found, inputs)
        self._save_bundle(found, contents)
        return found

    def _save_bundle(self, blame: Blame, contents: dict[str, Any]) -> None:
        path = bundle.bundle_path(self._prof.run_dir, blame.step, blame.rank)
        try:
            bundle.save(path, {**contents, "blame": {**blame.details(), "bundle": str(path)}})
            blame.bundle = str(path)
        except Exception as error:  # noqa: BLE001 - the blame stands without its bundle
            blame.notes.append(f"no replay bundle: writing {path} failed ({error!r})")

    def _explain(self, blame: Blame, inputs: StepInputs) -> None:
        if blame.trigger == "scaler_overflow":
            blame.notes.append(f"GradScaler skipped {PERSISTENT_OVERFLOW_STEPS}+ steps in a row up to here (or its "
                               "scale fell below 1); skipped steps leave the weights as they were")
        if inputs.updated_first:
            blame.notes.append("the state was kept after this step's update, since its gradients were finite "
                               "(numerics keep_state 'when_bad'): if the update itself overflowed it shows as "
                               "phase 'state'; keep_state='every_step' replays it exactly")
        if not blame.reproduced:
            blame.notes.append(NOT_REPRODUCED + "the re-run stayed finite (a non-deterministic kernel, or state "
                               "changed outside the model, optimizer and scaler)")

    def _replay_plan(self, inputs: StepInputs) -> tuple[list, Any, str, list[str]]:
        """(micro-batches, loss function, loss kind for the bundle, notes on what could not be kept)."""
        if inputs.batch is not None:
            batches = inputs.batch if isinstance(inputs.batch, list) else [inputs.batch]
            return batches, self.loss_fn or default_loss, "custom" if self.loss_fn else "default", []
        tape = inputs.tape
        if tape is not None and tape.replayable:
            assumed = [] if tape.assumed_from is None else [
                f"backward() was taken to run on the model's own output, as gpuprof saw it do at step "
                f"{tape.assumed_from} (checked every {VERIFY_EVERY} steps)"]
            return list(tape.micro_batches), default_loss, "program", assumed
        why = tape.error if tape is not None and tape.error else "no backward() was seen after the model's forward"
        return list(tape.calls if tape is not None else []), default_loss, "default", [
            f"the loss computation was not recorded ({why}): re-run as model(...).loss; "
            "pass loss_fn= and prof.step(batch=...) to replay a custom loss"]

    def _bundle_contents(self, model, optimizer, scaler, inputs, micro_batches, loss_kind) -> dict[str, Any]:
        names = {id(p): n for n, p in model.named_parameters()}
        if loss_kind == "program":
            try:
                micro_batches = [encode_micro_batch(micro) for micro in micro_batches]
            except TapeError as error:
                micro_batches, loss_kind = [], f"unavailable: {error}"
        return bundle.to_host({
            "step": inputs.step, "rank": self._prof.ranks.rank, "device_type": self._prof.device.type,
            "model_state": model.state_dict(),
            "optimizer": None if optimizer is None else {
                "class": type(optimizer).__name__, "state_dict": optimizer.state_dict(),
                "params": [names[id(p)] for g in optimizer.param_groups for p in g["params"]]},
            "scaler": scaler.state_dict() if scaler is not None else None,
            "rng": inputs.rng, "micro_batches": micro_batches, "loss": loss_kind,
            "inputs": {"training": inputs.training, "autocast": inputs.autocast},
            "builder": self.options.builder or bundle.builder_for(model),
        })


class _OverflowStreak:
    """On the device: GradScaler skipping step after step once warmed up, or its scale below 1.

    With a scaler, non-finite gradients are its business (a skipped step) until they persist;
    a skip shows as the scale going down, so no found-inf tensor needs to be caught.
    """

    def __init__(self):
        self._previous = self._streak = self._warmed_up = None

    def update(self, scaler) -> torch.Tensor | None:
        scale = getattr(scaler, "_scale", None)
        if scale is None:
            return None
        if self._previous is None:  # the scale appears at the first scaler.scale(); it started at _init_scale
            self._previous = torch.full_like(scale, scaler._init_scale)
            self._streak = torch.zeros((), dtype=torch.int32, device=scale.device)
            self._warmed_up = torch.zeros((), dtype=torch.bool, device=scale.device)
        skipped = (scale < self._previous).reshape(())
        torch.logical_or(self._warmed_up, ~skipped, out=self._warmed_up)
        torch.where(skipped, self._streak + 1, torch.zeros_like(self._streak), out=self._streak)
        self._previous.copy_(scale)
        persistent = self._warmed_up & (self._streak >= PERSISTENT_OVERFLOW_STEPS)
        return persistent | (scale < 1).reshape(())


def _grads(optimizer) -> list[torch.Tensor]:
    return [local_tensor(p.grad) for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


def _first_lr(hyper: list[dict]) -> float | None:
    lr = hyper[0].get("lr") if hyper else None
    return float(lr) if isinstance(lr, (int, float)) else None


def _sharded_blame(blame: Blame, origin: tuple[int, str] | None) -> Blame:
    """A sharded model (FSDP2): the re-run needs every rank's shards in one process, so the flags answer."""
    if origin is not None:
        blame.rank, blame.tensor = origin
        blame.notes.append(f"rank {blame.rank} held the first non-finite gradient shard, of {blame.tensor}")
    blame.notes.append(NOT_REPRODUCED + "the model is sharded (DTensor parameters, e.g. FSDP2) and the forensic "
                       "re-run runs on one process with the whole model")
    return blame


def _local(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's shards of DTensors (FSDP2), empty ones left out."""
    return [t for t in map(local_tensor, tensors) if t.numel()]


def _absmax(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The largest |value| of every element of `tensors` (this rank's, not empty); NaN if any is NaN."""
    if device.type == "cpu":  # there the foreach inf-norm is a scalar loop, 5-15x slower than aminmax
        extremes = [torch.aminmax(tensor) for tensor in tensors]  # NaN propagates, like the norm
        return torch.stack([torch.maximum(-low, high) for low, high in extremes]).float().max()
    return torch.stack(torch._foreach_norm(tensors, float("inf"))).float().max()


def _absmax_of(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The largest |value| of this rank's floating tensors on `device` (0 for none); NaN if any is NaN."""
    floating = [t for t in _local(tensors) if t.is_floating_point() and t.device == device]
    return _absmax(floating, device) if floating else torch.zeros((), device=device)


def _nonfinite(values: list[float]) -> list[str]:
    """The raised flags of a watched-values vector, in _FLAGS order."""
    return [name for name, value in zip(_FLAGS, values) if not math.isfinite(value)]


WEIGHT_SAMPLE = 1024  # elements of each weight read per step for the largest |weight| when no copy is kept


class _WeightSample:
    """The largest |weight| over the first WEIGHT_SAMPLE elements of each weight, per step.

    What oversized_update compares from step to step; an oversized update moves every element
    it reaches. Where no copy of the state is kept (keep_state "when_bad", the CPU default), a
    pass over every weight would cost 11-63 ms a step for GPT-2 124M. The views are made once
    and re-made every `refresh_steps` steps (a weight replaced in between is seen late), so a
    step costs three small ops.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device, refresh_steps: int):
        self._model, self._device, self._refresh_steps = model, device, refresh_steps
        self._views: list[torch.Tensor] | None = None

    def absmax(self, step: int) -> torch.Tensor:
        if self._views is None or (self._refresh_steps and step % self._refresh_steps == 0):
            weights = _local([p.detach() for p in self._model.parameters()])
            self._views = [w.view(-1)[:WEIGHT_SAMPLE] for w in weights
                           if w.device == self._device and w.is_floating_point() and w.is_contiguous()]
        if not self._views:
            return torch.zeros((), device=self._device)
        return torch.cat(self._views).abs().max().float()  # NaN propagates
