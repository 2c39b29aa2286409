"""Fixtures of the run-layer tests: many-rank runs synthesised by benchmarks/scale.py (into tmp)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from scale import synthesise  # noqa: E402 - benchmarks/ is not a package


@pytest.fixture(scope="session")
def many_ranks(tmp_path_factory) -> Path:
    """A finished 12-rank x 60-step GPU-shaped run with one straggler rank (rank 4)."""
    run_dir = tmp_path_factory.mktemp("many") / "run"
    synthesise(run_dir, n_ranks=12, n_steps=60, system_hz=10.0)
    return run_dir
