"""The Streamlit dashboard: `gpuprof dashboard [RUNS_DIR]` serves `app.py` from this package.

It only presents: runs come from `gpuprof.run`, and everything said about a run from its report
(`gpuprof.report`: summary, verdict, findings, trace tables, NaN blames). See docs/dashboard.md. This module stays free of Streamlit so the
CLI can read these settings without starting Streamlit's machinery.
"""

from __future__ import annotations

from pathlib import Path

from gpuprof.errors import GpuprofError

APP_PATH = Path(__file__).with_name("app.py")
DEFAULT_RUNS_DIR = Path("runs")  # where `gpuprof train` and `gpuprof run` record by default
RUNS_DIR_ENV = "GPUPROF_RUNS_DIR"
REFRESH_ENV = "GPUPROF_DASHBOARD_REFRESH_S"
DEFAULT_REFRESH_S = 5.0
MIN_REFRESH_S = 1.0
MAX_SELECTED_RUNS = 6  # one run for most pages; two or more for Compare (B the last, A a baseline of the others)


def default_runs_dir() -> Path:
    """`./runs`; without one, a GpuprofError saying how to name a folder or record a run."""
    if not DEFAULT_RUNS_DIR.is_dir():
        raise GpuprofError(
            f"no ./{DEFAULT_RUNS_DIR} folder here: name a folder of runs (gpuprof dashboard RUNS_DIR), "
            f"or record a run first (gpuprof train and gpuprof run record into ./{DEFAULT_RUNS_DIR})"
        )
    return DEFAULT_RUNS_DIR
