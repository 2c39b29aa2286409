"""Step records whose values live on the device until they are ready to read.

A step's fields may be plain values, tensors, or callables. At `PendingRecord(...)` all
CUDA tensors are packed into one float64 vector and copied to pinned host memory with
`non_blocking=True`, followed by a CUDA event: no host-device synchronization. Once the
event has completed (`ready()`, polled a few steps later) `resolve()` unpacks the values
and calls the callables (e.g. CUDA-event timings). CPU tensors are read at once (no sync).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from gpuprof.capture.timing import current_stream


def _to_python(values: torch.Tensor, dtype: torch.dtype, shape: torch.Size) -> Any:
    if dtype == torch.bool:
        values = values != 0
    elif not dtype.is_floating_point:
        values = values.round().long()
    return values.item() if len(shape) == 0 else values.tolist()


def all_finite(value: float | None) -> bool | None:
    """Whether a resolved value is finite; None when there is none."""
    return None if value is None else math.isfinite(value)


def read_if_host(value: Any) -> Any:
    """A one-element CPU tensor's value, read at once (no sync there; it may change in place later);
    another tensor detached; anything else as it is."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.item() if value.device.type == "cpu" and value.numel() == 1 else value.detach()


class PendingRecord:
    def __init__(self, fields: Mapping[str, Any]):
        self.fields = dict(fields)
        self._device_slots: dict[str, tuple[torch.dtype, torch.Size, int, int]] = {}
        self._host_buffer: torch.Tensor | None = None
        self._ready_event = None
        self._pack_device_tensors()

    def _pack_device_tensors(self) -> None:
        parts, offset, device = [], 0, None
        for key, value in self.fields.items():
            if isinstance(value, torch.Tensor) and not value.is_cuda:  # read now: it may change in place
                self.fields[key] = value.item() if value.dim() == 0 else value.reshape(-1).tolist()
            elif isinstance(value, torch.Tensor):
                device = device or value.device
                flat = value.detach().reshape(-1).to(device=device, dtype=torch.float64)
                self._device_slots[key] = (value.dtype, value.shape, offset, offset + flat.numel())
                parts.append(flat)
                offset += flat.numel()
        if not parts:
            return
        packed = torch.cat(parts)
        self._host_buffer = torch.empty(packed.shape, dtype=torch.float64, pin_memory=True)
        self._host_buffer.copy_(packed, non_blocking=True)
        self._ready_event = torch.cuda.Event()
        self._ready_event.record(current_stream(device.index))

    def ready(self) -> bool:
        return self._ready_event is None or self._ready_event.query()

    def resolve(self) -> dict[str, Any]:
        record = {}
        for key, value in self.fields.items():
            if key in self._device_slots:
                dtype, shape, start, end = self._device_slots[key]
                value = _to_python(self._host_buffer[start:end], dtype, shape)
            elif callable(value):
                value = value()
            record[key] = value
        return record

