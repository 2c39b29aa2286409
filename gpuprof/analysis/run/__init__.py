"""Run analysis: the headline figures of one run (`summarize`). Two runs side by side are
compared on their reports (`gpuprof.report.compare`)."""

from gpuprof.analysis.run.summary import RunSummary, Warmup, summarize

__all__ = ["RunSummary", "Warmup", "summarize"]
