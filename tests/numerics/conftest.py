"""Fixtures for the numerics tests: a tiny GPT-2 on a random token file."""

from __future__ import annotations

import numpy as np
import pytest
from numerics_helpers import SMALL, VOCAB


@pytest.fixture(scope="session")
def token_file(tmp_path_factory):
    """Random uint16 tokens: no tokenizer to train, same data in every worker."""
    path = tmp_path_factory.mktemp("numerics-data") / "tokens.bin"
    np.random.default_rng(0).integers(0, VOCAB, 20_000, dtype=np.uint16).tofile(path)
    return str(path)


@pytest.fixture
def tiny(token_file, tmp_path):
    """TrainConfig factory for the tiny workload, recorded under tmp_path/run unless run_dir is given."""
    from gpuprof.workloads.gpt2 import TrainConfig

    def make(**overrides):
        return TrainConfig(**{**SMALL, "data": token_file, "run_dir": str(tmp_path / "run"), **overrides})

    return make
