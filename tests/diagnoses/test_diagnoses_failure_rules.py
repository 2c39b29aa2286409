"""The rules about runs that stopped (`rank-hang`, `ranks-never-finished`) and `late-arrival`, on runs
written through the real RunWriter with the records capture writes (the torchrun jobs that produce
them for real are in tests/capture/test_capture_hangs.py)."""

from __future__ import annotations

import pytest

from gpuprof.cli.run_report import stopped_lines
from gpuprof.diagnoses import diagnose
from gpuprof.report import build_report
from gpuprof.run.schema import EventKind
from gpuprof.run.writer import RunWriter

from diagnoses_helpers import STEP_TIME_S, second_rank


def findings_of(run, rule: str) -> list:
    return [finding for finding in diagnose(run) if finding.rule == rule]


def arrival(rank: int, late_rank: int, lag_s: float):
    """Two collectives a step: the loss all-reduced for logging after the update, where every rank is in step,
    then DDP's first gradient bucket, which `late_rank` reaches `lag_s` late, its data phase as much longer."""
    def step(index):
        start_s, late_s = 1000.0 + STEP_TIME_S * index, lag_s if rank == late_rank else 0.0
        return {"collective_arrivals_unix_s": [start_s, start_s + 0.05 + late_s], "data_time_s": 0.01 + late_s}

    return step


def test_the_rank_that_arrives_last_at_a_collective_is_the_straggler_with_its_slower_phase(write_cpu_run):
    run = write_cpu_run(meta={"world_size": 2}, step=arrival(0, late_rank=1, lag_s=0.08))
    run = second_rank(run, step=arrival(1, late_rank=1, lag_s=0.08))
    [finding] = findings_of(run, "late-arrival")
    assert finding.severity == "warning" and finding.category == "communication"
    evidence = finding.evidence
    assert evidence["last_rank"] == 1 and evidence["last_in_steps"] == evidence["steps"] and evidence["collective"] == 1
    assert evidence["lag_p50_s"] == pytest.approx(0.04)  # 80 ms after rank 0: 40 ms after the median of two
    assert (evidence["slower_phase"], evidence["slower_phase_excess_s"]) == ("data", pytest.approx(0.08))
    assert finding.title == (f"Rank 1 arrives last at the step's collective 2 in {evidence['steps']} of {evidence['steps']} "
                             "steps, 40 ms after the median rank: its data takes 80 ms more per step than the other ranks'")
    report = build_report(run.path)  # rank 1's 80 ms more of data is also more own work: rank-straggler, ranked first
    stragglers = {f.rule: f.est_gain_pct for f in report.findings if f.rule in ("late-arrival", "rank-straggler")}
    assert stragglers == {"rank-straggler": pytest.approx(40), "late-arrival": pytest.approx(20)}
    verdict = report.verdict  # the others' wait bounds the step
    assert (verdict.bound, verdict.share_pct, verdict.subject) == ("communication", pytest.approx(40), "waiting for rank 1")


def test_a_different_last_rank_each_step_is_jitter_and_no_lag_is_nothing(write_cpu_run):
    def alternating(rank: int):
        return lambda index: arrival(rank, late_rank=index % 2, lag_s=0.08)(index)

    # 21 steps, the first of them warm-up: each rank is last in 10 of the 20 measured
    run = second_rank(write_cpu_run(meta={"world_size": 2}, step=alternating(0), steps=21), step=alternating(1), steps=21)
    [finding] = findings_of(run, "late-arrival")
    assert finding.evidence["last_share_pct"] == 50
    assert finding.severity == "info" and finding.title.startswith("A different rank arrives last")
    even = second_rank(write_cpu_run(meta={"world_size": 2}, step=arrival(0, 1, 0.0005)), step=arrival(1, 1, 0.0005))
    assert not findings_of(even, "late-arrival")  # 0.25 ms: under STRAGGLER_LAG_MIN_S


def hang_event(rank: int, *, behind: list[int], waiting: list[int], time_unix_s: float) -> dict:
    message = "rank 1 is at step 12 (data) in read_next_shard (train.py:31): time.sleep(3600); " \
              "rank 0 has waited in backward's all_reduce (#40) for 25 s"
    return {"time_unix_s": time_unix_s, "rank": rank, "step": 12, "kind": EventKind.HANG, "severity": "critical",
            "message": message, "details": {"behind_ranks": behind, "waiting_ranks": waiting, "desync": None,
                                            "ranks": {"1": {"stack": [{"file": "train.py", "line": 31,
                                                                       "function": "read_next_shard",
                                                                       "code": "time.sleep(3600)"}]}}}}


def test_an_open_hang_is_the_verdict_and_one_that_ended_is_not(write_cpu_run):
    run = write_cpu_run(meta={"world_size": 2})
    run = second_rank(run, status="failed", steps=12,
                      events=[hang_event(1, behind=[1], waiting=[0], time_unix_s=1010.0)])
    [finding] = findings_of(run, "rank-hang")
    assert finding.severity == "critical" and finding.category == "failure"
    assert finding.title.startswith("Hung at step 12: rank 1 is at step 12 (data) in read_next_shard")
    assert finding.evidence["behind_ranks"] == [1] and finding.evidence["waiting_ranks"] == [0]
    report = build_report(run.path)
    assert report.verdict.bound == "failure" and report.verdict.headline == "Stopped by a hang"
    assert report.verdict.why == f"{finding.title}."
    assert stopped_lines(report)[-1] == f"  hang        step 12, seen by rank 1: {report.hangs['message'].iloc[0]}"
    assert report.hangs["stacks"].iloc[0] == {1: '  File "train.py", line 31, in read_next_shard\n    time.sleep(3600)'}
    ended = second_rank(write_cpu_run(meta={"world_size": 2}), events=[
        hang_event(1, behind=[1], waiting=[0], time_unix_s=1010.0),
        {"time_unix_s": 1030.0, "rank": 1, "step": 12, "kind": EventKind.HANG_ENDED, "severity": "info",
         "message": "step 12 went on after the hang", "details": {}}])
    assert not findings_of(ended, "rank-hang") and build_report(ended.path).verdict.bound != "failure"


def test_ranks_that_failed_or_vanished_are_named_the_first_to_stop_first(write_cpu_run):
    failure = {"time_unix_s": 1003.0, "rank": 1, "step": 8, "kind": EventKind.RANK_FAILED, "severity": "critical",
               "message": "rank 1 failed at step 8: RuntimeError: bad shard", "details": {
                   "error": "RuntimeError: bad shard", "traceback": "Traceback ...\nRuntimeError: bad shard\n"}}
    run = second_rank(write_cpu_run(meta={"world_size": 2}), status="failed", steps=8, events=[failure])
    [finding] = findings_of(run, "ranks-never-finished")
    assert finding.title == "1 of 2 ranks never finished: rank 1 failed after step 7 (RuntimeError: bad shard)"
    assert finding.evidence["first_to_stop"] == 1 and finding.evidence["status_by_rank"] == {1: "failed"}
    # a rank that never closed, recorded elsewhere, silent for longer than three beats: killed outside Python
    killed = second_rank(write_cpu_run(meta={"world_size": 2}), status="running", steps=5)
    [finding] = findings_of(killed, "ranks-never-finished")
    assert finding.evidence["status_by_rank"] == {1: "incomplete"}
    assert "rank 1 stopped after step 4 with no traceback" in finding.title
    assert not findings_of(second_rank(write_cpu_run(meta={"world_size": 2})), "ranks-never-finished")


def test_ranks_that_never_joined_a_process_group_are_said_to_train_alone_and_none_is_a_straggler(write_cpu_run):
    """The same lagging rank 1, in processes that never joined a process group: nobody waited for it."""
    alone = {"world_size": 2, "process_group": False}
    run = second_rank(write_cpu_run(meta=alone, step=arrival(0, late_rank=1, lag_s=0.08)),
                      step=arrival(1, late_rank=1, lag_s=0.08))
    [finding] = findings_of(run, "independent-ranks")
    assert finding.severity == "warning" and finding.evidence == {"world_size": 2, "ranks_recorded": 2}
    assert not findings_of(run, "late-arrival") and not findings_of(run, "rank-straggler")
    grouped = second_rank(write_cpu_run(meta={**alone, "process_group": True}), steps=20)
    assert not findings_of(grouped, "independent-ranks")
