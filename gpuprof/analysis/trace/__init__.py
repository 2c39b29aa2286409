"""Trace analyzer for torch.profiler Chrome traces: `TraceAnalysis(path)`."""

from gpuprof.analysis.trace.analysis import TraceAnalysis

__all__ = ["TraceAnalysis"]
