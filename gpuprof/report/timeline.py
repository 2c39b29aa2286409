"""One trace window as the Timeline page shows it: the trace read once, then any step of any rank drawn on
demand as bars per host thread and device stream (gpuprof.analysis.trace.timeline)."""

from __future__ import annotations

from gpuprof.analysis.trace.loader import load_trace
from gpuprof.analysis.trace.timeline import StepTimeline, step_timeline, trace_steps

__all__ = ["StepTimeline", "WindowTimelines"]


class WindowTimelines:
    """The timelines of one trace window's files (all its ranks)."""

    def __init__(self, files: list[str]):
        self._trace = load_trace(list(files))

    @property
    def ranks(self) -> list[int]:
        return list(self._trace.ranks)

    def steps(self, rank: int) -> list[int]:
        """The profiler steps `rank` recorded, in order."""
        return trace_steps(self._trace, rank)

    def step(self, step: int, rank: int) -> StepTimeline:
        return step_timeline(self._trace, step, rank)
