"""Formatting lives in gpuprof.report.format; this name stays until views/memory.py imports it from there."""

from gpuprof.report.format import fmt_gib

__all__ = ["fmt_gib"]
