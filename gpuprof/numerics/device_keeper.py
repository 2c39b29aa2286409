"""keep_state "when_bad" on a GPU: the state a bad step started from, copied by the device only when
the step's gradient norm (before the update) or its watched values (at its end) are not finite.

The host copies, per step, only what is small: the state's tensors on other devices (Adam's step
counters on the CPU, stacked into one tensor per dtype) and any that is not contiguous. It learns
later, from the step record, whether a copy was taken; one copy is held until the host has read
its step. The caller (keeping.py) hands over the set of tensors again when its cheap signature
changes (Adam's state appears after the first update) and every `state_interval` steps: a tensor
replaced in between is copied from its old storage until then. Where the buffers go (device or
pinned host memory, the whole state or the parameters alone) is the memory budget's (budget.py);
a host buffer is written by the same kernel, through its mapped address.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpuprof.numerics.budget import nbytes
from gpuprof.numerics.device_copy import ConditionalCopy, Flag


@dataclass
class _Generation:
    """Buffers for one set of tensors, from `first_step` on."""

    first_step: int
    views: dict[str, torch.Tensor]
    copy: ConditionalCopy
    where: str  # "device", "host" or "none" (the budget kept nothing, and state_before says so)


class ConditionalKeeper:
    """The buffers of the copy, the device flags that say which step it holds, and the per-step host copies."""

    def __init__(self, device: torch.device):
        self.device = device
        self._taken = Flag(device)
        self._step_taken = torch.full((), -1, dtype=torch.int64, device=device)
        self._at_end = torch.zeros((), dtype=torch.int32, device=device)
        self._generations: list[_Generation] = []
        self._layout: tuple | None = None
        self._per_step_groups: list[tuple[list[str], list[torch.Tensor]]] = []
        self._per_step_others: dict[str, torch.Tensor] = {}

    def warm_up(self) -> None:
        """One launch with finite values and nothing to copy: Triton compiles the kernel now, when the
        run opens, rather than inside the first step (and a kernel that cannot run fails here)."""
        ConditionalCopy([], [], self.device).copy_if(torch.zeros(1, device=self.device), Flag(self.device),
                                                     torch.zeros((), dtype=torch.int64, device=self.device), 0,
                                                     torch.zeros((), dtype=torch.int32, device=self.device), False)

    def prepare(self, tensors: dict[str, torch.Tensor], step: int, where: str = "device") -> None:
        """Makes buffers for `tensors` in `where` ("device", "host": pinned host memory, "none": keeps
        nothing) when they are not the ones prepared before."""
        layout = (where, *((name, t.data_ptr(), t.dtype, tuple(t.shape), t.device) for name, t in tensors.items()))
        if layout == self._layout:
            return
        self._layout = layout
        tensors = tensors if where != "none" else {}
        # byte copies need contiguous tensors on this device: any other is copied every step
        here = {name: t.detach() for name, t in tensors.items() if t.device == self.device and t.is_contiguous()}
        views = {name: _buffer_like(t, where) for name, t in here.items()}
        copy = ConditionalCopy(list(here.values()), list(views.values()), self.device)
        self._generations.append(_Generation(step, views, copy, where))
        self._group_per_step({name: t.detach() for name, t in tensors.items() if name not in here})

    def held_bytes(self) -> dict[str, int]:
        """Bytes the buffers of the latest generation hold, by where they are."""
        latest = self._generations[-1] if self._generations else None
        return {latest.where: nbytes(latest.views.values())} if latest else {}

    def _group_per_step(self, tensors: dict[str, torch.Tensor]) -> None:
        groups: dict[tuple, tuple[list[str], list[torch.Tensor]]] = {}
        self._per_step_others = {}
        for name, t in tensors.items():
            if t.dim() == 0:
                names, members = groups.setdefault((t.dtype, t.device), ([], []))
                names.append(name)
                members.append(t)
            else:
                self._per_step_others[name] = t
        self._per_step_groups = list(groups.values())

    def per_step_copies(self) -> dict[str, torch.Tensor]:
        """This step's copy of the tensors the device copy leaves out (mostly optimizers' step counters
        on the CPU): one op per dtype for the scalars."""
        copies = {name: t.clone() for name, t in self._per_step_others.items()}
        for names, members in self._per_step_groups:
            copies.update(zip(names, torch.stack(members).unbind()))
        return copies

    def take_if(self, values: torch.Tensor, step: int, end: bool) -> None:
        """On the device: the state copied now if `values` holds a non-finite value and no copy is held."""
        if self._generations:
            self._generations[-1].copy.copy_if(values, self._taken, self._step_taken, step, self._at_end, end)

    def release(self, resolved_step: int) -> None:
        """The host has read every step up to `resolved_step`: older generations are not needed."""
        while len(self._generations) > 1 and self._generations[1].first_step <= resolved_step:
            released = self._generations.pop(0)
            if any(view.is_pinned() for view in released.views.values()):
                torch.accelerator.empty_host_cache()  # pinned memory freed goes to a cache, not back to the host

    def unfreeze(self) -> None:
        """The held copy's step was read: the next bad step may be copied."""
        self._taken.clear()

    def state_before(self, step: int) -> dict[str, torch.Tensor] | None:
        """The copy taken at `step`, if that is the step it holds (host sync: forensics only)."""
        if not int(self._taken.current()) or int(self._step_taken) != step:
            return None
        generation = [g for g in self._generations if g.first_step <= step][-1]
        return dict(generation.views) if generation.where != "none" else None

    def taken_at_end(self) -> bool:
        """Whether the held copy was made at its step's end rather than before its update (host sync)."""
        return bool(int(self._at_end))


def _buffer_like(tensor: torch.Tensor, where: str) -> torch.Tensor:
    """An empty buffer for `tensor`'s bytes on its device, or in host memory (pinned where there is CUDA,
    so that the device kernel can write it)."""
    if where == "device" or tensor.device.type == "cpu":
        return torch.empty_like(tensor)
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
