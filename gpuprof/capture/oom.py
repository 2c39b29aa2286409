"""CUDA memory snapshots: on out-of-memory (with an event, then the error goes on up), and on
demand with `prof.memory_snapshot()`.

The snapshot (`torch.cuda.memory._snapshot()`, viewable at pytorch.org/memory_viz and on the
dashboard's Memory page) holds the allocator's segments; with `memory_history=True` also the
stack of every live allocation and the allocator's recent actions, at a cost on every
allocation, so it is off by default.
"""

from __future__ import annotations

import functools
import logging
import pickle
from pathlib import Path

import torch

from gpuprof.run.schema import EventKind
from gpuprof.torch_compat import private

logger = logging.getLogger("gpuprof")


def write_snapshot(prof) -> Path:
    """The allocator's state now, pickled to this rank's snapshot file for the current step."""
    path = prof.writer.snapshot_path(prof.step_index)
    with open(path, "wb") as handle:
        pickle.dump(private("torch.cuda.memory._snapshot", _no_snapshot)(), handle)
    return path


def memory_snapshot(prof) -> Path | None:
    """`prof.memory_snapshot()`: the snapshot's path, or None where none could be taken (said once)."""
    if prof.device.type != "cuda":
        _say_once("gpuprof: memory_snapshot() records nothing: no CUDA device in this run")
        return None
    if prof.writer is None:
        _say_once("gpuprof: memory_snapshot() records nothing before the profiler starts")
        return None
    try:
        return write_snapshot(prof)
    except Exception as error:  # noqa: BLE001 - a snapshot must never stop the loop
        _say_once(f"gpuprof: memory_snapshot() failed and records nothing: {error!r}")
        return None


def _no_snapshot() -> None:
    raise RuntimeError("this torch has no torch.cuda.memory._snapshot")


def _no_history(**_options) -> None:
    """A torch without allocation history: snapshots without it (logged once by private())."""


@functools.cache
def _say_once(message: str) -> None:
    logger.warning(message)


class OomCollector:
    name = "oom"

    def __init__(self, device: torch.device, memory_history: bool):
        self._device = device
        self._history = memory_history and device.type == "cuda"

    def on_start(self, prof) -> None:
        if self._history:
            private("torch.cuda.memory._record_memory_history", _no_history)(max_entries=100_000)

    def on_close(self, prof) -> None:
        if self._history:
            private("torch.cuda.memory._record_memory_history", _no_history)(enabled=None)

    def on_exception(self, prof, exc: BaseException) -> None:
        if not isinstance(exc, torch.OutOfMemoryError):
            return
        details = {"error": str(exc).splitlines()[0] if str(exc) else type(exc).__name__}
        if self._device.type == "cuda":
            path = write_snapshot(prof)
            details.update(
                snapshot=prof.writer.relative(path),
                mem_allocated_bytes=torch.cuda.memory_allocated(self._device),
                mem_reserved_bytes=torch.cuda.memory_reserved(self._device),
            )
        prof.event(EventKind.OOM, f"out of memory at step {prof.step_index}: {details['error']}", severity="critical",
                   step=prof.step_index, **details)
