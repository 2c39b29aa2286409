"""Memory per step: torch allocator counters on CUDA (host-side reads, no sync); process RSS everywhere."""

from __future__ import annotations

import psutil
import torch


class MemoryCollector:
    name = "memory"

    def __init__(self, device: torch.device, sampler=None):
        self._device = device
        self._process = psutil.Process()
        self._sampler = sampler

    def on_step_end(self, prof, state) -> dict:
        fields = {"mem_rss_bytes": self._process.memory_info().rss}
        if self._device.type != "cuda":
            return fields
        stats = torch.cuda.memory_stats(self._device)
        reserved = stats.get("reserved_bytes.all.current", 0)
        nvml_used = self._sampler.device_mem_used_bytes if self._sampler is not None else None
        fields.update(
            mem_allocated_bytes=stats.get("allocated_bytes.all.current", 0),
            mem_reserved_bytes=reserved,
            mem_peak_allocated_bytes=stats.get("allocated_bytes.all.peak", 0),
            mem_alloc_retries=stats.get("num_alloc_retries", 0),
            mem_ooms=stats.get("num_ooms", 0),
            mem_nvml_used_bytes=nvml_used,
            mem_nvml_gap_bytes=nvml_used - reserved if nvml_used is not None else None,
        )
        return fields
