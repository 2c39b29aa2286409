"""`gpuprof train` over two CPU processes under torchrun (gloo): DDP ranks train in lockstep and end
with identical weights; FSDP2 shards the model, saves DCP checkpoints and resumes from them; bad input.
One job trains both (gloo_worker.py)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from processes import torchrun

import gpuprof
from gpuprof.cli import main

SWITCHED_OFF = ("collector_disabled", "profiler_disabled")


@pytest.fixture(scope="module")
def gloo_job(tmp_path_factory) -> tuple[Path, str]:
    """The job's folder (its runs and each rank's saved results) and its stdout."""
    out_dir = tmp_path_factory.mktemp("gloo")
    worker = Path(__file__).with_name("gloo_worker.py")
    command = [*torchrun(), str(worker), str(out_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return out_dir, done.stdout


def recorded(run_dir: Path):
    """The run, checked as tests/conftest.py checks a test's own runs: capture never switched itself off."""
    run = gpuprof.load_run(run_dir)
    switched_off = run.events[run.events["kind"].isin(SWITCHED_OFF)] if "kind" in run.events.columns else run.events
    assert switched_off.empty, switched_off["message"].tolist()
    return run


@pytest.mark.slow
def test_two_gloo_ranks_hold_identical_parameters(gloo_job):
    out_dir, stdout = gloo_job
    ranks = [torch.load(out_dir / f"ddp-rank-{r}.pt", weights_only=True) for r in (0, 1)]
    assert all(rank["world_size"] == 2 and len(rank["losses"]) == 3 for rank in ranks)
    assert ranks[0]["losses"] != ranks[1]["losses"]  # each rank trained on its own shard
    for name, param in ranks[0]["params"].items():
        assert torch.equal(param, ranks[1]["params"][name]), name
    assert stdout.count("optimized tiny: 3 steps") == 1  # rank 0 alone prints the summary
    run = recorded(out_dir / "ddp-run")
    assert sorted(run.steps["rank"].unique().tolist()) == [0, 1]
    assert run.meta["distributed"]["backend"] == "gloo"
    # DDP's own all-reduce timing, which only the DDP wrapper exposes, reaches both ranks' records
    comm = run.steps.dropna(subset=["ddp_backward_comm_time_s"])
    assert sorted(comm["rank"].unique().tolist()) == [0, 1]
    assert (comm["ddp_backward_comm_time_s"] > 0).all()


@pytest.mark.slow
def test_fsdp_trains_and_resumes_from_a_sharded_checkpoint(gloo_job):
    out_dir, _ = gloo_job
    ranks = [torch.load(out_dir / f"fsdp-rank-{r}.pt", weights_only=True) for r in (0, 1)]
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
    shards = sorted(p.name for p in (out_dir / "run" / "checkpoints" / "step-000002").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp", "trainer.pt"]
    recorded(out_dir / "resumed")
    run = recorded(out_dir / "run")
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
