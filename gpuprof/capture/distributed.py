"""Distributed facts, DistributedDataParallel's own communication timing, and sharded models.

DDP measures, on a sample of iterations (the first ten, then every hundredth), the
backward compute time, the gradient all-reduce time and their overlap. These averages
are read from DDP's logging data (host-side, no sync) and added to the step record.

Under FSDP2 parameters, gradients and optimizer state are DTensors and each rank holds a
shard: collectors read the local shard (`local_tensor`) and `ShardReduction` sums what
they measure over the ranks, on the device.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch

from gpuprof.modules import initialized, local_tensor

# The collectives a loop calls itself, looked up on torch.distributed at each call (Accelerate's gather, broadcast
# and reduce do): wrapped there, each call is an arrival of the step.
LOOP_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
                    "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather",
                    "gather_object", "scatter", "all_to_all", "all_to_all_single", "barrier")
MAX_ARRIVALS = 8

_DDP_TIMES_NS = {
    "avg_forward_compute_time": "ddp_forward_time_s",
    "avg_backward_compute_time": "ddp_backward_compute_time_s",
    "avg_backward_comm_time": "ddp_backward_comm_time_s",
    "avg_backward_compute_comm_overlap_time": "ddp_comm_overlap_time_s",
}


def distributed_facts() -> dict:
    if not initialized():
        return {}
    return {"backend": str(torch.distributed.get_backend()), "world_size": torch.distributed.get_world_size()}


class ShardReduction:
    """Per-parameter squared norms summed over the ranks: one all-reduce per step, no host sync.

    Every rank calls `norms` once per step with the same number of vectors, whatever it
    computed (the caller fills in what it lacks), so the collectives of the ranks always match.
    Alongside, each rank sends the index of its first parameter whose local values are not
    finite, so that every rank learns where a non-finite value first appeared.
    """

    def __init__(self, n_params: int):
        self.n_params = n_params
        self.rank, self.world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        nccl = "nccl" in str(torch.distributed.get_backend())
        self._device = torch.device("cuda", torch.cuda.current_device()) if nccl else None

    def norms(self, local: list[torch.Tensor], device: torch.device,
              known: bool = True) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """Global 2-norms of each per-parameter vector in `local`; the non-finite origin: per rank,
        1 + the index of its first non-finite entry of `local[0]`, or 0; and how many ranks sent
        vectors they did not know (`known=False`: their part, hence the global norms, is missing)."""
        device = self._device or device
        vectors = [vector.to(device=device, dtype=torch.float32) for vector in local]
        origin = torch.zeros(self.world_size + 1, device=device)
        bad = ~torch.isfinite(vectors[0])
        origin[self.rank] = torch.where(bad.any(), bad.int().argmax() + 1, 0).float()
        origin[-1] = 0.0 if known else 1.0
        packed = torch.cat([vector.square() for vector in vectors] + [origin])
        torch.distributed.all_reduce(packed)
        *squares, origin = packed.split([self.n_params] * len(vectors) + [self.world_size + 1])
        return [square.sqrt() for square in squares], origin[:-1], origin[-1]

    def missing(self, value: float) -> torch.Tensor:
        """What a rank sends for a vector it did not compute this step."""
        return torch.full((self.n_params,), value, device=self._device)

    @staticmethod
    def first_origin(origin: list[float]) -> tuple[int, int] | None:
        """(rank, parameter index) of the first non-finite value, from `norms`' origin on the host."""
        for rank, value in enumerate(origin):
            if value and value == value:  # NaN only if a rank sent garbage
                return rank, int(value) - 1
        return None


def _bytes(tensors, local: bool) -> int:
    return sum((local_tensor(t) if local else t).numel() * t.element_size() for t in tensors)


def _reshards_after_forward(units: list[torch.nn.Module]) -> bool | None:
    """FSDP2's reshard_after_forward of the units below the root, read from their parameter groups."""
    values = set()
    for unit in units:
        try:
            group = unit._get_fsdp_state()._fsdp_param_group
        except (AttributeError, AssertionError):
            return None  # another FSDP version: the rule then does without the fact
        if group is not None:
            values.add(group.post_forward_mesh_info is not None)
    return values.pop() if len(values) == 1 else None


class FsdpCollector:
    """A sharded model's facts: its state in bytes, whole and on this rank (from shapes: no sync)."""

    name = "fsdp"

    def __init__(self, model: torch.nn.Module, optimizer=None):
        self._model, self._optimizer = model, optimizer
        units = [module for module in model.modules() if type(module).__name__.startswith("FSDP")]
        self._sharding = {"parallel": "fsdp", "fsdp_units": len(units),
                          "reshard_after_forward": _reshards_after_forward(units[:-1] or units)}

    def meta(self, prof) -> dict:
        return {"distributed": {**distributed_facts(), "sharding": self._sharding}}

    def on_step_end(self, prof, state) -> dict:
        if "model_state_bytes" not in self._sharding:  # after the first update: optimizer state exists
            self._sharding.update(self._state_bytes())
            prof.rewrite_meta()
        return {}

    def _state_bytes(self) -> dict:
        params = [p for p in self._model.parameters() if p.requires_grad]
        optimizer_state = [value for entries in (self._optimizer.state.values() if self._optimizer else ())
                           for value in entries.values() if isinstance(value, torch.Tensor)]
        facts = {}
        for suffix, local in (("", False), ("_per_rank", True)):
            param_bytes = _bytes(params, local)
            facts[f"param_bytes{suffix}"] = param_bytes
            facts[f"optimizer_state_bytes{suffix}"] = _bytes(optimizer_state, local)
            # gradients: one per parameter, in the parameter's dtype
            facts[f"model_state_bytes{suffix}"] = 2 * param_bytes + facts[f"optimizer_state_bytes{suffix}"]
        return facts


class DdpCollector:
    """DDP's timing averages per step, and each step's arrivals at its collectives.

    The arrivals (`collective_arrivals_unix_s`: the first MAX_ARRIVALS of the step, in order) are the wall
    clock each time the step calls a collective on the host: a `torch.distributed` collective of the loop's
    own (a loss all-reduced for logging, `accelerator.gather` before the forward; wrapped while the run
    records), and DDP handing its first gradient bucket to the communication hook gpuprof registers: the
    same all-reduce DDP makes without one (each gradient scaled by 1/world size the way DDP's own reducer
    does it, so the numbers do not change). Timestamps on the host, no sync. Every rank makes the same
    collectives in the same order, so at each the rank arriving last is the one the others wait for there.
    A loop that registered its own comm hook keeps it, and records arrivals only at its own collectives."""

    name = "ddp"

    def __init__(self, model: torch.nn.parallel.DistributedDataParallel):
        self._model = model
        self.arrivals_unix_s: list[float] = []  # this step's
        self._hooked = False
        self._bucket_arrived = False
        self._wrapped: dict[str, Any] = {}
        self._prof = None

    @property
    def arrival_unix_s(self) -> float | None:
        """When this step first reached a collective, read by the hang watchdog."""
        return self.arrivals_unix_s[0] if self.arrivals_unix_s else None

    def on_start(self, prof) -> None:
        self._prof = prof
        if not getattr(self._model, "_comm_hooks", None):
            self._model.register_comm_hook(self._model.process_group, self._all_reduce)
            self._hooked = True
        for name in LOOP_COLLECTIVES:
            original = getattr(torch.distributed, name, None)
            if original is not None:
                self._wrapped[name] = original
                setattr(torch.distributed, name, self._arriving(original))

    def on_close(self, prof) -> None:
        for name, original in self._wrapped.items():
            setattr(torch.distributed, name, original)
        self._wrapped.clear()

    def _arriving(self, collective):
        @functools.wraps(collective)
        def arriving(*args, **kwargs):
            # traced by torch.compile, only the collective: dynamo maps it to its functional collective
            if not torch.compiler.is_compiling() and not self._prof.bookkeeping:
                self._arrive()
            return collective(*args, **kwargs)

        return arriving

    def _arrive(self) -> None:
        if len(self.arrivals_unix_s) < MAX_ARRIVALS:
            self.arrivals_unix_s.append(time.time())

    def meta(self, prof) -> dict:
        return {"distributed": {**distributed_facts(), "arrivals": self._hooked}}

    def on_step_end(self, prof, state) -> dict:
        logging_data = self._model._get_ddp_logging_data()
        columns = {column: logging_data[key] / 1e9 if logging_data.get(key) else None
                   for key, column in _DDP_TIMES_NS.items()}
        columns["collective_arrivals_unix_s"], self.arrivals_unix_s = self.arrivals_unix_s or None, []
        self._bucket_arrived = False
        return columns

    def _all_reduce(self, group, bucket):  # no annotations: DDP rejects postponed ones
        if not self._bucket_arrived:  # DDP's first bucket of the step; its all_reduce below is no arrival of the loop's
            self._bucket_arrived = True
            self._arrive()
        buffer = bucket.buffer()
        world_size = group.size()
        # as DDP's reducer without a hook: it divides gradients that are bucket views, multiplies copies
        if self._model.gradient_as_bucket_view:
            buffer.div_(world_size)
        else:
            buffer.mul_(1.0 / world_size)
        work = self._wrapped.get("all_reduce", torch.distributed.all_reduce)(buffer, group=group, async_op=True)
        return work.get_future().then(lambda future: future.value()[0])
