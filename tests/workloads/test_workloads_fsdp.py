"""`gpuprof train --parallel fsdp`: FSDP2 over two CPU processes (gloo), DCP checkpoints, bad input."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gpuprof
from gpuprof.cli import main
from test_workloads_ddp import free_port


@pytest.mark.slow
def test_fsdp_trains_and_resumes_from_a_sharded_checkpoint(tmp_path):
    worker = Path(__file__).with_name("fsdp_worker.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(worker), str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank-{r}.pt", weights_only=True) for r in (0, 1)]
    for rank in ranks:
        assert rank["world_size"] == 2 and len(rank["losses"]) == 4
        # the resumed run continues with the very losses and weights of the uninterrupted one
        assert rank["resumed_start"] == 2
        torch.testing.assert_close(torch.tensor(rank["resumed_losses"]), torch.tensor(rank["losses"][2:]))
        for name, weight in rank["weights"].items():
            torch.testing.assert_close(rank["resumed_weights"][name], weight, msg=name)
    assert ranks[0]["losses"] != ranks[1]["losses"]  # each rank trained on its own data
    for name, weight in ranks[0]["weights"].items():  # one model, gathered from its shards
        assert torch.equal(weight, ranks[1]["weights"][name]), name
    shards = sorted(p.name for p in (tmp_path / "run" / "checkpoints" / "step-000002").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp", "trainer.pt"]
    run = gpuprof.load_run(tmp_path / "run")
    assert run.meta["config"]["parallel"] == "fsdp" and run.meta["config"]["reshard_after_forward"] is True
    assert run.meta["distributed"]["sharding"]["model_state_bytes_per_rank"] * 2 == pytest.approx(
        run.meta["distributed"]["sharding"]["model_state_bytes"], rel=0.01)
    norms = run.steps.pivot(index="step", columns="rank", values="grad_norm")
    assert norms.notna().all().all() and (norms[0] == norms[1]).all()


@pytest.mark.parametrize("flags, message", [
    (["--parallel", "fsdp"], "--parallel fsdp shards the model over several processes"),
    (["--cpu-offload"], "need --parallel fsdp"),
    (["--parallel", "fsdp", "--precision", "fp16"], "runs bf16 or fp32"),
])
def test_fsdp_bad_input_is_one_line_and_exit_2(flags, message, tmp_path, capsys):
    # the CLI's own entry point, in this process (not under torchrun: a world of one)
    assert main(["train", *flags, "--steps", "1", "--run-dir", str(tmp_path / "run")]) == 2
    stderr = capsys.readouterr().err
    assert message in stderr and len(stderr.strip().splitlines()) == 1, stderr
