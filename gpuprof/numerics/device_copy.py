"""A copy of many tensors that the device makes only when one of a few device values is not finite.

NaN forensics needs the state a bad step started from, and on a GPU the host learns that a step
went bad only steps later (reading a flag at once would be a host-device sync). Copying the
whole state every step costs a read and a write of it per step: measured +6-7% a step for
GPT-2 124M on an H200 (benchmarks/results/). Here the decision is the device's: two Triton
kernels read the watched values themselves; while they are finite every program exits at once
(no memory traffic), and when one is not, the tensors are copied byte for byte and the copy is
marked taken (until the host has read that step). The pointer tables are made once per layout.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

PROGRAMS_PER_TENSOR = 16  # each tensor's bytes, split between this many programs when copying
BLOCK_BYTES = 4096


def available(device: torch.device) -> bool:
    """Whether the copy can run on `device`: a CUDA device with Triton (bundled with PyTorch's CUDA builds)."""
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


class ConditionalCopy:
    """`sources[i]` copied into `destinations[i]` (contiguous, same size in bytes) when `copy_if` sees a
    non-finite value and no copy is taken yet; `taken` and `step_taken` say which step it holds."""

    def __init__(self, sources: list[torch.Tensor], destinations: list[torch.Tensor], device: torch.device):
        self._sources = sources  # held: a table entry always points at memory that is still allocated
        self._destinations = destinations
        self._src = _pointers(sources, device)
        self._dst = _pointers(destinations, device)
        self._nbytes = torch.tensor([t.numel() * t.element_size() for t in sources], dtype=torch.int64, device=device)

    def copy_if(self, values: torch.Tensor, taken: torch.Tensor, step_taken: torch.Tensor, step: int,
                at_end: torch.Tensor, end: bool) -> None:
        """Copies when `values` (a device vector) holds a non-finite value and `taken` is 0; then sets
        `taken`, `step_taken` to `step` and `at_end` to `end` (the copy was made at the step's end)."""
        copy_kernel, mark_kernel = _kernels()
        values = values.reshape(-1)
        if self._sources:
            copy_kernel[(len(self._sources), PROGRAMS_PER_TENSOR)](
                values, values.numel(), taken, self._src, self._dst, self._nbytes,
                BLOCK=BLOCK_BYTES, PROGRAMS=PROGRAMS_PER_TENSOR)
        mark_kernel[(1,)](values, values.numel(), taken, step_taken, step, at_end, int(end))


def _pointers(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=device)


@functools.cache
def _kernels():
    """Imported on first use: Triton loads and compiles only where a copy is made."""
    from gpuprof.numerics import device_copy_kernels

    return device_copy_kernels.copy_if_nonfinite, device_copy_kernels.mark_taken
