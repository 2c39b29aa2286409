"""The run directory (docs/run-format.md): `load_run`, `discover_runs`; writer.py and reader.py own its files."""

from gpuprof.run.reader import Run, discover_runs, load_run

__all__ = ["Run", "discover_runs", "load_run"]
