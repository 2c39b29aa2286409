"""The report layer: one `Report` per run (summary, verdict, ranked findings, trace tables,
numerics blames), built once by `build_report` and rendered by the CLI, the HTML report and
the dashboard; `compare` sets two reports side by side.

Names are imported on first use, so `gpuprof.report.format` loads without pandas (the CLI's parser)."""

from __future__ import annotations

import importlib

_PUBLIC = {
    "Report": "gpuprof.report.build",
    "TraceWindow": "gpuprof.report.build",
    "build_report": "gpuprof.report.build",
    "Comparison": "gpuprof.report.comparison",
    "compare": "gpuprof.report.comparison",
    "Verdict": "gpuprof.report.verdict",
}

__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'gpuprof.report' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)
