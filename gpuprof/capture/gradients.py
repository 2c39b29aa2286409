"""Gradient norms (before clipping) and update-to-weight ratios, computed on the device.

At the end of every backward pass the per-parameter gradient norms are computed in one
fused pass (`torch._foreach_norm`) and divided by the GradScaler's scale when one is in
use, so they are the unscaled norms `clip_grad_norm_` would see. The global norm is
their 2-norm, exactly as `clip_grad_norm_` computes it. The last backward pass of a step
wins (under gradient accumulation that is the accumulated gradient).

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
copy of the weights taken just before `optimizer.step()` and dropped right after it.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from gpuprof.capture.distributed import ShardReduction
from gpuprof.capture.lazy import all_finite
from gpuprof.blocks import block_groups, combined_norm
from gpuprof.modules import is_sharded, local_tensor
from gpuprof.run.schema import EventKind

_MAX_ORIGINS = 16  # bad steps whose origin is kept for the numerics report (the first ones)


def tensor_norms(tensors: list[torch.Tensor | None], same_kind: bool = False) -> torch.Tensor:
    """The 2-norm of each tensor (0 for None) as one float32 vector on the first tensor's device.
    same_kind: the caller knows that every tensor has one device and dtype (a check less per step)."""
    present = [t for t in tensors if t is not None]
    if not present:
        return torch.zeros(len(tensors))
    if same_kind and len(present) == len(tensors):
        return torch.stack(torch._foreach_norm(present)).float()
    device = present[0].device
    by_group: dict[tuple, list[int]] = defaultdict(list)
    for index, tensor in enumerate(tensors):
        if tensor is not None:
            by_group[(tensor.device, tensor.dtype)].append(index)
    if len(by_group) == 1 and len(present) == len(tensors):
        return torch.stack(torch._foreach_norm(present)).float()
    # assembled by stacking, not `norms[indices] = ...`: a list index is copied to the device
    # with a blocking copy, a host-device sync on every backward pass
    parts = [torch.zeros((), dtype=torch.float32, device=device)] * len(tensors)
    for indices in by_group.values():
        group_norms = torch.stack(torch._foreach_norm([tensors[i] for i in indices])).to(device).float()
        for index, norm in zip(indices, group_norms.unbind()):
            parts[index] = norm
    return torch.stack(parts)


class GradientCollector:
    name = "gradients"

    def __init__(self, model: torch.nn.Module, optimizer, scaler, layer_interval: int, update_ratio_interval: int):
        named = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
        self.names = [name for name, _ in named]
        self.params = [param for _, param in named]
        self._same_kind = len({(param.device, param.dtype) for param in self.params}) == 1  # so are their grads
        self.blocks = block_groups(self.names)
        self._scaler = scaler
        self._optimizer = optimizer
        self._layer_interval = layer_interval
        self._ratio_interval = update_ratio_interval if optimizer is not None else 0
        self._grad_norms: torch.Tensor | None = None
        self._passes = 0
        self._weights_before: list[torch.Tensor] | None = None
        self._update_norms: tuple[torch.Tensor, torch.Tensor] | None = None
        self._ratio_step = False
        self._handles: list = []
        self._reduction = ShardReduction(len(self.params)) if is_sharded(model) and self.params else None
        self.has_step_collectives = self._reduction is not None  # see join_step_collectives
        self._nonfinite_origins: dict[int, tuple[int, str]] = {}
        self._step = 0
        self._joined = False  # sharded: whether this step's all-reduce was made
        self._failed: str | None = None  # sharded: why this rank stopped computing norms

    # -- hooks
    def on_start(self, prof) -> None:
        self._prof = prof
        if self._ratio_interval:
            guard = prof.collectors.guard
            before, after = self._ranks_safe(self._before_optimizer_step), self._ranks_safe(self._after_optimizer_step)
            self._handles = [self._optimizer.register_step_pre_hook(guard(self, "optimizer_pre_hook", before)),
                             self._optimizer.register_step_post_hook(guard(self, "optimizer_post_hook", after))]

    def on_close(self, prof) -> None:
        for handle in self._handles:
            handle.remove()

    @property
    def latest_norms(self) -> torch.Tensor | None:
        """Per-parameter gradient norms (unscaled) of the latest backward pass, on the device."""
        return self._grad_norms

    def on_step_start(self, prof, step: int) -> None:
        self._grad_norms, self._passes, self._update_norms, self._joined = None, 0, None, False
        self._step = step
        self._ratio_step = bool(self._ratio_interval) and step % self._ratio_interval == 0

    def on_after_backward(self, prof, step: int) -> None:
        self._passes += 1
        self._ranks_safe(self._compute_norms)()

    def join_step_collectives(self, prof) -> None:
        """Once per step after this collector (or the whole Profiler) switched off on this rank: the
        step's all-reduce if it was not made yet, with this rank's part unknown."""
        self._failed = self._failed or "capture switched off on this rank"
        if not self._joined:
            self._reduce_over_ranks(prof.device)
        self.on_step_start(prof, self._step + 1)

    def _compute_norms(self) -> None:
        grads = [param.grad for param in self.params]
        if self._reduction is not None:  # DTensors only exist on a sharded model
            grads = [local_tensor(grad) for grad in grads]
        norms = tensor_norms(grads, same_kind=self._same_kind)
        scale = self._scaler_scale()
        self._grad_norms = norms / scale.to(norms.device) if scale is not None else norms

    def on_step_end(self, prof, state) -> dict:
        fields = {"micro_batches": self._passes or None}
        if self._reduction is not None:  # how many ranks' parts were unknown: read with the record, no sync
            fields["_grad_nonfinite_origin"], fields["_grad_unknown_ranks"] = self._reduce_over_ranks(prof.device)
        if self._grad_norms is not None:
            total = torch.linalg.vector_norm(self._grad_norms)
            state.grad_norm = total
            fields["grad_norm"] = total
            if self._layer_interval and state.step % self._layer_interval == 0:
                fields["_param_grad_norms"] = self._grad_norms
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
        grad_norms, update_norms = (self._grad_norms, self._update_norms) if known else (None, None)
        vectors = [grad_norms if grad_norms is not None else reduction.missing(0.0)]
        if self._ratio_step:
            vectors += list(update_norms or (reduction.missing(float("nan")),) * 2)
        self._joined = True
        (grads, *updates), origin, unknown_ranks = reduction.norms(vectors, device, known)
        self._grad_norms = grads if grad_norms is not None else None
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

    def _scaler_scale(self) -> torch.Tensor | None:
        scaler = self._scaler
        if scaler is None or not scaler.is_enabled() or getattr(scaler, "_scale", None) is None:
            return None
        return scaler._scale

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        if self._ratio_step:
            with torch.no_grad():
                self._weights_before = torch._foreach_mul([local_tensor(p.detach()) for p in self.params], 1.0)

    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:
        if self._weights_before is None:
            return
        with torch.no_grad():
            weights = [local_tensor(p.detach()) for p in self.params]
            deltas = torch._foreach_sub(weights, self._weights_before)
            self._weights_before = None
            self._update_norms = (tensor_norms(deltas), tensor_norms(weights))


def _ratio(delta: list[float], weight: list[float], indices: list[int]) -> float | None:
    weight_norm = combined_norm(weight, indices)
    return combined_norm(delta, indices) / weight_norm if weight_norm > 0 else None
