"""Capture of real 2-rank gloo jobs under torchrun: a DDP loop with a trace window (both ranks' files
and traces) and a plain FSDP2 loop (sharded norms, memory, NaN origin, gpuprof's own code failing on
one rank). One job records every run, one after the other (gloo_job.py)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gpuprof

pytestmark = pytest.mark.newest_torch  # run again on the newest torch tested (scripts/test.sh)
JOB = Path(__file__).with_name("gloo_job.py")
DDP_STEPS, DDP_TRACE_STEPS = 4, [1, 3]
STEPS, NAN_STEP, NAN_RANK = 4, 3, 1
NAN_PARAM = "transformer.h.1.mlp.c_fc.weight"
FAIL_STEPS, FAIL_STEP, FAIL_RANK = 5, 2, 1
FAIL_IN = ["collector", "profiler-before", "profiler-after", "collector-after"]


@pytest.fixture(scope="module")
def gloo_runs(tmp_path_factory) -> Path:
    """The folder of the job's runs: `nan`, one per FAIL_IN place, then `ddp`, each beside its NAME.seen-rankN.json."""
    out_dir = tmp_path_factory.mktemp("gloo")
    runs = [{"name": "nan", "loop": "fsdp", "steps": STEPS, "nan_step": NAN_STEP, "nan_rank": NAN_RANK}] + [
        {"name": where, "loop": "fsdp", "steps": FAIL_STEPS, "fail_step": FAIL_STEP, "fail_rank": FAIL_RANK,
         "fail_in": where} for where in FAIL_IN] + [
        {"name": "ddp", "loop": "ddp", "steps": DDP_STEPS, "trace_steps": DDP_TRACE_STEPS}]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(JOB),
               str(out_dir), json.dumps(runs)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, timeout=600, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return out_dir


def seen_by(run_dir: Path, rank: int) -> dict:
    return json.loads(Path(f"{run_dir}.seen-rank{rank}.json").read_text())


def recorded(gloo_runs: Path, name: str):
    """The run `name` and what each rank's loop saw."""
    return gpuprof.load_run(gloo_runs / name), {rank: seen_by(gloo_runs / name, rank) for rank in (0, 1)}


@pytest.fixture(scope="module")
def ddp_run(gloo_runs):
    return recorded(gloo_runs, "ddp")


@pytest.fixture(scope="module")
def fsdp_run(gloo_runs):
    return recorded(gloo_runs, "nan")


def test_every_rank_writes_its_own_records(ddp_run):
    run, seen = ddp_run
    assert run.ranks == [0, 1] and run.meta["world_size"] == 2
    assert run.meta["distributed"] == {"backend": "gloo", "world_size": 2, "arrivals": True}
    for rank in (0, 1):
        steps = run.steps[run.steps["rank"] == rank]
        assert steps["step"].tolist() == list(range(DDP_STEPS))
        np.testing.assert_allclose(steps["loss"], seen[rank]["losses"], rtol=1e-6)
        # norms are read after DDP's all-reduce: equal to clip_grad_norm_'s and equal across ranks
        np.testing.assert_allclose(steps["grad_norm"], seen[rank]["clip_norms"], rtol=1e-5)
    assert seen[0]["losses"] != seen[1]["losses"]  # different data per rank ...
    np.testing.assert_allclose(seen[0]["clip_norms"], seen[1]["clip_norms"], rtol=1e-5)  # ... averaged grads
    assert run.rank_meta[1]["rank"] == 1 and run.rank_meta[1]["status"] == "finished"
    # one arrival a step: DDP's first bucket (the all-reduce gpuprof's hook makes for it is not the loop's)
    assert run.steps["collective_arrivals_unix_s"].map(len).eq(1).all()
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


@pytest.mark.slow
def test_sharded_grad_norms_equal_clip_grad_norm_on_every_rank(fsdp_run):
    run, seen = fsdp_run
    disabled = run.events[run.events["kind"].isin(["profiler_disabled", "collector_disabled"])]
    assert disabled.empty, disabled["message"].tolist()
    finite = range(NAN_STEP)
    for rank in (0, 1):
        steps = run.steps[run.steps["rank"] == rank].set_index("step")
        assert steps.index.tolist() == list(range(STEPS))
        np.testing.assert_allclose(steps["loss"], seen[rank]["losses"], rtol=1e-6)
        np.testing.assert_allclose(steps["grad_norm"].loc[list(finite)], seen[rank]["clip_norms"][:NAN_STEP], rtol=1e-5)
        layers = run.layers[(run.layers["rank"] == rank) & (run.layers["level"] == "block")]
        for step in finite:
            recorded = layers[layers["step"] == step].set_index("layer")["grad_norm"]
            expected = seen[rank]["block_norms"][step]
            np.testing.assert_allclose(recorded.loc[list(expected)], list(expected.values()), rtol=1e-5)
        assert (steps["mem_rss_bytes"] > 0).all()  # memory, per rank
    norms = run.steps.pivot(index="step", columns="rank", values="grad_norm")
    assert (norms.loc[list(finite), 0] == norms.loc[list(finite), 1]).all()
    sharding = run.meta["distributed"]["sharding"]
    assert sharding["fsdp_units"] == 3 and sharding["param_bytes"] == 4 * run.meta["model"]["n_params"]


@pytest.mark.slow
def test_nan_in_one_ranks_shard_names_that_rank_and_parameter(fsdp_run):
    run, _ = fsdp_run
    steps = run.steps.set_index(["step", "rank"])
    assert not steps.loc[NAN_STEP]["grad_norm_finite"].any()  # every rank sees the global norm go bad
    events = run.events[run.events["kind"] == "nonfinite"]
    assert sorted(events["rank"]) == [0, 1] and set(events["step"]) == {NAN_STEP}
    for details in events["details"]:
        assert details["rank"] == NAN_RANK and details["tensor"] == NAN_PARAM and details["trigger"] == "grads"
        assert any("sharded" in note for note in details["notes"])  # the re-run declined, and says why


@pytest.mark.slow
@pytest.mark.capture_may_switch_off
@pytest.mark.parametrize("where", FAIL_IN)
def test_capture_failing_on_one_rank_never_leaves_the_others_waiting(gloo_runs, where):
    """The sharded gradient norms cost one all-reduce per step that every rank must make. When gpuprof's
    own code fails on one rank, that rank keeps making it (its part marked unknown): training ends on
    every rank, with the loop's own losses, and no rank records a partial norm from then on."""
    steps, fail_step = FAIL_STEPS, FAIL_STEP
    run_dir = gloo_runs / where
    run = gpuprof.load_run(run_dir)
    healthy = run.steps[run.steps["rank"] == 0].set_index("step")
    seen = seen_by(run_dir, 0)
    assert healthy.index.tolist() == list(range(steps))
    np.testing.assert_allclose(healthy["loss"], seen["losses"], rtol=1e-6)
    np.testing.assert_allclose(healthy["grad_norm"].loc[:fail_step - 1], seen["clip_norms"][:fail_step], rtol=1e-5)
    first_unknown = fail_step + 1 if where.endswith("after") else fail_step
    assert healthy["grad_norm"].loc[first_unknown:].isna().all()
    switched_off = run.events[(run.events["rank"] == FAIL_RANK) & run.events["kind"].isin(
        ["profiler_disabled", "collector_disabled"])]
    assert switched_off["step"].tolist() == [fail_step]
