"""Out-of-memory handling: a CUDA memory snapshot and an event, then the error goes on up.

The snapshot (`torch.cuda.memory._snapshot()`, viewable at pytorch.org/memory_viz) holds
the allocator's segments; with `memory_history=True` also the stack of every live
allocation, at a cost on every allocation, so it is off by default.
"""

from __future__ import annotations

import pickle

import torch


class OomCollector:
    name = "oom"

    def __init__(self, device: torch.device, memory_history: bool):
        self._device = device
        self._history = memory_history and device.type == "cuda"

    def on_start(self, prof) -> None:
        if self._history:
            torch.cuda.memory._record_memory_history(max_entries=100_000)

    def on_close(self, prof) -> None:
        if self._history:
            torch.cuda.memory._record_memory_history(enabled=None)

    def on_exception(self, prof, exc: BaseException) -> None:
        if not isinstance(exc, torch.OutOfMemoryError):
            return
        details = {"error": str(exc).splitlines()[0] if str(exc) else type(exc).__name__}
        if self._device.type == "cuda":
            path = prof.writer.snapshot_path(prof.step_index)
            with open(path, "wb") as handle:
                pickle.dump(torch.cuda.memory._snapshot(), handle)
            details.update(
                snapshot=prof.writer.relative(path),
                mem_allocated_bytes=torch.cuda.memory_allocated(self._device),
                mem_reserved_bytes=torch.cuda.memory_reserved(self._device),
            )
        prof.event("oom", f"out of memory at step {prof.step_index}: {details['error']}", severity="critical",
                   step=prof.step_index, **details)
