"""The Streamlit dashboard: `gpuprof dashboard [RUNS_DIR]` serves `app.py` from this package.

It only presents: runs come from `gpuprof.run`, figures and findings from `gpuprof.analysis`
and `gpuprof.diagnoses`. See docs/dashboard.md. This module stays free of Streamlit so the
CLI can read these settings without starting Streamlit's machinery.
"""

from __future__ import annotations

from pathlib import Path

APP_PATH = Path(__file__).with_name("app.py")
REPO_SAMPLE_RUNS = Path(__file__).resolve().parents[2] / "sample_runs"
RUNS_DIR_ENV = "GPUPROF_RUNS_DIR"
REFRESH_ENV = "GPUPROF_DASHBOARD_REFRESH_S"
DEFAULT_REFRESH_S = 5.0
MIN_REFRESH_S = 1.0
MAX_SELECTED_RUNS = 2  # one run for most pages, two for Compare


def default_runs_dir() -> Path:
    """`./runs` when it exists, else the sample runs shipped in the repository."""
    local = Path("runs")
    return local if local.is_dir() else REPO_SAMPLE_RUNS
