"""Gradient norms (before clipping) and update-to-weight ratios, computed on the device.

Once per step, at the first moment that sees the step's final gradients before anything changes
them, the global gradient norm is taken as `clip_grad_norm_` computes it:
- at the loop's own `clip_grad_norm_` (gpuprof.capture.clipping): when it covers exactly the
  model's gradients with the 2-norm, unscaled, its total norm is the record's, at no cost; else
  gpuprof computes the norm there, before that call clips;
- else at `optimizer.step()`'s pre-hook (under a GradScaler, after `scaler.step()` unscaled);
- else at the end of a backward pass that runs inside `optimizer.step(closure)` (Lightning), or
  of every backward pass when no optimizer was given, or when the loop clips inside torch.compile'd
  code, where gpuprof cannot see the clip (the first such step, whose norm was taken after the clip,
  records none); else at `prof.step()`.
gpuprof's own pass is one fused `torch._foreach_norm`, divided by the GradScaler's scale while the
gradients are still scaled. Per-parameter norms are computed at that moment only on the steps that
write per-layer rows. Under gradient accumulation the norm is that of the accumulated gradient.
A step the GradScaler skipped reaches no clip and no optimizer hook: its norm is taken at
`prof.step()` from whatever gradients are left (none after `zero_grad()`: no norm).

Under FSDP2 (DTensor parameters) each rank computes the norms of its own shards and one
all-reduce per step, at the step's end, sums their squares over the ranks: the norms recorded
are those `clip_grad_norm_` computes over the sharded model, the same on every rank.

Every rank must reach that all-reduce every step, or the others wait for it forever. So on a
sharded model a failure in this collector's own hooks stops its computing on that rank, not the
collector; the rank keeps joining the all-reduce with its part marked unknown, and every rank then
records no gradient norm. When the collector or the whole Profiler switches off on one rank
anyway, the Profiler calls `join_step_collectives` once per `prof.step()` for the same reason.

Per-layer rows (per transformer block and per parameter) go to the `layers` stream every
`layer_interval` steps; update ratios ‖Δw‖/‖w‖ every `update_ratio_interval` steps, from a
copy of the weights taken just before the step's first `optimizer.step()` and dropped at `prof.step()`
(with several optimizers, gpuprof.optimizers, after all of them).
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch.amp.grad_scaler import OptState

from gpuprof.capture import clipping
from gpuprof.capture.fsdp import ShardReduction
from gpuprof.capture.pending import all_finite, read_if_host
from gpuprof.capture.trace import own_work
from gpuprof.blocks import block_groups, combined_norm
from gpuprof.modules import is_sharded, local_tensor, named_parameters
from gpuprof.optimizers import members, params_of
from gpuprof.run.schema import EventKind
from gpuprof.torch_compat import foreach_mul, foreach_norm, foreach_sub

_MAX_ORIGINS = 16  # bad steps whose origin is kept for the numerics report (the first ones)


def tensor_norms(tensors: list[torch.Tensor | None], same_kind: bool = False) -> torch.Tensor:
    """The 2-norm of each tensor (0 for None) as one float32 vector on the first tensor's device.
    same_kind: the caller knows that every tensor has one device and dtype (a check less per step)."""
    present = [t for t in tensors if t is not None]
    if not present:
        return torch.zeros(len(tensors))
    if same_kind and len(present) == len(tensors):
        return _float32(torch.stack(foreach_norm(present)))
    device = present[0].device
    by_group: dict[tuple, list[int]] = defaultdict(list)
    for index, tensor in enumerate(tensors):
        if tensor is not None:
            by_group[(tensor.device, tensor.dtype)].append(index)
    if len(by_group) == 1 and len(present) == len(tensors):
        return _float32(torch.stack(foreach_norm(present)))
    # assembled by stacking, not `norms[indices] = ...`: a list index is copied to the device
    # with a blocking copy, a host-device sync on every backward pass
    parts = [torch.zeros((), dtype=torch.float32, device=device)] * len(tensors)
    for indices in by_group.values():
        group_norms = torch.stack(foreach_norm([tensors[i] for i in indices])).to(device).float()
        for index, norm in zip(indices, group_norms.unbind()):
            parts[index] = norm
    return torch.stack(parts)


def _float32(norms: torch.Tensor) -> torch.Tensor:
    """No `.float()` call where the norms are float32 already: it is still a torch op, about 10 us
    right after a training step."""
    return norms if norms.dtype == torch.float32 else norms.float()


class GradientCollector:
    name = "gradients"

    def __init__(self, model: torch.nn.Module, optimizer, scaler, layer_interval: int, update_ratio_interval: int):
        named = [(name, param) for name, param in named_parameters(model) if param.requires_grad]
        self.names = [name for name, _ in named]
        self.params = [param for _, param in named]
        self._same_kind = len({(param.device, param.dtype) for param in self.params}) == 1  # so are their grads
        self._member_of = _member_of(self.params, optimizer)
        self.blocks = block_groups(self.names)
        self._scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self._optimizer = optimizer
        self._layer_interval = layer_interval
        self._ratio_interval = update_ratio_interval if optimizer is not None else 0
        self._total: torch.Tensor | float | None = None  # the step's global norm, once taken (CPU: read)
        self._param_norms: torch.Tensor | None = None  # per parameter, on layer steps (and sharded: every step)
        self._passes = 0
        self._in_update = False  # between optimizer.step()'s pre- and post-hook
        self._weights_before: list[torch.Tensor] | None = None
        self._update_norms: tuple[torch.Tensor, torch.Tensor] | None = None
        self._layer_step = self._ratio_step = False
        self._handles: list = []
        self._stop_clip_watch = lambda: None
        self._before_update: list = []  # called with the global norm when it is taken before an update
        self._reduction = ShardReduction(len(self.params)) if is_sharded(model) and self.params else None
        self.has_step_collectives = self._reduction is not None  # see join_step_collectives
        self._nonfinite_origins: dict[int, tuple[int, str]] = {}
        self._step = 0
        self._joined = False  # sharded: whether this step's all-reduce was made
        self._failed: str | None = None  # sharded: why this rank stopped computing norms
        self._clips_compiled = False  # the loop clips inside torch.compile'd code, unseen (see clipping)
        self._clipped = False  # this step's gradients were clipped by the loop
        self._clipped_steps = 0
        self._clip_max_norm: float | None = None  # the last the loop clipped to
        self._several = len(members(optimizer)) > 1
        self._stepped_nonfinite = False  # see _check_stepping_member

    # -- hooks
    def on_start(self, prof) -> None:
        self._prof = prof
        hook = prof.collectors.hook
        if self._optimizer is not None:
            before, after = self._ranks_safe(self._before_optimizer_step), self._ranks_safe(self._after_optimizer_step)
            self._handles = [hook(self, self._optimizer, "step_pre", before),
                             hook(self, self._optimizer, "step_post", after)]
        guard = prof.collectors.guard
        self._stop_clip_watch = clipping.watch(guard(self, "clip_grad_norm", self._ranks_safe(self._loop_norm_seen)),
                                               guard(self, "clip_grad_norm", self._clip_made))

    def on_close(self, prof) -> None:
        for handle in self._handles:
            handle.remove()
        self._stop_clip_watch()

    def call_before_update(self, listener) -> None:
        """`listener(global_norm)` runs when the step's norm is taken before the optimizer's update
        (the NaN forensics keep the weights then, if the norm is not finite)."""
        self._before_update.append(listener)

    def on_step_start(self, prof, step: int) -> None:
        self._total, self._param_norms, self._passes, self._update_norms, self._joined = None, None, 0, None, False
        self._step, self._weights_before, self._clipped, self._stepped_nonfinite = step, None, False, False
        self._layer_step = bool(self._layer_interval) and step % self._layer_interval == 0
        self._ratio_step = bool(self._ratio_interval) and step % self._ratio_interval == 0

    def on_after_backward(self, prof, step: int) -> None:
        self._passes += 1
        self._total = self._param_norms = None  # new gradients
        if self._in_update or self._optimizer is None or self._clips_compiled:
            self._ranks_safe(self._take_norm)(True)

    def join_step_collectives(self, prof) -> None:
        """Once per step after this collector (or the whole Profiler) switched off on this rank: the
        step's all-reduce if it was not made yet, with this rank's part unknown."""
        self._failed = self._failed or "capture switched off on this rank"
        if not self._joined:
            self._reduce_over_ranks(prof.device)
        self.on_step_start(prof, self._step + 1)

    def _take_norm(self, before_update: bool) -> None:
        """The step's norm from gpuprof's own pass, unless it is already taken."""
        if self._total is not None or not self._passes:
            return
        grads = [param.grad for param in self.params]
        if all(grad is None for grad in grads):
            return
        if self._reduction is not None:  # DTensors only exist on a sharded model
            grads = [local_tensor(grad) for grad in grads]
        norms = self._unscaled(tensor_norms(grads, same_kind=self._same_kind))
        self._param_norms, self._total = norms, torch.linalg.vector_norm(norms)
        if before_update:
            self._notify()

    def _loop_norm_seen(self, grads: list, norm_type: float, total: torch.Tensor) -> None:
        """The loop's clip_grad_norm_ computed `total` over `grads`, which it is about to clip."""
        if self._total is not None or not self._passes:
            return
        if self._reduction is None and not self._layer_step and self._is_global_norm(grads, norm_type):
            self._total = total
            self._notify()
        else:
            self._take_norm(True)

    def _clip_made(self, max_norm: float | None) -> None:
        self._clipped = True
        if max_norm is not None:
            self._clip_max_norm = max_norm

    def meta(self, prof) -> dict:
        """How often the loop clipped its gradients and to what: the rules' advice on clipping reads it."""
        return {"gradient_clipping": {"clipped_steps": self._clipped_steps, "max_norm": self._clip_max_norm}}

    def _is_global_norm(self, grads: list, norm_type: float) -> bool:
        """The norm this collector records: the 2-norm over the model's own, unscaled gradients."""
        if norm_type != 2.0 or not grads or any(self._still_scaled()):
            return False
        params = self.params
        if len(grads) == len(params) and grads[0] is params[0].grad and grads[-1] is params[-1].grad:
            return True  # model.parameters() as most loops pass it: the same gradients, in the same order
        own = {id(param.grad) for param in params if param.grad is not None}
        return len(grads) == len(own) and all(id(grad) in own for grad in grads)

    def _notify(self) -> None:
        with own_work():  # a CPU norm's host read is gpuprof's, not one the loop makes
            self._total = read_if_host(self._total)
            for listener in self._before_update:
                listener(self._total)

    def on_step_end(self, prof, state) -> dict:
        fields = {"micro_batches": self._passes or None}
        compiled_clip = clipping.compiled_clip_ran()
        self._clipped_steps += self._clipped or compiled_clip
        if compiled_clip and not self._clips_compiled:
            self._clips_compiled = True  # from the next step on, the norm is taken before that clip
            self._total = self._param_norms = None  # this step's was taken after it: not the norm before clipping
        else:
            self._ranks_safe(self._take_norm)(False)  # no clip or optimizer hook saw this step's gradients
        self._ranks_safe(self._measure_update)()
        if self._reduction is not None:  # how many ranks' parts were unknown: read with the record, no sync
            fields["_grad_nonfinite_origin"], fields["_grad_unknown_ranks"] = self._reduce_over_ranks(prof.device)
            self._total = torch.linalg.vector_norm(self._param_norms) if self._param_norms is not None else None
        state.stepped_nonfinite_grads = self._stepped_nonfinite
        if self._total is not None:
            state.grad_norm = fields["grad_norm"] = read_if_host(self._total)
            if self._layer_step and self._param_norms is not None:
                fields["_param_grad_norms"] = self._param_norms
        if self._update_norms is not None:
            fields["_param_delta_norms"], fields["_param_weight_norms"] = self._update_norms
        return fields

    def on_step_record(self, prof, record: dict) -> None:
        if record.get("_grad_unknown_ranks"):  # a rank's part is missing: these would be partial norms
            for key in ("grad_norm", "_param_grad_norms", "_param_delta_norms", "_param_weight_norms"):
                record.pop(key, None)
        if "grad_norm" in record:
            record["grad_norm_finite"] = all_finite(record["grad_norm"])
        self._note_nonfinite_origin(record)
        grad_norms = record.get("_param_grad_norms")
        delta, weight = record.get("_param_delta_norms"), record.get("_param_weight_norms")
        if grad_norms is None and delta is None:
            return
        rows = []
        for layer, level, indices in self._layers():
            rows.append({
                "step": record["step"], "rank": record["rank"], "layer": layer, "level": level,
                "grad_norm": combined_norm(grad_norms, indices) if grad_norms is not None else None,
                "update_ratio": _ratio(delta, weight, indices) if delta is not None else None,
            })
        prof.writer.write("layers", rows)

    def nonfinite_origin(self, step: int) -> tuple[int, str] | None:
        """Sharded models: (rank, parameter) of the first non-finite gradient shard at `step`, if any."""
        return self._nonfinite_origins.get(step)

    # -- internals
    def _reduce_over_ranks(self, device: torch.device) -> torch.Tensor:
        """Local shard norms -> global norms, on every rank every step, whatever this rank computed:
        no gradient counts as zero (as in clip_grad_norm_), an update not seen as unknown (NaN), and
        nothing at all once a rank's part is unknown."""
        reduction = self._reduction
        known = self._failed is None
        grad_norms, update_norms = (self._param_norms, self._update_norms) if known else (None, None)
        vectors = [grad_norms if grad_norms is not None else reduction.missing(0.0)]
        if self._ratio_step:
            vectors += list(update_norms or (reduction.missing(float("nan")),) * 2)
        self._joined = True
        (grads, *updates), origin, unknown_ranks = reduction.norms(vectors, device, known)
        self._param_norms = grads if grad_norms is not None else None
        self._update_norms = tuple(updates) if update_norms is not None else None
        return origin, unknown_ranks

    def _ranks_safe(self, function):
        """On a sharded model, `function` made unable to switch this collector off (see the module's doc)."""
        if self._reduction is None:
            return function

        def safe(*args):
            if self._failed is not None:
                return None
            try:
                return function(*args)
            except Exception as error:  # noqa: BLE001 - the other ranks must not wait for this one
                self._failed = repr(error)
                self._prof.event(EventKind.COLLECTOR_DISABLED, f"gradient norms stopped on this rank after "
                                 f"{function.__name__} raised {error!r}; it keeps joining the per-step all-reduce",
                                 severity="warning", step=self._step, collector=self.name, hook=function.__name__,
                                 error=repr(error))
                return None

        return safe

    def _note_nonfinite_origin(self, record: dict) -> None:
        found = ShardReduction.first_origin(record.get("_grad_nonfinite_origin") or [])
        if found is not None and len(self._nonfinite_origins) < _MAX_ORIGINS:
            rank, index = found
            self._nonfinite_origins[record["step"]] = (rank, self.names[index])

    def _layers(self):
        for block, indices in self.blocks.items():
            yield block, "block", indices
        for index, name in enumerate(self.names):
            yield name, "param", [index]

    def _still_scaled(self) -> list[bool]:
        """Per optimizer given (one when none was), whether the GradScaler's scale still multiplies its
        gradients (not unscaled yet); [] without an enabled GradScaler."""
        scaler = self._scaler
        if scaler is None or getattr(scaler, "_scale", None) is None:
            return []
        stages = [scaler._per_optimizer_states.get(id(member)) for member in members(self._optimizer)] or [None]
        return [stage is None or stage["stage"] is not OptState.UNSCALED for stage in stages]

    def _unscaled(self, norms: torch.Tensor) -> torch.Tensor:
        """Per-parameter norms with the scale divided out where it still applies. Several optimizers pass
        `scaler.step()` one at a time: while some are unscaled, only the others' parameters are divided."""
        scaled = self._still_scaled()
        if not any(scaled):
            return norms
        scale = self._scaler._scale.to(norms.device)
        if all(scaled):
            return norms / scale
        return torch.stack([norm / scale if scaled[member] else norm
                            for norm, member in zip(norms.unbind(), self._member_of)])

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        self._in_update = True
        self._take_norm(True)
        if self._clipped and self._several and self._scaler is not None:
            self._check_stepping_member(optimizer)
        if self._ratio_step and self._weights_before is None:  # the step's first update
            with torch.no_grad():
                self._weights_before = foreach_mul([local_tensor(p.detach()) for p in self.params], 1.0)

    def _check_stepping_member(self, optimizer) -> None:
        """A GradScaler skips only the optimizers whose gradients it found non-finite when unscaling, and
        the others step. A clip over every optimizer's parameters after unscaling them all (the recipe for
        several optimizers) spreads a non-finite total norm into the others' gradients, and their update then
        writes non-finite weights: that step is the first bad one, not the next. Checked where this member
        steps after `scaler.step()` read its found-inf flags on the host (a sync the loop makes, so the
        clip's norm is ready), and the member's gradients only when that norm is not finite."""
        if not self._scaler._per_optimizer_states.get(id(optimizer), {}).get("found_inf_per_device"):
            return  # not stepped through scaler.step(): it may not have synced
        with own_work():
            if self._total is None or math.isfinite(float(self._total)):
                return
            norms = tensor_norms([param.grad for param in params_of(optimizer)])
            if not math.isfinite(float(norms.sum())):
                self._stepped_nonfinite = True

    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:
        self._in_update = False

    def _measure_update(self) -> None:
        """At the step's end, when every optimizer given has stepped: ‖Δw‖ and ‖w‖ per parameter."""
        if self._weights_before is None:
            return
        with torch.no_grad():
            weights = [local_tensor(p.detach()) for p in self.params]
            deltas = foreach_sub(weights, self._weights_before)
            self._weights_before = None
            self._update_norms = (tensor_norms(deltas), tensor_norms(weights))


def _member_of(params: list[torch.Tensor], optimizer) -> list[int]:
    """For each parameter, which of the given optimizers updates it (0 when none does)."""
    owner = {id(param): index for index, member in enumerate(members(optimizer)) for param in params_of(member)}
    return [owner.get(id(param), 0) for param in params]


def _ratio(delta: list[float], weight: list[float], indices: list[int]) -> float | None:
    weight_norm = combined_norm(weight, indices)
    return combined_norm(delta, indices) / weight_norm if weight_norm > 0 else None

