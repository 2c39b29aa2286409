"""Trace analyzer for torch.profiler Chrome traces: `TraceAnalysis(path)`.

`TraceAnalysis` is imported on first use, so the light modules here (`tables`) load without pandas."""

from __future__ import annotations

__all__ = ["TraceAnalysis"]


def __getattr__(name: str):
    if name != "TraceAnalysis":
        raise AttributeError(f"module 'gpuprof.analysis.trace' has no attribute {name!r}")
    from gpuprof.analysis.trace.analysis import TraceAnalysis

    return TraceAnalysis
