"""Fixtures of the command-line tests: real `gpuprof dashboard` servers that always stop (tests/dashboard's), and a
real recorded run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "dashboard"))

from dashboard_servers import start_dashboard  # noqa: E402,F401 - a fixture of these tests


@pytest.fixture(scope="session")
def recorded(tmp_path_factory) -> Path:
    """A real run of the reference workload: 3 steps of a one-block tiny GPT-2 on the CPU."""
    run_dir = tmp_path_factory.mktemp("recorded") / "tiny"
    subprocess.run([sys.executable, "-m", "gpuprof", "train", "--model", "tiny", "--steps", "3", "--n-layer", "1",
                    "--seq-len", "32", "--batch-size", "2", "--sample-interval", "0", "--run-dir", str(run_dir)],
                   check=True, capture_output=True, timeout=600)
    return run_dir
