"""Hangs, desyncs and dead ranks of real 2-rank gloo jobs under torchrun (tests/capture/faulty_ddp_loop.py).

Each job runs in its own session and is killed (its whole process group) when its test is done;
every wait has a generous bound, since the machine is shared.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from capture_loop import batch, tiny_model
from processes import JOB_BOUND_S, hang_events_of_every_rank, stop, wait_for

import gpuprof
from gpuprof.cli import main
from gpuprof.report import build_report

pytestmark = [pytest.mark.slow,  # multi-process
              pytest.mark.newest_torch]  # run again on the newest torch tested (scripts/test.sh)

LOOP = Path(__file__).with_name("faulty_ddp_loop.py")
# The watchdog beats every timeout / 4 and calls a rank silent after 3 beats: at 10 s, a loaded
# machine still leaves a beat more than twice its interval; a step here takes milliseconds.
HANG_TIMEOUT_S = 10
HANG_EVENT_BOUND_S = 60  # from the stuck step's start to the event in the run directory


@contextlib.contextmanager
def torchrun(run_dir: Path, *args: str, shutdown_timeout_s: int | None = None):
    """shutdown_timeout_s: how long torchrun waits for its workers after its SIGTERM before it kills them
    (its own default: 30 s), for a job whose ranks are blocked where no signal handler runs."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(LOOP), str(run_dir), *args]
    env = dict(os.environ)
    if shutdown_timeout_s is not None:
        env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(shutdown_timeout_s)
    log = open(run_dir.with_suffix(".log"), "w")  # noqa: SIM115 - closed below
    job = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        yield job
    finally:
        stop(job)
        log.close()


def test_a_rank_stuck_in_user_code_is_named_with_its_stack_while_the_job_hangs(tmp_path, capsys):
    run_dir = tmp_path / "stuck"
    with torchrun(run_dir, "--fault", "stuck", "--rank", "1", "--at-step", "5",
                  "--hang-timeout-s", str(HANG_TIMEOUT_S)) as job:
        events = wait_for(lambda: hang_events_of_every_rank(run_dir, 5), job)
        assert job.poll() is None, "the job should still be hung"
    assert events, f"no hang event from each rank: {run_dir.with_suffix('.log').read_text()[-3000:]}"
    for event in events:
        details = event["details"]
        assert event["step"] == 5 and event["severity"] == "critical"
        assert details["behind_ranks"] == [1] and details["waiting_ranks"] == [0]
        stuck, waiting = details["ranks"]["1"], details["ranks"]["0"]
        assert stuck["step"] == 5 and stuck["phase"] == "data" and "read_next_shard" in stuck["where"]
        assert [frame["function"] for frame in stuck["stack"]][-1] == "read_next_shard"
        assert waiting["phase"] == "backward" and waiting["collective"]["kind"] == "all_reduce"
        assert any(frame["code"] == "loss.backward()" for frame in waiting["stack"])
        assert event["message"].startswith("rank 1 is at step 5 (data) in read_next_shard (faulty_ddp_loop.py:")
        assert "rank 0 has waited in backward's all_reduce" in event["message"]
        assert details["timeout_s"] == HANG_TIMEOUT_S and details["stalled_s"] >= HANG_TIMEOUT_S
    own = {event["rank"]: event["details"] for event in events}
    assert own[1]["phase"] == "data" and own[1]["collective"] is None
    main = next(stack for stack in own[1]["stacks"] if stack["main"])
    assert main["frames"][-1]["code"] == "time.sleep(3600)"
    assert {stack["thread"] for stack in own[0]["stacks"]} >= {"MainThread", "gpuprof-watchdog"}
    # what was recorded before the hang is still there: both ranks' first five steps
    run = gpuprof.load_run(run_dir)
    assert sorted(run.steps[run.steps["rank"] == 1]["step"]) == [0, 1, 2, 3, 4]
    # written within the bound of the stuck step's start (the end of step 4), while the job hung
    step_5_started = run.steps["time_unix_s"][run.steps["step"] == 4].max()
    assert all(event["time_unix_s"] - step_5_started <= HANG_EVENT_BOUND_S for event in events)
    # the job is gone now: torchrun's SIGTERM found rank 1 in its sleep, and it said so
    report = build_report(run_dir)
    stuck = report.rank_outcomes.set_index("rank").loc[1]
    assert stuck["status"] == "failed" and stuck["error"] == "terminated by SIGTERM"
    assert "in read_next_shard" in stuck["traceback"]
    # and the verdict says it hung, first
    assert report.verdict.bound == "failure"
    assert report.verdict.why.startswith("Hung at step 5: rank 1 is at step 5 (data) in read_next_shard")
    text = analyze(run_dir, capsys)
    assert text.startswith("Verdict: Stopped by a hang\n")
    assert "  hang        step 5, seen by rank " in text


def test_a_rank_that_skips_a_collective_is_a_desync_by_sequence_number(tmp_path):
    run_dir = tmp_path / "skip"
    # both ranks then wait inside gloo, where torchrun's SIGTERM is never handled: it kills them at once
    with torchrun(run_dir, "--fault", "skip", "--at-step", "3", "--hang-timeout-s", str(HANG_TIMEOUT_S),
                  shutdown_timeout_s=1) as job:
        events = wait_for(lambda: hang_events_of_every_rank(run_dir, 3), job)
        assert job.poll() is None
    assert events, run_dir.with_suffix(".log").read_text()[-3000:]
    for event in events:
        details = event["details"]
        assert details["waiting_ranks"] == [0, 1] and details["behind_ranks"] == []
        desync = details["desync"]
        assert desync["how"] == "flight_recorder"
        assert desync["by_rank"] == {"0": "all_reduce [[]]", "1": "barrier []"}
        assert details["ranks"]["0"]["collective"]["kind"] == "all_reduce"
        assert details["ranks"]["1"]["collective"]["kind"] == "barrier"
        assert f"desync: the ranks' collective #{desync['seq']} differs" in event["message"]


def finished_job(run_dir: Path, *args: str) -> None:
    with torchrun(run_dir, *args) as job:
        with contextlib.suppress(subprocess.TimeoutExpired):
            job.wait(timeout=JOB_BOUND_S)
        assert job.poll() is not None, f"the job did not end: {run_dir.with_suffix('.log').read_text()[-3000:]}"


def analyze(run_dir: Path, capsys) -> str:
    """`gpuprof analyze RUN_DIR`'s text (the CLI's own entry point, in this process)."""
    capsys.readouterr()
    assert main(["analyze", str(run_dir)]) == 0
    return capsys.readouterr().out


@pytest.mark.capture_may_switch_off  # the surviving rank's collectors see the broken process group
def test_a_rank_that_raises_is_named_with_its_traceback(tmp_path, capsys):
    run_dir = tmp_path / "raise"
    finished_job(run_dir, "--fault", "raise", "--rank", "1", "--at-step", "5")
    report = build_report(run_dir)
    outcomes = report.rank_outcomes.set_index("rank")
    assert outcomes.loc[1, "status"] == "failed" and outcomes.loc[1, "last_step"] == 4
    assert outcomes.loc[1, "error"] == "RuntimeError: bad batch on rank 1 at step 5"
    assert "in fail_here" in outcomes.loc[1, "traceback"]
    assert outcomes.loc[0, "status"] in ("failed", "incomplete")  # stopped by torchrun, or by the broken group
    assert report.verdict.bound == "failure"
    text = analyze(run_dir, capsys)
    assert text.startswith("Verdict: Stopped by an exception (RuntimeError)")
    assert "rank 1 failed after step 4 (RuntimeError: bad batch on rank 1 at step 5 at fail_here (faulty_ddp_loop.py:" in text
    finding = next(f for f in report.findings if f.rule == "ranks-never-finished")
    assert finding.evidence["first_to_stop"] == 1 and finding.evidence["raised_at"].startswith("fail_here (")
    assert finding.fix.startswith("Start from rank 1 (the first to stop) where it raised RuntimeError")


@pytest.mark.capture_may_switch_off
def test_a_rank_killed_with_sigkill_is_named_with_its_last_step(tmp_path, capsys):
    run_dir = tmp_path / "kill"
    # steps longer than the writer's buffer (1 s), so that what the kill loses is the last step at most
    finished_job(run_dir, "--fault", "kill", "--rank", "1", "--at-step", "5", "--step-sleep-s", "1.2")
    report = build_report(run_dir)
    outcomes = report.rank_outcomes.set_index("rank")
    assert outcomes.loc[1, "status"] == "incomplete" and pd.isna(outcomes.loc[1, "traceback"])
    assert 3 <= outcomes.loc[1, "last_step"] <= 4
    assert outcomes.loc[0, "status"] != "finished"
    text = analyze(run_dir, capsys)
    # rank 0's collective then fails on the broken connection: a consequence, not the first to stop
    assert text.startswith("Verdict: Stopped by a dead rank")
    assert f"rank 1 stopped after step {outcomes.loc[1, 'last_step']} with no traceback" in text
    finding = next(f for f in report.findings if f.rule == "ranks-never-finished")
    assert finding.evidence["first_to_stop"] == 1 and "dmesg" in finding.fix


def test_a_straggler_under_ddp_is_the_rank_that_arrives_last(tmp_path):
    run_dir = tmp_path / "straggler"
    # a delay long against a step of this loaded machine, so that the rule's share of step time is reached
    finished_job(run_dir, "--fault", "straggler", "--rank", "1", "--delay-ms", "1000", "--steps", "10")
    run = gpuprof.load_run(run_dir)
    assert run.rank_meta[0]["status"] == run.rank_meta[1]["status"] == "finished"
    first = run.steps.assign(arrival_unix_s=run.steps["collective_arrivals_unix_s"].str[0])  # DDP's first bucket
    arrivals = first.pivot(index="step", columns="rank", values="arrival_unix_s")
    assert arrivals.notna().all().all()
    late = (arrivals[1] - arrivals[0]).median()
    assert late >= 0.5  # rank 1 sleeps 1 s before its forward: it reaches the all-reduce about that much later
    report = build_report(run_dir)
    finding = next(f for f in report.findings if f.rule == "late-arrival")
    assert finding.severity == "warning" and finding.evidence["last_rank"] == 1
    assert finding.evidence["last_share_pct"] >= 80
    assert finding.title.startswith("Rank 1 arrives last at the step's collective 1 in ")


def slow_io(seconds: float) -> None:
    time.sleep(seconds)


def test_one_process_stalled_past_its_timeout_records_a_hang_then_its_end(tmp_path):
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    timeout_s = 2.0  # one process: no other rank's beats to wait for, it beats every 0.5 s
    with gpuprof.profile(tmp_path / "run", model=model, optimizer=optimizer, numerics=False,
                         hang_timeout_s=timeout_s) as prof:
        for step in range(5):
            if step == 3:
                slow_io(3 * timeout_s)
            tokens = batch(step)
            model(input_ids=tokens, labels=tokens).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step()
    run = gpuprof.load_run(tmp_path / "run")
    # a loaded machine may stall other steps too: the one at step 3 is certain
    hangs = run.events[(run.events["kind"] == "hang") & (run.events["step"] == 3)]
    assert len(hangs) == 1
    details = hangs["details"].iloc[0]
    assert details["phase"] == "data" and details["behind_ranks"] == [0] and details["collective"] is None
    assert details["ranks"]["0"]["where"] == "slow_io (test_capture_hangs.py:{}): time.sleep(seconds)".format(
        slow_io.__code__.co_firstlineno + 1)
    assert [f["function"] for f in details["stacks"][0]["frames"]][-2:] == [
        "test_one_process_stalled_past_its_timeout_records_a_hang_then_its_end", "slow_io"]
    ended = run.events[run.events["kind"] == "hang_ended"]
    assert 3 in ended["step"].tolist()
    report = build_report(tmp_path / "run")
    assert report.hangs["ended"].all() and report.verdict.bound != "failure"
    assert report.rank_outcomes["status"].tolist() == ["finished"]
    beats = run.heartbeats
    assert (beats["step"] == 3).any() and beats["stalled_s"].max() >= timeout_s
