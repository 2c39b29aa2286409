"""The run directory on disk: crash safety, torn lines, a full disk, and typed errors for bad directories."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from capture_loop import train

import gpuprof
from gpuprof.errors import NotARunError, RunFormatError
from gpuprof.run.reader import discover_runs
from gpuprof.run.writer import BUFFER_S, RunWriter, StreamWriter

LOOP = Path(__file__).with_name("capture_loop.py")


def _wait_for_steps(run_dir: Path, count: int, process: subprocess.Popen, timeout_s: float = 300) -> None:
    """Polls until `count` steps are on disk (a bound for a loaded machine: it returns as soon as they are)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read()
        if (run_dir / "meta.json").exists() and len(gpuprof.load_run(run_dir).steps) >= count:
            return
        time.sleep(0.1)
    raise AssertionError(f"no {count} steps within {timeout_s}s")


def test_a_sigkilled_run_still_loads(tmp_path):
    run_dir = tmp_path / "run"
    process = subprocess.Popen([sys.executable, str(LOOP), str(run_dir), "--steps", "1000", "--sleep-s", "0.05"],
                               stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_steps(run_dir, 3, process)
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
    run = gpuprof.load_run(run_dir)
    assert run.meta["status"] == "running"  # it never closed
    steps = run.steps
    assert len(steps) >= 3
    assert steps["step"].tolist() == list(range(len(steps)))
    assert steps["loss"].between(4.0, 7.0).all()  # ln(256) = 5.5 for the untrained tiny model
    assert (run.system["host_cpu_pct"].dropna() >= 0).all() and len(run.system) >= 1

    # a record torn in half by the kill: skipped with a warning, the rest still loads
    with open(run_dir / "rank-0" / "steps.jsonl", "a") as handle:
        handle.write('{"step": 999, "rank": 0, "lo')
    with pytest.warns(UserWarning, match="torn last line"):
        torn = gpuprof.load_run(run_dir).steps
    assert torn["step"].tolist() == steps["step"].tolist()


NEVER_CLOSED = """
import sys, torch, gpuprof
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
prof = gpuprof.profile(sys.argv[1], model=model, optimizer=optimizer, sample_interval_s=0).start()
for step in range(5):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    prof.step(loss=loss)
    print("LOSS", repr(loss.item()))
"""


def test_a_loop_that_never_closes_its_profiler_leaves_every_record_at_interpreter_exit(tmp_path):
    """The step records the writer still buffers when the interpreter exits are written then, as they were."""
    child = subprocess.run([sys.executable, "-c", NEVER_CLOSED, str(tmp_path / "run")], check=True, timeout=400,
                           stdout=subprocess.PIPE, text=True)
    losses = [float(line.split()[1]) for line in child.stdout.splitlines() if line.startswith("LOSS ")]
    steps = [json.loads(line) for line in (tmp_path / "run" / "rank-0" / "steps.jsonl").read_text().splitlines()]
    assert len(losses) == 5 and [step["loss"] for step in steps] == losses
    run = gpuprof.load_run(tmp_path / "run")
    assert run.meta["status"] == "running"
    assert run.steps["step"].tolist() == [0, 1, 2, 3, 4]


def test_clean_close_compacts_to_parquet_with_the_same_values(tmp_path):
    train(tmp_path / "run", steps=3, layer_interval=1)
    rank_dir = tmp_path / "run" / "rank-0"
    names = sorted(p.name for p in rank_dir.iterdir())
    # the hang watchdog beats on one process too (every 5 s): a run that outlived a beat has heartbeats
    assert [name for name in names if name != "heartbeats.parquet"] == [
        "events.parquet", "layers.parquet", "meta.json", "stacks.parquet", "steps.parquet", "system.parquet"]
    run = gpuprof.load_run(tmp_path / "run")
    assert run.steps["step"].tolist() == [0, 1, 2]
    assert isinstance(run.events["details"].iloc[0], dict)
    assert set(run.layers["step"]) == {0, 1, 2}


def test_buffered_records_reach_the_file_at_flush_and_close(tmp_path):
    stream = StreamWriter(tmp_path / "steps.jsonl", buffered=True)
    stream.write([{"step": 0}])
    assert (tmp_path / "steps.jsonl").read_text() == ""  # still in memory until a flush
    stream.flush()
    stream.write([{"step": 1}])
    assert [json.loads(line)["step"] for line in (tmp_path / "steps.jsonl").read_text().splitlines()] == [0]
    stream.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "steps.jsonl").read_text().splitlines()] == [0, 1]
    assert stream.records_written == 2


class _EncodedOn:
    """A value JSON has no type for: the writer encodes it as its text, which names the thread that encoded it."""

    def __str__(self) -> str:
        return threading.current_thread().name


def test_step_records_are_encoded_on_the_writers_thread_never_the_training_thread(tmp_path):
    writer = RunWriter(tmp_path / "run", rank=0)
    writer.write("steps", [{"step": 0, "encoded_on": _EncodedOn()}])
    writer.write("events", [{"step": 0, "kind": "note", "encoded_on": _EncodedOn()}])
    deadline = time.monotonic() + 30 * BUFFER_S
    while not (writer.rank_dir / "steps.jsonl").read_text() and time.monotonic() < deadline:
        time.sleep(BUFFER_S / 10)
    steps = (writer.rank_dir / "steps.jsonl").read_text()
    events = (writer.rank_dir / "events.jsonl").read_text()
    writer.close()
    assert json.loads(steps)["encoded_on"] == "gpuprof-writer"
    assert json.loads(events)["encoded_on"] == threading.current_thread().name  # an event is on disk at once


def test_a_full_disk_switches_the_stream_off_without_raising(caplog):
    stream = StreamWriter(Path("/dev/full"))
    with caplog.at_level(logging.WARNING, logger="gpuprof"):
        stream.write([{"step": 0}])
        stream.write([{"step": 1}])
    assert not stream.enabled and stream.records_written == 0
    assert sum("switched off" in r.getMessage() for r in caplog.records) == 1


def _meta(path: Path, **changes) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "meta.json").write_text(json.dumps({"format": "gpuprof-run", "format_version": 1, **changes}))


def test_bad_run_directories_raise_typed_errors(tmp_path):
    with pytest.raises(NotARunError, match="not a directory"):
        gpuprof.load_run(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotARunError, match="not a gpuprof run directory"):
        gpuprof.load_run(tmp_path / "empty")
    _meta(tmp_path / "newer", format_version=2)
    with pytest.raises(RunFormatError, match="newer gpuprof"):
        gpuprof.load_run(tmp_path / "newer")
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "meta.json").write_text('{"format": "gpuprof-run", "format_ver')
    with pytest.raises(RunFormatError, match="corrupt meta"):
        gpuprof.load_run(tmp_path / "corrupt")
    _meta(tmp_path / "other", format="something-else")
    with pytest.raises(RunFormatError, match="not a gpuprof run"):
        gpuprof.load_run(tmp_path / "other")


def test_discover_runs_finds_runs_newest_first_and_skips_bad_ones(tmp_path):
    _meta(tmp_path / "a" / "old", name="old", start_unix_s=1.0)
    _meta(tmp_path / "b" / "new", name="new", start_unix_s=2.0)
    _meta(tmp_path / "b" / "future", format_version=9)
    assert [run.name for run in discover_runs(tmp_path)] == ["new", "old"]
    assert discover_runs(tmp_path / "a")[0].steps.empty


def test_json_lines_and_parquet_read_back_the_same(tmp_path):
    from gpuprof.run.writer import RunWriter

    writer = RunWriter(tmp_path, rank=0)
    writer.write_run_meta({"format": "gpuprof-run", "format_version": 1, "name": "x"})
    writer.write("system", [{"time_unix_s": 1.0, "rank": 0, "throttle_reasons": ["sw_power_cap", "hw_slowdown"]},
                            {"time_unix_s": 2.0, "rank": 0, "throttle_reasons": []},
                            {"time_unix_s": 3.0, "rank": 0, "throttle_reasons": None}])
    writer.write("events", [{"time_unix_s": 1.0, "rank": 0, "step": 3, "kind": "k", "severity": "info",
                             "message": "m", "details": {"a": [1, 2], "b": None}}])
    writer.write("steps", [{"step": 0, "rank": 0, "step_time_s": 0.1, "loss": float("nan"), "grad_norm": float("inf")}])
    live = gpuprof.load_run(tmp_path)
    writer.close()
    closed = gpuprof.load_run(tmp_path)
    for run in (live, closed):
        assert run.system["throttle_reasons"].tolist() == [["sw_power_cap", "hw_slowdown"], [], None]
        assert run.events["details"].tolist() == [{"a": [1, 2], "b": None}]
        assert run.steps["loss"].isna().all() and run.steps["grad_norm"].tolist() == [float("inf")]
        assert list(run.layers.columns) == ["step", "rank", "layer", "level", "grad_norm", "update_ratio"]
