"""Other processes on the run's host: the run's own CPU is told from theirs, and a run that competed for
its cores says so (a finding, the verdict's why, a comparison's contract), on real runs with real busy
processes beside them."""

from __future__ import annotations

import dataclasses
import subprocess
import time

import psutil
import pytest

import gpuprof
from gpuprof.analysis.run.host_load import MIN_FOLLOWED_SAMPLES, HostLoad
from gpuprof.analysis.run.stats import Interval
from gpuprof.report import build_report, compare
from gpuprof.report.comparison import contract_lines
from gpuprof.report.contract import host_load_difference
from gpuprof.report.tuning import effect_text
from gpuprof.tune.trials import Trial, host_load_note
from processes import SPIN, spinner_outside_the_job

INTERVAL_S = 0.25
CPUS = psutil.cpu_count() or 1


@pytest.fixture(scope="module")
def contended(tmp_path_factory):
    """A run of light steps with one busy child (the job's own) and, beside it, a busy process per CPU that
    is not the job's: (run dir, the cores the child and this process used over the steps, on average)."""
    if CPUS > 16:
        pytest.skip("saturating this host takes more busy processes than a test should start")
    run_dir = tmp_path_factory.mktemp("host_load") / "run"
    others = [spinner_outside_the_job() for _ in range(CPUS)]
    child = psutil.Process(subprocess.Popen(SPIN).pid)
    try:
        with gpuprof.profile(run_dir, sample_interval_s=INTERVAL_S, stack_interval_s=0) as prof:
            start = job_cpu_s(child), time.time()
            for _ in range(60):
                time.sleep(0.05)
                prof.step()
            end = job_cpu_s(child), time.time()
    finally:
        child.kill()
        for pid in others:
            psutil.Process(pid).kill()
    return run_dir, (end[0] - start[0]) / (end[1] - start[1]), (start[1], end[1])


def job_cpu_s(child: psutil.Process) -> float:
    return sum(sum(process.cpu_times()[:2]) for process in (child, psutil.Process()))


def test_the_jobs_cpu_counts_its_children_and_not_other_processes(contended):
    run_dir, used_cores, (start_s, end_s) = contended
    system = gpuprof.load_run(run_dir).system.dropna(subset=["job_cpu_pct"])
    # the samples whose whole interval lies within the steps
    during = system[(system["time_unix_s"] >= start_s + INTERVAL_S) & (system["time_unix_s"] <= end_s)]
    recorded_cores = float(during["job_cpu_pct"].mean()) * CPUS / 100
    assert len(during) >= 4
    # the busy child is the job's (about a core, less when the busy others take their share); the others are not
    assert 0.7 * used_cores <= recorded_cores <= 1.3 * used_cores + 0.05, (recorded_cores, used_cores)
    assert (system["host_cpu_pct"] >= system["job_cpu_pct"] - 1).all()


def test_a_run_beside_busy_processes_is_told_it_competed_for_its_cores(contended):
    report = build_report(contended[0])
    [finding] = [finding for finding in report.findings if finding.rule == "host-contention"]
    assert finding.evidence["other_cpu_cores"] >= 0.5 * CPUS - 0.5  # one busy process per CPU, the child beside
    assert finding.evidence["host_cpu_count"] == CPUS
    assert finding.title.startswith("Other processes held ")
    assert "taskset" in finding.fix
    assert report.verdict.why.startswith("These timings measure the host's other jobs too: other processes held ")
    assert "host-contention" not in report.verdict.next_step


QUIET = HostLoad(cpu_count=CPUS, samples=10, other_cpu_cores=0.0, saturated_pct=0.0, slow_steps_other_cpu_cores=0.0,
                 slow_steps_saturated_pct=0.0, other_steps_other_cpu_cores=0.0)


def test_a_comparison_lists_a_difference_in_host_load(contended):
    report = build_report(contended[0])
    assert not any(line.startswith("host load") for line in contract_lines(compare(report, report)))
    quiet = QUIET
    difference = host_load_difference(quiet, report.host_load)
    assert difference.text.startswith(f"host load: A 0.0 of {CPUS} CPUs taken by other processes, B ")
    assert not difference.blocks
    assert host_load_difference(quiet, None) is None  # neither competed, as far as was recorded
    assert "(not recorded)" in host_load_difference(None, report.host_load).a


def test_tune_warns_of_a_trial_run_under_another_load(contended):
    report = build_report(contended[0])
    trial = Trial("tf32", ("tf32",), str(contended[0]), status="measured")
    assert host_load_note(trial, report, (report, None)) is None and not trial.host_load_caveat  # not measured yet
    note = host_load_note(trial, report, (dataclasses.replace(report, host_load=QUIET), None))
    assert note.startswith(f"tf32 and a baseline beside it ran under different loads (0.0 of {CPUS} CPUs taken")
    assert trial.host_load_caveat and note.endswith("part of its figure may be the load's; tune again on a quiet "
                                                    "machine to be sure")
    assert effect_text(trial.to_dict()).endswith("(under host load)")


@pytest.mark.parametrize("point, low, high, effect", [(1.2, 1.1, 1.3, "faster"), (0.8, 0.7, 0.9, "slower")])
def test_tune_warns_of_a_gain_or_loss_measured_while_the_host_was_contended_under_an_equal_load(
        contended, point, low, high, effect):
    """The same median load beside the trial and its baselines still takes a different share of each run."""
    report = build_report(contended[0])
    trial = Trial("tf32", ("tf32",), str(contended[0]), status="measured", speedup=Interval(point, low, high, 0.95))
    note = host_load_note(trial, report, (report, report))
    cores = report.host_load.other_cpu_cores
    assert note == (f"tf32 read {effect} while other processes held up to {cores:.1f} of {CPUS} CPUs in it or a "
                    "baseline beside it: their share of each run moves from step to step, so part of its figure "
                    "may be the load's; tune again on a quiet machine to be sure")
    assert trial.host_load_caveat and effect_text(trial.to_dict()) == f"{effect} (under host load)"
    within = Trial("tf32", ("tf32",), str(contended[0]), status="measured", speedup=Interval(1.01, 0.97, 1.05, 0.95))
    assert host_load_note(within, report, (report, report)) is None and not within.host_load_caveat
    quiet = dataclasses.replace(report, host_load=QUIET)
    calm = Trial("tf32", ("tf32",), str(contended[0]), status="measured", speedup=Interval(point, low, high, 0.95))
    assert host_load_note(calm, quiet, (quiet, None)) is None and not calm.host_load_caveat


def test_tune_warns_of_a_gain_measured_where_the_load_was_not_followed(contended):
    """A run of a second, sampled once: a burst of other work before or after that sample goes unseen."""
    quiet = dataclasses.replace(build_report(contended[0]), host_load=QUIET)
    brief = dataclasses.replace(quiet, host_load=dataclasses.replace(QUIET, samples=MIN_FOLLOWED_SAMPLES - 1))
    unrecorded = dataclasses.replace(quiet, host_load=None)
    for runs in ((brief, quiet, quiet), (quiet, brief, None), (quiet, quiet, unrecorded)):
        trial = Trial("tf32", ("tf32",), str(contended[0]), status="measured", speedup=Interval(1.2, 1.1, 1.3, 0.95))
        note = host_load_note(trial, runs[0], runs[1:])
        assert note.startswith("tf32 read faster over runs too short for gpuprof to follow other processes' load "
                               f"(1 of them with under {MIN_FOLLOWED_SAMPLES} host samples"), note
        assert trial.host_load_caveat
    followed = Trial("tf32", ("tf32",), str(contended[0]), status="measured", speedup=Interval(1.2, 1.1, 1.3, 0.95))
    assert host_load_note(followed, quiet, (quiet, None)) is None and not followed.host_load_caveat
