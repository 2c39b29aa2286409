"""`gpuprof tune` on unmodified scripts: real child processes, real trials, measured on this (loaded) machine:
every rank of a torchrun job.

The children run with one torch thread: on 2 cores shared with other jobs, more threads only add noise."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from tune_cli import HERE, TUNE_TIMEOUT_S, trials_of

import gpuprof


@pytest.mark.slow
@pytest.mark.timeout(TUNE_TIMEOUT_S)
def test_under_torchrun_every_rank_runs_the_same_trials_as_one_world(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                "--master_port", str(port), "-m"]
    done = subprocess.run(
        [*torchrun, "gpuprof", "tune", "--json", "--steps", "4", "--only", "gc-freeze", "--out", str(tmp_path / "tune"),
         str(HERE / "ddp_mlp.py"), "--steps", "100"],
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
