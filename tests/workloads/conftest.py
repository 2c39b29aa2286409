"""Shared set-up for the GPT-2 workload tests: a private token cache and a small config."""

from __future__ import annotations

import os

import pytest

# Small enough for a 2-core CPU: a 2-layer model, 64-token sequences, 8k vocabulary.
SMALL = {"model_size": "tiny", "vocab_size": 8192, "seq_len": 64, "batch_size": 8, "log_every": 1000}


@pytest.fixture(scope="session", autouse=True)
def token_cache(tmp_path_factory):
    """One tokenizer/token cache per test worker, shared by in-process runs and subprocesses."""
    path = tmp_path_factory.mktemp("gpuprof-cache")
    previous = os.environ.get("GPUPROF_CACHE")
    os.environ["GPUPROF_CACHE"] = str(path)
    yield path
    if previous is None:
        del os.environ["GPUPROF_CACHE"]
    else:
        os.environ["GPUPROF_CACHE"] = previous


@pytest.fixture
def small():
    """TrainConfig factory: the small settings plus overrides."""
    from gpuprof.workloads.gpt2 import TrainConfig

    return lambda **overrides: TrainConfig(**{**SMALL, **overrides})
