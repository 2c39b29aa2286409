"""The run directory (docs/run-format.md): `load_run`, `discover_runs`; writer.py, reader.py and
query.py (out-of-core aggregates over all ranks, `run.query`) own its files."""

from gpuprof.run.reader import Run, discover_runs, load_run

__all__ = ["Run", "discover_runs", "load_run"]
