"""Run analysis: the headline figures of one run (`summarize`) and of two side by side (`compare`)."""

from gpuprof.analysis.run.compare import Comparison, compare
from gpuprof.analysis.run.summary import RunSummary, Warmup, summarize

__all__ = ["Comparison", "RunSummary", "Warmup", "compare", "summarize"]
