"""Memory per step: torch allocator counters on CUDA (host-side reads, no sync); process RSS everywhere
(the background sampler's latest reading while it runs)."""

from __future__ import annotations

import os

import psutil
import torch


class RssReader:
    """The process's resident set size. On Linux a read of /proc/self/statm through a file kept
    open (about 1 us; psutil opens and parses a file per call); psutil elsewhere."""

    def __init__(self):
        self._page_bytes = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 0
        try:
            self._statm = os.open("/proc/self/statm", os.O_RDONLY) if self._page_bytes else None
        except OSError:
            self._statm = None
        self._process = psutil.Process()

    def rss_bytes(self) -> int:
        if self._statm is None:
            return self._process.memory_info().rss
        return int(os.pread(self._statm, 128, 0).split()[1]) * self._page_bytes

    def close(self) -> None:
        if self._statm is not None:
            os.close(self._statm)
            self._statm = None


class MemoryCollector:
    name = "memory"

    def __init__(self, device: torch.device, sampler=None):
        self._device = device
        self._rss = RssReader()
        self._sampler = sampler

    def on_close(self, prof) -> None:
        self._rss.close()

    def _rss_bytes(self) -> int:
        """The sampler's latest reading while it runs (at most its interval old): read here, right
        after a training step has flushed the caches, a read of /proc costs about 25 us."""
        latest = self._sampler.proc_rss_bytes if self._sampler is not None else None
        return latest if latest is not None else self._rss.rss_bytes()

    def on_step_end(self, prof, state) -> dict:
        fields = {"mem_rss_bytes": self._rss_bytes()}
        if self._device.type != "cuda":
            return fields
        nvml_used = self._sampler.device_mem_used_bytes if self._sampler is not None else None
        fields.update(allocator_fields(torch.cuda.memory_stats_as_nested_dict(self._device)))
        reserved = fields["mem_reserved_bytes"]
        fields.update(mem_nvml_used_bytes=nvml_used,
                      mem_nvml_gap_bytes=nvml_used - reserved if nvml_used is not None else None)
        return fields


def allocator_fields(stats: dict) -> dict[str, int]:
    """The step record's allocator counters from the caching allocator's nested statistics (what
    torch.cuda.memory_stats() flattens, at about 200 us a call: read nested, a few us)."""
    def current_and_peak(name: str) -> dict:
        return stats.get(name, {}).get("all", {})

    return {
        "mem_allocated_bytes": current_and_peak("allocated_bytes").get("current", 0),
        "mem_reserved_bytes": current_and_peak("reserved_bytes").get("current", 0),
        "mem_peak_allocated_bytes": current_and_peak("allocated_bytes").get("peak", 0),
        "mem_alloc_retries": stats.get("num_alloc_retries", 0),
        "mem_ooms": stats.get("num_ooms", 0),
    }
