"""The numerics collector: always-on finiteness flags, and forensics on the first bad step.

Per step, on the device and without a host sync, one small vector of watched values whose
non-finiteness is the flag: the loss; the losses backward() ran on, when the loop passed prof.step()
a loss of its own (a micro-batch's it did not pass); the global gradient norm (the gradient collector's; with
a GradScaler its skips decide instead, see _OverflowStreak); every `state_interval` steps the
largest |parameter| and |optimizer state|; then the largest |weight| at the start of the step
(to point back at an oversized update). The state the step starts from (StateKeeper) is frozen
when any of them is non-finite. The values reach the host with the step record (a step or two
later on CUDA, at once on CPU); the first bad step is then re-run from the kept state in
forensic mode and reported as a `nonfinite` event plus a replay bundle in RUN/numerics/.
The output of each evaluation forward between steps is watched too (evaluation.py): a blow-up that only an
evaluation saw, the loop dying before another step, is re-run and reported from it.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Callable

import torch

from gpuprof.modules import eager_model, materialized
from gpuprof.numerics.blame import Blame
from gpuprof.numerics.detectors import PERSISTENT_OVERFLOW_STEPS, LayerGradients, ScalerTimeline, SpikeDetector
from gpuprof.numerics.evaluation import EvaluationOutputs
from gpuprof.numerics.investigation import Investigator
from gpuprof.numerics.keeping import StepKeeping, absmax_of
from gpuprof.numerics.options import NumericsOptions
from gpuprof.numerics.skip import SkipBadUpdates
from gpuprof.numerics.state import StepInputs, live_tensors
from gpuprof.numerics.tape import Tape, autocast_now
from gpuprof.run.schema import EventKind

_FLAGS = ("loss", "backward_loss", "grads", "params", "optimizer_state", "scaler_overflow")


class NonFiniteError(RuntimeError):
    """on_nonfinite="raise": a step went non-finite (the event and bundle are already written)."""

    def __init__(self, blame: Blame):
        super().__init__(blame.message())
        self.blame = blame


class NumericsMonitor:
    """The numerics collector: the watched values and their events, the state kept for each step
    (keeping.py), the skip policy (skip.py), and the re-run of the first bad step (investigation.py)."""

    name = "numerics"

    def __init__(self, model: torch.nn.Module, optimizer=None, scaler=None, *,
                 loss_fn: Callable | None = None, on_nonfinite: str = "record",
                 options: NumericsOptions | None = None, gradients=None, tape: Tape | None = None):
        self.options = options or NumericsOptions()
        self.model, self.optimizer = model, optimizer
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.loss_fn, self.policy = loss_fn, on_nonfinite
        self._gradients = gradients
        self._tape = tape  # what each step computed, for the forensic re-run
        self._keeping = StepKeeping(model, optimizer, self.scaler, self.options.keep_state,
                                    self.options.state_interval, self.options.memory_budget_pct)
        self.stop_training: NonFiniteError | None = None
        self._prof = None
        self._investigator: Investigator | None = None
        self._evaluations: EvaluationOutputs | None = None
        self._held: Blame | None = None  # an evaluation's blame, until the step after it shows whether it is first
        self._history: deque[dict[str, Any]] = deque(maxlen=100)
        self._reports = 0
        self._later_bad_steps = 0
        self._handles: list = []
        self._scaler_timeline = ScalerTimeline()
        self._loss_spikes = SpikeDetector(EventKind.LOSS_SPIKE, "loss", self.options.spike_z, self.options.spike_window)
        self._grad_spikes = SpikeDetector(EventKind.GRAD_NORM_SPIKE, "gradient norm", self.options.spike_z,
                                          self.options.spike_window)
        self._layers: LayerGradients | None = None
        self._begun_at_phase = False  # the step's keeping began at prof.phase("forward"), not at a model call
        self._lazy = materialized(model.parameters()) is None  # a lazy module's parameters exist after its forward
        self._overflow = _OverflowStreak() if self.scaler is not None else None
        self._fallback_said = False
        self._placements_said = 0

    # ------------------------------------------------------------------ collector hooks
    def on_start(self, prof) -> None:
        self._prof = prof
        self._zero = torch.zeros((), device=prof.device)
        self._inf = torch.full((), math.inf, device=prof.device)
        self._investigator = Investigator(
            self._keeping, loss_fn=self.loss_fn, gradients=self._gradients, builder=self.options.builder,
            run_dir=prof.run_dir, rank=prof.ranks.rank, device_type=prof.device.type)
        guard = prof.collectors.guard
        self._evaluations = EvaluationOutputs(self.model, lambda hook: guard(self, "evaluation_output", hook))
        self._handles.append(prof.collectors.hook(self, self.model, "forward_pre", self._on_forward))
        self._keeping.start(prof.device, undo_updates=self.policy == "skip")
        if self._gradients is not None:
            self._gradients.call_before_update(guard(self, "before_update", self._keeping.before_update))
        if self.optimizer is not None:
            self._handles.append(prof.collectors.hook(self, self.optimizer, "step_post",
                                                      lambda *_: self._keeping.after_update()))
        if self.policy == "skip" and self.optimizer is not None:
            self._handles += SkipBadUpdates(self._keeping, prof.device).hooks(self.optimizer, guard, self)

    def meta(self, prof) -> dict:
        placements = self._keeping.placements
        return {"numerics_keep_state": self._keeping.mode,
                "numerics_state_placement": placements[-1].for_meta() if placements else None}

    def on_close(self, prof) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._evaluations is not None:
            self._evaluations.close()
            self._settle_held(prof, superseded=False)  # no step's record came after it
            self._report_evaluation(prof)  # the loop may have died in, or right after, an evaluation
        if self._later_bad_steps:
            prof.event(EventKind.NONFINITE_STEPS, f"{self._later_bad_steps} more non-finite steps after the reported one",
                       severity="warning", count=self._later_bad_steps)

    def on_step_start(self, prof, step: int) -> None:
        self._keeping.current = None
        self._begun_at_phase = False

    def on_join_at_backward(self, prof, step: int) -> None:
        """The step's forward ran before this collector started: its state and hyperparameters are
        those of its start still (a backward pass changes neither)."""
        if self._keeping.current is None:
            self._keeping.begin(step)

    def on_after_backward(self, prof, step: int) -> None:
        if self._gradients is None:
            self._keeping.after_backward()

    def on_phase_begin(self, prof, name: str) -> None:
        """A loop (or integration) that marks its forward phase starts the step's keeping there, also
        when its model's own forward is never called (Lightning calls `training_step`)."""
        if name == "forward" and self._keeping.current is None and torch.is_grad_enabled():
            self._keeping.begin(prof.step_index)
            self._begun_at_phase = True

    def on_step_end(self, prof, state) -> dict:
        inputs = self._keeping.current or self._keeping.begin(state.step)
        inputs.batch = state.batch
        inputs.tape = self._tape.take() if self._tape is not None else None
        watched = self._watched_values(state, inputs)
        self._keeping.end(inputs, watched, len(_FLAGS))
        return {"_numerics_values": watched, "_numerics_lrs": _lrs(inputs.hyper),
                "_numerics_param_absmax": inputs.param_absmax,
                "_numerics_param_absmax_after": inputs.param_absmax_after}

    def on_step_record(self, prof, record: dict) -> None:
        step = record["step"]
        if self._keeping.fallback is not None and not self._fallback_said:
            self._fallback_said = True
            prof.event(EventKind.STATE_KEEPING_FALLBACK, self._keeping.fallback, severity="warning", step=step)
        if len(self._keeping.placements) > self._placements_said:
            self._say_placements(prof)
        values = record.get("_numerics_values") or [0.0] * len(_FLAGS)
        self._history.append({"step": step, "param_absmax": record.get("_numerics_param_absmax"),
                              "param_absmax_after": record.get("_numerics_param_absmax_after"),
                              "lrs": record.get("_numerics_lrs")})
        for event in self._observe(step, record):
            prof.event(event["kind"], event["message"], severity=event["severity"], step=event["step"],
                       **event["details"])
        bad = _nonfinite(values)
        if bad:
            self._on_nonfinite(prof, step, bad)
        if self._held is not None and step > self._held.step:
            self._settle_held(prof, superseded=bool(bad))
        self._keeping.read(step, bool(bad))

    def _say_placements(self, prof) -> None:
        """A warning for each decision that keeps less than the whole state (a healthy run's events stay
        as they were); meta.json has the latest decision, whatever it is."""
        for placement in self._keeping.placements[self._placements_said:]:
            if placement.what != "state":
                prof.event(EventKind.STATE_PLACEMENT, f"NaN forensics keeps {placement.describe()}: {placement.reason}",
                           severity="warning", step=placement.step, **placement.for_meta())
        self._placements_said = len(self._keeping.placements)

    def investigate(self, step: int, trigger: str) -> Blame:
        """Re-runs `step` from its kept state in forensic mode and writes its replay bundle; never raises."""
        return self._investigator.investigate(step, trigger, self._history)

    # ------------------------------------------------------------------ always-on path
    def _on_forward(self, module, args, kwargs) -> None:
        if not torch.is_grad_enabled():  # evaluation inside the loop is not part of the step: only its output is
            self._evaluations.before_forward(self._prof.step_index - 1, args, kwargs)
            return
        if self._keeping.current is None:
            self._hold_evaluation()  # before this step's update changes the weights it ran on
        if self._lazy:
            self._lazy = materialized(self.model.parameters()) is None
            if self._lazy:
                return  # the step of a lazy module's first forward: no state to keep from before it
        if self._keeping.current is None:
            self._keeping.begin(self._prof.step_index)
        elif self._begun_at_phase:  # the loop enters autocast inside its forward phase
            self._keeping.current.autocast = autocast_now()
        self._begun_at_phase = False

    def _watched_values(self, state, inputs: StepInputs) -> torch.Tensor | list[float]:
        """Non-finite where a flag of _FLAGS is raised: one float vector on an accelerator (read later
        with the record), plain floats on the CPU (read at once, no sync).

        The values the step record carries anyway (loss, gradient norm) are their own flags: no
        device op per step tests them. Parameters and optimizer state are read every `state_interval`."""
        params = optimizer = overflow = None
        interval = self.options.state_interval
        if interval and state.step % interval == 0:
            params, optimizer = self._state_absmax()
        if self._overflow is not None:
            persistent = self._overflow.update(self.scaler)
            overflow = torch.where(persistent, self._inf, self._zero) if persistent is not None else None
        # with a scaler its skips decide, unless an optimizer it did not skip stepped with non-finite gradients
        grads = state.grad_norm if self.scaler is None else math.inf if state.stepped_nonfinite_grads else None
        values = [state.loss, state.backward_loss, grads, params, optimizer, overflow]
        if self._prof.device.type == "cpu":
            return [_host_float(value) for value in values]
        return torch.stack([_device_float(value, self._zero, self._inf) for value in values])

    def _state_absmax(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The largest |parameter| and |optimizer state tensor|."""
        model, device = eager_model(self.model), self._prof.device
        params = absmax_of([p.detach() for p in model.parameters()], device)
        return params, absmax_of([t for n, t in live_tensors(model, self.optimizer).items() if "::" in n], device)

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
        self._report(prof, blame.step, blame)  # an earlier step, where its update made the weights non-finite

    def _report_evaluation(self, prof) -> None:
        """An evaluation since the last training step whose output was not finite, with no step after it: its
        forward re-run on the weights it ran on (no step's flags would see them when the loop dies next)."""
        evaluation = self._evaluations.first_nonfinite()
        if evaluation is None or self._reports >= self.options.max_reports:
            return
        self._reports += 1
        self._report(prof, evaluation.after_step, self._investigator.investigate_evaluation(evaluation, self._history))

    def _hold_evaluation(self) -> None:
        """A training step follows a non-finite evaluation: its blame is made now, on the weights it ran on, and
        reported only where that step's own flags stay finite (a step that goes bad is blamed as a whole step)."""
        evaluation = self._evaluations.first_nonfinite()
        if evaluation is not None and self._held is None and self._reports < self.options.max_reports:
            self._held = self._investigator.investigate_evaluation(evaluation, self._history)

    def _settle_held(self, prof, superseded: bool) -> None:
        blame, self._held = self._held, None
        if blame is None:
            return
        if superseded:
            self._investigator.discard(blame)
            return
        self._reports += 1
        self._report(prof, blame.step, blame)

    def _report(self, prof, step: int, blame: Blame) -> None:
        details = {key: value for key, value in blame.details().items() if key != "step"}
        prof.event(EventKind.NONFINITE, blame.message(), severity="critical", step=step, **details)
        if self.policy == "raise":
            self.stop_training = NonFiniteError(blame)


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


def _host_float(value: Any) -> float:
    """A watched value read on the host (a CPU tensor: no sync); 0.0 (finite) for one not watched."""
    if isinstance(value, torch.Tensor):
        return value.item()
    return float(value) if isinstance(value, (int, float)) else 0.0


def _device_float(value: Any, zero: torch.Tensor, inf: torch.Tensor) -> torch.Tensor:
    """A watched value as a float32 scalar on the device; a host number (a loss passed as a float) as
    `zero` or `inf` by its finiteness, with no copy to the device; `zero` (finite) for one not watched."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(zero.device, torch.float32)
    if isinstance(value, (int, float)):
        return zero if math.isfinite(value) else inf
    return zero


def _lrs(hyper: list[dict]) -> list[float | None]:
    """Each param group's lr as a number: a Python number, or a one-element tensor on the CPU (a compiled
    optimizer's); None for one on a device, whose read would wait for it."""
    return [_host_number(group.get("lr")) for group in hyper]


def _host_number(value: Any) -> float | None:
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.numel() == 1:
        return value.item()
    return None


def _nonfinite(values: list[float]) -> list[str]:
    """The raised flags of a watched-values vector, in _FLAGS order."""
    return [name for name, value in zip(_FLAGS, values) if not math.isfinite(value)]
