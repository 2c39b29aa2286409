"""The state a training step starts from, kept so that the first non-finite step can be re-run.

What is kept, and why it costs what it costs:
- Parameters, buffers, optimizer state and the GradScaler's scale: one copy on their own
  device, refreshed at the start of every step (first forward of the step). Optimizers
  update all of these in place, so a reference would be overwritten by the very step we
  want to re-run; a copy is the only exact answer. The copy is written as
  `where(frozen, copy, live)` over one flat buffer per dtype, where `frozen` is a device
  flag that the always-on check sets when a step goes non-finite. The host learns about
  it later (no synchronization), but the device stops refreshing the copy at once, so the
  copy still holds the state before the first bad step when the host gets to it.
  Cost: one extra copy of model + optimizer state in memory, plus a concatenation of the
  state every step (memory bandwidth; see docs/numerics.md for measured overhead).
- RNG states, learning-rate and other hyperparameters, tensors on another device than the
  state (e.g. Adam's CPU step counters) and the batch: small, kept per step on the host,
  by reference for the batch (it is not mutated by training), until the step's flags are read.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from gpuprof.modules import local_tensor, named_parameters
from gpuprof.torch_compat import foreach_copy_

OPTIMIZER_KEY_SEPARATOR = "::"
SCALER_PREFIX = "scaler" + OPTIMIZER_KEY_SEPARATOR


def param_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in named_parameters(model)}


def live_tensors(model: torch.nn.Module, optimizer=None, scaler=None) -> dict[str, torch.Tensor]:
    """Every tensor training mutates, by a stable name: `w`, `w::exp_avg`, `scaler::scale`.
    Of a sharded (DTensor) one, this rank's shard."""
    named = list(named_parameters(model))
    tensors = {name: local_tensor(t.detach()) for name, t in named}
    tensors.update({name: local_tensor(t) for name, t in model.named_buffers()})
    if optimizer is not None:
        names = {id(p): name for name, p in named}
        for param, entries in optimizer.state.items():
            for key, value in entries.items():
                if isinstance(value, torch.Tensor) and id(param) in names:
                    tensors[f"{names[id(param)]}{OPTIMIZER_KEY_SEPARATOR}{key}"] = local_tensor(value)
    if scaler is not None and getattr(scaler, "_scale", None) is not None:
        tensors[SCALER_PREFIX + "scale"] = scaler._scale
        tensors[SCALER_PREFIX + "growth_tracker"] = scaler._growth_tracker
    return tensors


def owning_module(name: str) -> str | None:
    """`transformer.h.1.attn.c_attn.weight::exp_avg` -> `transformer.h.1.attn.c_attn`."""
    if name.startswith(SCALER_PREFIX):
        return None
    tensor_name = name.split(OPTIMIZER_KEY_SEPARATOR)[0]
    return tensor_name.rsplit(".", 1)[0] if "." in tensor_name else None


def non_tensor_optimizer_state(model, optimizer, names: dict[int, str] | None = None) -> dict[str, Any]:
    """`names`: param_names(model), when the caller keeps it (it runs every step)."""
    if optimizer is None:
        return {}
    names = names if names is not None else param_names(model)
    return {
        f"{names[id(param)]}{OPTIMIZER_KEY_SEPARATOR}{key}": _snapshot(value)
        for param, entries in optimizer.state.items() if id(param) in names
        for key, value in entries.items() if not isinstance(value, torch.Tensor)
    }


def hyperparameters(optimizer) -> list[dict[str, Any]]:
    """Each param group's settings (lr, betas, ...), without the parameters."""
    if optimizer is None:
        return []
    return [{k: v if type(v) in _IMMUTABLE else _snapshot(v) for k, v in group.items() if k != "params"}
            for group in optimizer.param_groups]  # the test inline: it runs for every setting every step


_IMMUTABLE = (int, float, bool, str, type(None))


def _snapshot(value: Any) -> Any:
    """A copy that later in-place changes cannot reach (immutable values as they are: this runs every step)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if type(value) in _IMMUTABLE or (type(value) is tuple and all(type(item) in _IMMUTABLE for item in value)):
        return value
    return copy.deepcopy(value)


def rng_states() -> dict[str, Any]:
    """CPU and current-CUDA-device generator states (host-side values: no device sync)."""
    cuda = [torch.cuda.get_rng_state()] if torch.cuda.is_initialized() else []
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["cpu"])
    if states.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"][0])


@dataclass
class StepInputs:
    """What the host keeps for one step until its flags are read (small; the batch by reference)."""

    step: int
    rng: dict[str, Any]
    hyper: list[dict[str, Any]]
    other_device: dict[str, torch.Tensor]
    non_tensor: dict[str, Any]
    training: bool
    autocast: dict[str, Any] | None = None
    tape: Any = None  # tape.StepTape: the step's forward calls and loss program
    batch: Any = None
    param_absmax: torch.Tensor | None = None  # largest |weight| at the start of the step (device)
    param_absmax_after: torch.Tensor | None = None  # the same right after the step's update (none without one)
    state_kept: bool = False  # lazy keeping (CPU): whether this step's state was copied
    updated_first: bool = False  # lazy keeping: an update with finite gradients ran before the copy


class _FlatCopy:
    """A copy of same-dtype tensors in one flat buffer; the first `n_params` tensors are parameters."""

    def __init__(self, names: list[str], tensors: list[torch.Tensor], n_params: int):
        self.names = names
        self.shapes = [t.shape for t in tensors]
        self.numels = [t.numel() for t in tensors]
        self.param_elements = sum(self.numels[:n_params])
        self.buffer = torch.empty(sum(self.numels), dtype=tensors[0].dtype, device=tensors[0].device)
        self._views = list(self.views().values())

    def refresh(self, tensors: list[torch.Tensor], keep: torch.Tensor | None) -> None:
        if keep is None:
            foreach_copy_(self._views, [t.detach() for t in tensors])
        else:
            flat = torch.cat([t.detach().reshape(-1) for t in tensors])
            torch.where(keep, self.buffer, flat, out=self.buffer)

    def param_absmax(self) -> torch.Tensor | None:
        if not self.param_elements or not self.buffer.is_floating_point():
            return None
        low, high = torch.aminmax(self.buffer[: self.param_elements])  # one pass; NaN propagates
        return torch.maximum(-low, high).float()

    def views(self) -> dict[str, torch.Tensor]:
        parts = torch.split(self.buffer, self.numels)
        return {name: part.view(shape) for name, part, shape in zip(self.names, parts, self.shapes)}


class _Generation:
    """Copies of one set of tensor names (the set grows once, when optimizer state appears)."""

    def __init__(self, layout: tuple, tensors: dict[str, torch.Tensor], params: set[str], device: torch.device,
                 first_step: int):
        self.layout = layout
        self.first_step = first_step
        self.step = torch.full((), -1, dtype=torch.int64, device=device)  # the step the copy holds
        groups: dict[torch.dtype, list[str]] = {}
        for name in sorted(tensors, key=lambda n: n not in params):  # parameters first, for param_absmax
            groups.setdefault(tensors[name].dtype, []).append(name)
        self.copies = [_FlatCopy(names, [tensors[n] for n in names], sum(n in params for n in names))
                       for names in groups.values()]

    def refresh(self, tensors: dict[str, torch.Tensor], keep: torch.Tensor | None, step: int) -> None:
        for flat in self.copies:
            flat.refresh([tensors[n] for n in flat.names], keep)
        if keep is None:
            self.step.fill_(step)
        else:
            torch.where(keep, self.step, torch.full_like(self.step, step), out=self.step)

    def param_absmax(self) -> torch.Tensor | None:
        values = [v for v in (flat.param_absmax() for flat in self.copies) if v is not None]
        return torch.stack(values).max() if values else None

    def views(self) -> dict[str, torch.Tensor]:
        views = {}
        for flat in self.copies:
            views.update(flat.views())
        return views


class StateKeeper:
    """Keeps the pre-step state of the current step, and of the first non-finite step once frozen."""

    def __init__(self, device: torch.device):
        self.device = device
        self.frozen = torch.zeros((), dtype=torch.bool, device=device)
        self._generations: list[_Generation] = []

    def refresh(self, tensors: dict[str, torch.Tensor], params: set[str], step: int,
                unread_steps: bool) -> dict[str, torch.Tensor]:
        """Copies the tensors on the keeper's device; returns the others (kept per step by the caller).

        With `unread_steps` (flags of earlier steps not read yet, the usual case on CUDA) the
        copy goes through the device-side `frozen` flag; otherwise the host knows nothing is
        frozen and a plain copy (no concatenation, half the memory traffic) does.
        """
        here = {n: t for n, t in tensors.items() if t.device == self.device}
        layout = tuple((n, t.dtype, tuple(t.shape)) for n, t in here.items())
        if not self._generations or self._generations[-1].layout != layout:
            self._generations.append(_Generation(layout, here, params, self.device, step))
        if here:
            self._generations[-1].refresh(here, self.frozen if unread_steps else None, step)
        return {n: t.detach().clone() for n, t in tensors.items() if t.device != self.device}

    def param_absmax(self) -> torch.Tensor | None:
        """The largest |parameter| in the latest copy (a device scalar), or None."""
        return self._generations[-1].param_absmax() if self._generations else None

    def freeze_if(self, bad: torch.Tensor) -> None:
        torch.logical_or(self.frozen, bad.to(self.device), out=self.frozen)

    def release(self, resolved_step: int) -> None:
        """The host has read every step up to `resolved_step`: older generations are not needed."""
        while len(self._generations) > 1 and self._generations[1].first_step <= resolved_step:
            self._generations.pop(0)

    def current_views(self) -> dict[str, torch.Tensor]:
        """The latest copy: the state the current step started from, unless frozen."""
        return self._generations[-1].views() if self._generations else {}

    def unfreeze(self) -> None:
        self.frozen.zero_()

    def state_before(self, step: int) -> dict[str, torch.Tensor] | None:
        """The kept copy of the state `step` started from (host sync: forensics only)."""
        for generation in self._generations:
            if int(generation.step) == step:
                return generation.views()
        return None
