"""`gpuprof tune` on unmodified scripts: real child processes, real trials, measured on this (loaded) machine:
every rank of a torchrun job.

The children run with one torch thread: on 2 cores shared with other jobs, more threads only add noise."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from processes import torchrun
from tune_cli import HERE, TUNE_TIMEOUT_S, trials_of

import gpuprof


@pytest.mark.slow
@pytest.mark.timeout(TUNE_TIMEOUT_S)
def test_under_torchrun_every_rank_runs_the_same_trials_as_one_world(tmp_path):
    done = subprocess.run(
        [*torchrun(), "-m", "gpuprof", "tune", "--json", "--steps", "4", "--only", "gc-freeze",
         "--out", str(tmp_path / "tune"), str(HERE / "ddp_mlp.py"), "--steps", "100"],
        capture_output=True, text=True, timeout=TUNE_TIMEOUT_S, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)  # rank 0 alone prints
    trial = trials_of(result)["gc-freeze"]
    assert trial["status"] == "measured" and trial["speedup"] is not None
    assert (tmp_path / "tune" / "baseline.log").is_file() and (tmp_path / "tune" / "baseline.rank1.log").is_file()
    for name in ("baseline", "gc-freeze", "baseline-after-gc-freeze"):
        run = gpuprof.load_run(tmp_path / "tune" / name)
        assert run.meta["model"]["wrapper"] == "DistributedDataParallel"
        assert sorted(run.steps["rank"].unique()) == [0, 1]
