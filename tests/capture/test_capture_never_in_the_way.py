"""gpuprof changes nothing a working loop does: under DDP it leaves the model's one comm hook and its reduction
to the loop and nothing of its own on the model after close (a real 3-rank gloo job, ddp_hook_job.py); starting,
recording and closing never raise into the loop, with a lazy module, a read-only run directory, a full disk or a
writer that fails, and what was lost is said."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import capture_loop
from ddp_hook_job import STEPS
from processes import torchrun

import gpuprof
from gpuprof.run.schema import EventKind
from gpuprof.run.writer import RunWriter

JOB = Path(__file__).with_name("ddp_hook_job.py")
WORLD_SIZE = 3
PROFILED = ("profiled", "hook_before", "hook_after")


@pytest.fixture(scope="module")
def ddp_job(tmp_path_factory) -> Path:
    """The folder of the job's runs (ddp_hook_job.RUNS)."""
    out_dir = tmp_path_factory.mktemp("ddp_hooks")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*torchrun(WORLD_SIZE), str(JOB), str(out_dir)], timeout=600, capture_output=True,
                          text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return out_dir


def seen(ddp_job: Path, name: str, rank: int) -> dict:
    return json.loads((ddp_job / f"{name}.seen-rank{rank}.json").read_text())


def weights(ddp_job: Path, name: str, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(ddp_job / f"{name}.rank{rank}.pt")


def assert_bit_identical(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == theirs.keys()
    different = [name for name in ours if not torch.equal(ours[name], theirs[name])]
    assert not different, different


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hook_before", "hook_after"])
def test_the_loops_own_comm_hook_registers_and_runs_under_gpuprof(ddp_job, name):
    for rank in range(WORLD_SIZE):
        loop = seen(ddp_job, name, rank)
        assert loop["hook_error"] is None
        assert loop["comm_hooks"] == ["timed_allreduce_hook"]
        assert len(loop["first_bucket_unix_s"]) == STEPS  # DDP called it, with its first bucket each step


@pytest.mark.slow
@pytest.mark.parametrize("name, bare", [("profiled", "bare"), ("hook_before", "bare_hook"),
                                        ("hook_after", "bare_hook")])
def test_final_weights_are_bit_identical_with_and_without_gpuprof(ddp_job, name, bare):
    for rank in range(WORLD_SIZE):
        assert seen(ddp_job, name, rank)["losses"] == seen(ddp_job, bare, rank)["losses"]
        assert_bit_identical(weights(ddp_job, name, rank), weights(ddp_job, bare, rank))
    assert seen(ddp_job, bare, 0)["losses"] != seen(ddp_job, bare, 1)["losses"]  # each rank its own data: DDP averaged


@pytest.mark.slow
@pytest.mark.parametrize("name", PROFILED)
def test_nothing_of_gpuprof_stays_on_the_model_after_close(ddp_job, name):
    for rank in range(WORLD_SIZE):
        loop = seen(ddp_job, name, rank)
        assert loop["hooks_after"] == loop["hooks_before"]
        assert loop["hooks_after"]["replaced collectives"] == []
        assert loop["comm_hooks"] == ([] if name == "profiled" else ["timed_allreduce_hook"])


@pytest.mark.slow
@pytest.mark.parametrize("name", PROFILED)
def test_each_step_records_its_arrival_at_ddps_first_bucket(ddp_job, name):
    run = gpuprof.load_run(ddp_job / name)
    assert run.meta["distributed"] == {"backend": "gloo", "world_size": WORLD_SIZE, "arrivals": True}
    assert run.steps["collective_arrivals_unix_s"].map(len).eq(1).all()  # DDP's first bucket, the loop has none
    assert sorted(run.steps.groupby("rank")["step"].count().items()) == [(rank, STEPS) for rank in range(WORLD_SIZE)]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hook_before", "hook_after"])
def test_the_arrival_is_when_ddp_hands_its_first_bucket_to_the_reduction(ddp_job, name):
    """The loop's hook is called when DDP launches the bucket: gpuprof's arrival comes just before, in the backward.
    From step 2: DDP rebuilds its buckets in the second iteration, and says how only in the third (the second's
    arrival is still at the first bucket as built, which is the whole model here)."""
    run = gpuprof.load_run(ddp_job / name)
    for rank in range(WORLD_SIZE):
        steps = run.steps[run.steps["rank"] == rank].set_index("step")
        arrivals = steps["collective_arrivals_unix_s"].str[0]
        launched = pd.Series(seen(ddp_job, name, rank)["first_bucket_unix_s"], index=steps.index)
        ahead_s = (launched - arrivals).loc[2:]
        assert (ahead_s >= 0).all() and (ahead_s < steps["backward_time_s"].loc[2:]).all(), ahead_s.tolist()


# ------------------------------------------------------------------------ a single process, failing environments

def test_a_lazy_modules_loop_runs_and_is_recorded(tmp_path):
    def train(run_dir):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.LazyLinear(32), torch.nn.ReLU(), torch.nn.LazyLinear(capture_loop.VOCAB))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # given its parameters before they exist
        losses = []
        with (gpuprof.profile(run_dir, model=model, optimizer=optimizer, sample_interval_s=0)
              if run_dir else contextlib.nullcontext()) as prof:
            for step in range(STEPS):
                inputs = capture_loop.batch(step).float()
                loss = torch.nn.functional.cross_entropy(model(inputs), capture_loop.batch(step + 1)[:, 0])
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(loss.item())
                if prof is not None:
                    prof.step(loss=loss.detach())
        return losses, model.state_dict()

    losses, state = train(tmp_path / "run")
    bare_losses, bare_state = train(None)
    assert losses == bare_losses
    assert_bit_identical(state, bare_state)
    run = gpuprof.load_run(tmp_path / "run")
    assert run.meta["status"] == "finished" and run.events.empty
    assert run.meta["model"]["n_params"] == sum(t.numel() for t in bare_state.values())  # counted once they exist
    np.testing.assert_allclose(run.steps["loss"], losses, rtol=1e-6)
    assert run.steps["grad_norm"].iloc[1:].notna().all()  # from the step after the one that made the parameters


@contextlib.contextmanager
def tmpfs(folder: Path, options: str):
    """A small filesystem of its own at `folder` (root only), unmounted at the end."""
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def gpuprof_warnings(caplog) -> list[str]:
    """gpuprof's warnings, but the one every run on a machine without NVML logs."""
    return [record.getMessage() for record in caplog.records if record.name == "gpuprof"
            and record.levelno >= logging.WARNING and "device metrics off" not in record.getMessage()]


def test_a_read_only_run_directory_loses_the_run_in_one_warning_line(tmp_path, caplog):
    with tmpfs(tmp_path / "ro", "ro,size=64k") as folder:
        seen_profiled = capture_loop.train(folder / "run", steps=STEPS)
        assert not any(folder.iterdir())
    assert seen_profiled == capture_loop.train(None, steps=STEPS)
    [warning] = gpuprof_warnings(caplog)
    assert warning.startswith(f"gpuprof: cannot create run directory {folder / 'run'}") and "Read-only" in warning
    assert warning.endswith("nothing of this run is recorded")


def test_a_full_disk_loses_the_records_in_one_warning_line(tmp_path, caplog):
    with tmpfs(tmp_path / "full", "size=64k") as folder:
        with contextlib.suppress(OSError), open(folder / "filler", "wb") as filler:
            filler.write(bytes(1 << 20))
        seen_profiled = capture_loop.train(folder / "run", steps=STEPS)
        left = sorted(path.name for path in (folder / "run").rglob("*") if path.is_file())
    assert seen_profiled == capture_loop.train(None, steps=STEPS)
    [warning] = gpuprof_warnings(caplog)
    assert warning.startswith("gpuprof: cannot write ") and "No space left on device" in warning
    assert warning.endswith(f"any other of {folder / 'run'} that cannot be written from now on, are lost")
    assert all(name.endswith(".jsonl") for name in left), left  # no half-written temporary file stays


@pytest.mark.capture_may_switch_off
@pytest.mark.parametrize("method", ["write_run_meta", "close"])
def test_a_failing_writer_at_start_or_close_switches_capture_off_and_says_so(tmp_path, monkeypatch, method):
    """The writer raises something it was never meant to: from its first meta write (at start) or at close."""
    def failing(self, *args, **kwargs):
        raise RuntimeError(f"{method} broke")

    monkeypatch.setattr(RunWriter, method, failing)
    seen_profiled = capture_loop.train(tmp_path / "run", steps=STEPS)
    assert seen_profiled == capture_loop.train(None, steps=STEPS)
    disabled = rank_events(tmp_path / "run", EventKind.PROFILER_DISABLED)
    assert [event["message"].split(";")[0] for event in disabled] == [f"capture switched off: RuntimeError('{method} broke')"]
    if method == "write_run_meta":  # at start: no step recorded
        assert disabled[0]["step"] == 0 and rank_records(tmp_path / "run", "steps").empty
    else:  # at close, after the last meta: the run's end stands
        assert disabled[0]["step"] == STEPS
        assert json.loads((tmp_path / "run" / "meta.json").read_text())["status"] == "finished"


def rank_records(run_dir: Path, stream: str) -> pd.DataFrame:
    """Rank 0's records of `stream`, compacted to Parquet at close or not (a run without its meta.json cannot be
    loaded)."""
    compacted = run_dir / "rank-0" / f"{stream}.parquet"
    if compacted.exists():
        return pd.read_parquet(compacted)
    return pd.read_json(run_dir / "rank-0" / f"{stream}.jsonl", lines=True)


def rank_events(run_dir: Path, kind: str) -> list[dict]:
    events = rank_records(run_dir, "events")
    return events[events["kind"] == kind].to_dict("records")
