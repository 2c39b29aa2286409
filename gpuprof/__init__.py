"""gpuprof: profiling and diagnostics for PyTorch training of GPT-2-class transformers.

    with gpuprof.profile("runs/exp1", model=model, optimizer=optimizer) as prof:
        for batch in loader:
            ...
            prof.step(loss=loss, tokens=batch_tokens)

    run = gpuprof.load_run("runs/exp1")
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# Public name -> module that defines it. Imported on first use so that `import gpuprof`
# (and `gpuprof --help`) does not pay for torch and pandas.
_PUBLIC = {
    "profile": "gpuprof.capture.profiler",
    "Profiler": "gpuprof.capture.profiler",
    "load_run": "gpuprof.run.reader",
    "Run": "gpuprof.run.reader",
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'gpuprof' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)
