"""Clocks for step and phase timing.

On CUDA a stamp is a CUDA event recorded on the current stream, read a few steps later
(when the event has completed) so timing never waits on the device. On CPU it is the
host clock. Either way `elapsed_s(start, end)` turns two stamps into seconds, and must
only be called once the end stamp is `done`.
"""

from __future__ import annotations

import time

import torch

from gpuprof.torch_compat import private


class HostClock:
    kind = "host"

    def stamp(self) -> float:
        return time.perf_counter()

    @staticmethod
    def elapsed_s(start: float, end: float) -> float:
        return end - start

    @staticmethod
    def done(stamp: float) -> bool:
        return True


_raw_stream = private("torch._C._cuda_getCurrentRawStream")
_streams: dict[tuple[int, int], "torch.cuda.Stream"] = {}
_MAX_STREAMS = 64


def current_stream(index: int) -> "torch.cuda.Stream":
    """torch.cuda.current_stream(index) without building a Stream object per call (about 10 us each,
    several times a step): one per stream, looked up by the raw handle."""
    if _raw_stream is None:
        return torch.cuda.current_stream(index)
    key = (index, _raw_stream(index))
    stream = _streams.get(key)
    if stream is None:
        if len(_streams) >= _MAX_STREAMS:
            _streams.clear()
        stream = _streams[key] = torch.cuda.current_stream(index)
    return stream


class CudaClock:
    kind = "cuda_events"

    def __init__(self, device: torch.device):
        self._index = device.index if device.index is not None else torch.cuda.current_device()

    def stamp(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(current_stream(self._index))
        return event

    @staticmethod
    def elapsed_s(start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1000.0

    @staticmethod
    def done(stamp: torch.cuda.Event) -> bool:
        return stamp.query()


def clock_for(device: torch.device) -> HostClock | CudaClock:
    return CudaClock(device) if device.type == "cuda" else HostClock()


class PhaseTimes:
    """Start/end stamps of the phases of one step; a phase may repeat (one per micro-batch)."""

    def __init__(self, clock):
        self.clock = clock
        self.spans: list[tuple[str, object, object]] = []
        self._open: dict[str, object] = {}
        self._host_spans: list[tuple[str, float]] = []
        self._host_open: dict[str, float] = {}

    def begin(self, name: str) -> None:
        if name == "data":  # data loading is host work: its device-timeline span would show leftover kernels
            self._host_open[name] = time.perf_counter()
        else:
            self._open[name] = self.clock.stamp()

    def end(self, name: str) -> None:
        if name in self._host_open:
            self.add_host(name, time.perf_counter() - self._host_open.pop(name))
        elif name in self._open:
            self.add(name, self._open.pop(name), self.clock.stamp())

    def open_phase(self) -> str | None:
        """The phase begun last and not ended yet (read from another thread: a snapshot is enough)."""
        names = [*self._open, *self._host_open]
        return names[-1] if names else None

    def add(self, name: str, start, end) -> None:
        """A finished span between two stamps of this clock."""
        self.spans.append((name, start, end))

    def add_host(self, name: str, seconds: float) -> None:
        """A finished span measured on the host clock."""
        self._host_spans.append((name, seconds))

    def stamps(self) -> list:
        return [stamp for _, start, end in self.spans for stamp in (start, end)]

    def count(self, name: str) -> int:
        return sum(1 for span in self.spans if span[0] == name) + sum(1 for span in self._host_spans if span[0] == name)

    def totals_s(self) -> dict[str, float]:
        """Seconds per phase name, summed over repeats. Call once the step's end stamp is done."""
        totals: dict[str, float] = {}
        for name, start, end in self.spans:
            totals[name] = totals.get(name, 0.0) + self.clock.elapsed_s(start, end)
        for name, seconds in self._host_spans:
            totals[name] = totals.get(name, 0.0) + seconds
        return totals
