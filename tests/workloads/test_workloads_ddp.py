"""Two CPU processes under torchrun (gloo) train in lockstep and end with identical weights."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gpuprof


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_two_gloo_ranks_hold_identical_parameters(tmp_path):
    worker = Path(__file__).with_name("ddp_worker.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
               str(worker), str(tmp_path), str(tmp_path / "run")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank-{r}.pt", weights_only=True) for r in (0, 1)]
    assert all(rank["world_size"] == 2 and len(rank["losses"]) == 3 for rank in ranks)
    assert ranks[0]["losses"] != ranks[1]["losses"]  # each rank trained on its own shard
    for name, param in ranks[0]["params"].items():
        assert torch.equal(param, ranks[1]["params"][name]), name
    assert done.stdout.count("optimized tiny: 3 steps") == 1  # rank 0 alone prints the summary
    run = gpuprof.load_run(tmp_path / "run")
    assert sorted(run.steps["rank"].unique().tolist()) == [0, 1]
    assert run.meta["distributed"]["backend"] == "gloo"
    # DDP's own all-reduce timing, which only the DDP wrapper exposes, reaches both ranks' records
    comm = run.steps.dropna(subset=["ddp_backward_comm_time_s"])
    assert sorted(comm["rank"].unique().tolist()) == [0, 1]
    assert (comm["ddp_backward_comm_time_s"] > 0).all()
