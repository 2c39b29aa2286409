"""A copy of many tensors that the device makes only when one of a few device values is not finite.

NaN forensics needs the state a bad step started from, and on a GPU the host learns that a step
went bad only steps later (reading a flag at once would be a host-device sync). Copying the
whole state every step costs a read and a write of it per step: measured +6-7% a step for
GPT-2 124M on an H200 (benchmarks/results/). Here the decision is the device's: one Triton
kernel reads the watched values itself; while they are finite every program exits at once (no
memory traffic), and when one is not, the tensors are copied byte for byte and the copy is marked
taken (until the host has read that step). The pointer tables are made once per layout.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util

import torch

PROGRAMS_PER_TENSOR = 16  # each tensor's bytes, split between this many programs when copying
BLOCK_BYTES = 4096


def available(device: torch.device) -> bool:
    """Whether the copy can run on `device`: a CUDA device with Triton (bundled with PyTorch's CUDA builds)."""
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


class ConditionalCopy:
    """`sources[i]` copied into `destinations[i]` (contiguous, same size in bytes) by one kernel launch
    when the values it is given hold a non-finite value and no copy is held; see `copy_if`."""

    def __init__(self, sources: list[torch.Tensor], destinations: list[torch.Tensor], device: torch.device):
        self._sources = sources  # held: a table entry always points at memory that is still allocated
        self._destinations = destinations
        # one entry more, of no bytes: the program that marks the copy exists also with no tensors
        self._src = _pointers(sources, device)
        self._dst = _pointers(destinations, device)
        self._nbytes = torch.tensor([t.numel() * t.element_size() for t in sources] + [0], dtype=torch.int64,
                                    device=device)

    def copy_if(self, values: torch.Tensor, taken: "Flag", step_taken: torch.Tensor, step: int,
                at_end: torch.Tensor, end: bool) -> None:
        """Copies when `values` (a device vector) holds a non-finite value and `taken` is not set;
        then sets `taken`, `step_taken` to `step` and `at_end` to `end` (the copy was made at the step's end)."""
        kernel = _kernel()
        values = values.reshape(-1)
        taken_in, taken_out = taken.swap()
        with self._on_device():  # Triton launches on the current device, which the loop may not have set
            kernel[(len(self._sources) + 1, PROGRAMS_PER_TENSOR)](
                values, values.numel(), taken_in, taken_out, step_taken, at_end, step, int(end),
                self._src, self._dst, self._nbytes, BLOCK=BLOCK_BYTES, PROGRAMS=PROGRAMS_PER_TENSOR)

    def _on_device(self):
        device = self._nbytes.device
        return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class Flag:
    """A device flag kept in two buffers: a kernel reads one and writes the other, which the next
    launch reads (programs of one launch run in no set order)."""

    def __init__(self, device: torch.device):
        self._buffers = [torch.zeros((), dtype=torch.int32, device=device) for _ in range(2)]

    def swap(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the buffer to read, the buffer to write), and the written one is read next."""
        self._buffers.reverse()
        return self._buffers[1], self._buffers[0]

    def current(self) -> torch.Tensor:
        return self._buffers[0]

    def clear(self) -> None:
        for buffer in self._buffers:
            buffer.zero_()


def _pointers(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors] + [0], dtype=torch.int64, device=device)


@functools.cache
def _kernel():
    """Imported on first use: Triton loads and compiles only where a copy is made."""
    from gpuprof.numerics import device_copy_kernels

    return device_copy_kernels.copy_if_nonfinite
