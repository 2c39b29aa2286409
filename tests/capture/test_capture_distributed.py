"""A real 2-process gloo DDP run under torchrun, with a trace window: both ranks' files and traces."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gpuprof

LOOP = Path(__file__).with_name("capture_loop.py")


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ddp") / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(LOOP), str(run_dir), "--steps", "4", "--ddp", "--trace-steps", "1", "3"]
    subprocess.run(command, check=True, timeout=400, capture_output=True)
    seen = {rank: json.loads(Path(f"{run_dir}.seen-rank{rank}.json").read_text()) for rank in (0, 1)}
    return gpuprof.load_run(run_dir), seen


def test_every_rank_writes_its_own_records(ddp_run):
    run, seen = ddp_run
    assert run.ranks == [0, 1] and run.meta["world_size"] == 2
    assert run.meta["distributed"] == {"backend": "gloo", "world_size": 2, "arrivals": True}
    for rank in (0, 1):
        steps = run.steps[run.steps["rank"] == rank]
        assert steps["step"].tolist() == [0, 1, 2, 3]
        np.testing.assert_allclose(steps["loss"], seen[rank]["losses"], rtol=1e-6)
        # norms are read after DDP's all-reduce: equal to clip_grad_norm_'s and equal across ranks
        np.testing.assert_allclose(steps["grad_norm"], seen[rank]["clip_norms"], rtol=1e-5)
    assert seen[0]["losses"] != seen[1]["losses"]  # different data per rank ...
    np.testing.assert_allclose(seen[0]["clip_norms"], seen[1]["clip_norms"], rtol=1e-5)  # ... averaged grads
    assert run.rank_meta[1]["rank"] == 1 and run.rank_meta[1]["status"] == "finished"
    # DDP folds an iteration's timing into its averages at the next forward: none yet at step 0
    comm = run.steps.set_index("step")["ddp_backward_comm_time_s"]
    assert comm.loc[0].isna().all()
    assert (comm.loc[1:] > 0).all() and (comm.loc[1:] < run.steps["step_time_s"].max()).all()


def test_one_gzip_chrome_trace_per_rank_with_distributed_info(ddp_run):
    run, _ = ddp_run
    assert list(run.trace_windows) == ["steps-1-2"] and run.trace_windows["steps-1-2"] == run.trace_files
    assert [p.relative_to(run.path).as_posix() for p in run.trace_files] == [
        "traces/steps-1-2/rank-0.pt.trace.json.gz", "traces/steps-1-2/rank-1.pt.trace.json.gz"]
    for rank, path in enumerate(run.trace_files):
        with gzip.open(path, "rt") as handle:
            trace = json.load(handle)
        assert trace["distributedInfo"]["rank"] == rank
        assert trace["distributedInfo"]["world_size"] == 2
        names = {event.get("name") for event in trace["traceEvents"]}
        assert {"ProfilerStep#1", "ProfilerStep#2"} <= names
        assert {"gpuprof.forward", "gpuprof.backward", "gpuprof.optimizer"} <= names
        assert "ProfilerStep#3" not in names
    written = run.events[run.events["kind"] == "trace_written"]
    assert sorted(written["rank"]) == [0, 1] and set(written["step"]) == {1}
