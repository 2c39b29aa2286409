"""Sharded models under FSDP2: their state in bytes, and norms summed over the ranks.

Parameters, gradients and optimizer state are DTensors and each rank holds a shard: collectors read the
local shard (`local_tensor`) and `ShardReduction` sums what they measure over the ranks, on the device.
"""

from __future__ import annotations

import torch

from gpuprof.modules import distributed_facts, local_tensor


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
