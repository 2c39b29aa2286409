"""One trial: the script (or the reference workload) run in a child process with some knobs, measured
against the baseline run.

The child is `python -m gpuprof run --max-steps N --knob K ... SCRIPT ARGS` (or `gpuprof train FLAGS
--steps N` with each knob's flags), in its own session with its own time budget: a trial that fails,
hangs or diverges is reported as such and the next one runs. Its figures come from its run directory:
step times after warm-up against the baseline's (a speedup with its bootstrap interval,
gpuprof.analysis.run.stats), the losses of the same steps (numerics parity), the verdict.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from gpuprof.analysis.run.host_load import MIN_FOLLOWED_SAMPLES
from gpuprof.analysis.run.stats import Interval, TooFewStepsError, loss_diverges, loss_shift_interval, speedup_interval
from gpuprof.diagnoses.knob import all_knobs
from gpuprof.errors import GpuprofError
from gpuprof.report.contract import host_load_difference

# A gain (or loss) counts once its whole interval clears 1 and its point is at least this far from it:
# the ±5 % interval tune aims for does not tell smaller effects from the machine's drift.
MIN_EFFECT_REL = 0.05
# Losses this close (relative), step by step, are the same numbers: a same-seed script compared as itself.
SAME_LOSS_REL = 1e-6
LOG_LINES_KEPT = 1
RANK_POLL_S = 0.5
BUDGET_RANKS_S = 600.0  # the longest a rank waits for the others' recordings when the trial has no budget
# What a run on a GPU samples at anyway: a trial of small CPU steps lasts about a second, and other processes'
# load on the host is followed only from several samples of it (host_load.MIN_FOLLOWED_SAMPLES).
SAMPLE_INTERVAL_S = 0.1


@dataclass(frozen=True)
class ScriptTarget:
    """An unmodified script, run under `gpuprof run`."""

    script: str
    args: tuple[str, ...] = ()

    @property
    def title(self) -> str:
        return " ".join([self.script, *self.args])

    def command(self, run_dir: Path, knobs: tuple[str, ...], steps: int, extra: tuple[str, ...] = ()) -> list[str]:
        knob_flags = [flag for name in knobs for flag in ("--knob", name)]
        return [sys.executable, "-m", "gpuprof", "run", "--run-dir", str(run_dir), "--max-steps", str(steps),
                "--sample-interval", str(SAMPLE_INTERVAL_S), *knob_flags, self.script, *self.args]

    def knobs(self) -> list[str]:
        return list(all_knobs())


@dataclass(frozen=True)
class WorkloadTarget:
    """The GPT-2 reference workload, `gpuprof train FLAGS`: knobs are its own flags."""

    flags: tuple[str, ...] = ()

    @property
    def title(self) -> str:
        return " ".join(["gpuprof train", *self.flags])

    def command(self, run_dir: Path, knobs: tuple[str, ...], steps: int, extra: tuple[str, ...] = ()) -> list[str]:
        known = all_knobs()
        knob_flags = [flag for name in knobs for flag in known[name].train_flags]
        return [sys.executable, "-m", "gpuprof", "train", *self.flags, *extra, *knob_flags, "--steps", str(steps),
                "--run-dir", str(run_dir), "--sample-interval", str(SAMPLE_INTERVAL_S)]

    def knobs(self) -> list[str]:
        return [name for name, knob in all_knobs().items() if knob.train_flags]

    def flags_with(self, knobs: tuple[str, ...]) -> list[str]:
        known = all_knobs()
        return [*self.flags, *(flag for name in knobs for flag in known[name].train_flags)]


def effect_of(speedup: Interval) -> str:
    """faster, slower or within noise: the interval clears 1 and its point MIN_EFFECT_REL."""
    if speedup.low > 1 and speedup.point >= 1 + MIN_EFFECT_REL:
        return "faster"
    if speedup.high < 1 and speedup.point <= 1 - MIN_EFFECT_REL:
        return "slower"
    return "within noise"


@dataclass
class Trial:
    """What a trial ran and what it measured; `speedup` is over the baseline (above 1: faster)."""

    name: str
    knobs: tuple[str, ...]
    run_dir: str
    status: str = "pending"  # measured | failed | timed out | nothing to change
    error: str | None = None
    wall_s: float | None = None
    measured_steps: int = 0
    step_time_mean_s: float | None = None
    speedup: Interval | None = None
    parity: dict = field(default_factory=dict)
    verdict: str | None = None
    edits: list = field(default_factory=list)
    # the finding behind the knob: its rule, and the speedup its expected gain amounts to
    rule: str | None = None
    estimate: float | None = None
    # other processes' work may hold part of the figure: they took a different share of the host's CPUs in the
    # trial and in a baseline beside it, or contended for its cores in either (host_load_note)
    host_load_caveat: bool = False

    @property
    def effect(self) -> str | None:
        """faster, slower or within noise; None when not measured."""
        return None if self.speedup is None else effect_of(self.speedup)

    @property
    def helped(self) -> bool:
        return self.effect == "faster" and self.parity.get("status") != "diverged"

    @property
    def estimate_miss(self) -> float | None:
        """How many times the estimated saving of step time exceeds the measured one (below 1: it fell short);
        None without both, or when nothing was saved (see `estimate_missed`)."""
        if self.estimate is None or self.speedup is None or self.speedup.point <= 1 or self.estimate <= 1:
            return None
        return (1 - 1 / self.estimate) / (1 - 1 / self.speedup.point)

    def estimate_missed(self, factor: float) -> bool:
        """Whether the estimate lies outside the measured interval and is off its saving by more than `factor`
        (or promised a gain where none was measured)."""
        if self.estimate is None or self.speedup is None or self.status != "measured" or self.speedup.contains(self.estimate):
            return False
        miss = self.estimate_miss
        return miss is None or not 1 / factor <= miss <= factor

    def to_dict(self) -> dict:
        return {
            "name": self.name, "knobs": list(self.knobs), "run_dir": self.run_dir, "status": self.status,
            "error": self.error, "wall_s": self.wall_s, "measured_steps": self.measured_steps,
            "step_time_mean_s": self.step_time_mean_s,
            "speedup": self.speedup.to_dict() if self.speedup else None, "effect": self.effect,
            "rule": self.rule, "estimate": self.estimate, "estimate_miss": self.estimate_miss,
            "parity": self.parity, "verdict": self.verdict, "edits": self.edits,
            "host_load_caveat": self.host_load_caveat,
        }


def launch(target, trial: Trial, steps: int, budget_s: float | None, extra: tuple[str, ...] = ()) -> None:
    """Runs the trial's child process to its end, or kills it at `budget_s`; its output goes to RUN_DIR.log."""
    run_dir = Path(trial.run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    rank = os.environ.get("RANK", "0")  # under torchrun every rank runs its own child into the same run
    log_path = run_dir.with_suffix(".log" if rank == "0" else f".rank{rank}.log")
    started = time.monotonic()
    with open(log_path, "w") as log:
        child = subprocess.Popen(target.command(run_dir, trial.knobs, steps, extra), stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True, env=_world_env(run_dir))
        try:
            code = child.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            _kill(child)
            code = None
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        wait_for_ranks(run_dir, world_size, budget_s or BUDGET_RANKS_S)
    trial.wall_s = time.monotonic() - started
    if code is None:
        trial.status, trial.error = "timed out", f"stopped after its budget of {budget_s:.0f} s (log: {log_path})"
    elif code != 0:
        trial.status, trial.error = "failed", f"exit code {code}: {_last_line(log_path)} (log: {log_path})"


def _world_env(run_dir: Path) -> dict:
    """The child's environment. Under torchrun the ranks' children of one trial form a world of their own:
    torchrun's agent store still holds the addresses of the world before (the baseline's), which the next
    world's ranks would try to reach, so each trial's rank 0 child hosts a store of its own, on a port that
    tune's rank 0 picks and leaves beside the trial's run (RUN_DIR.port) for the other ranks."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return dict(os.environ)
    port_file = run_dir.with_suffix(".port")
    if os.environ.get("RANK", "0") == "0":
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = str(sock.getsockname()[1])
        partial = port_file.with_suffix(".port.partial")
        partial.write_text(port)
        partial.replace(port_file)  # whole or absent, never half-written
    else:
        port = await_file(port_file, lambda text, _: text.isdigit(), BUDGET_RANKS_S)
        if port is None:
            raise GpuprofError(f"rank 0 left no port for {run_dir.name} in {BUDGET_RANKS_S:.0f} s ({port_file})")
    return {**os.environ, "TORCHELASTIC_USE_AGENT_STORE": "False", "MASTER_PORT": port}


def await_file(path: Path, accept: Callable[[str, os.stat_result], bool], timeout_s: float) -> str | None:
    """The text of `path` once it exists and `accept(text, its stat)`; None after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            text = path.read_text()
            if accept(text, path.stat()):
                return text
        except OSError:
            pass
        time.sleep(RANK_POLL_S)
    return None


def wait_for_ranks(run_dir: Path, world_size: int, timeout_s: float) -> None:
    """Under torchrun: until every rank's recording of the trial is closed, so that every rank's tune reads
    the same files and decides the same next trial."""
    from gpuprof.run.reader import Run

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            metas = Run(run_dir).rank_meta
        except GpuprofError:
            metas = {}
        if len(metas) >= world_size and all(meta.get("status") != "running" for meta in metas.values()):
            return
        time.sleep(RANK_POLL_S)


def read(trial: Trial, baseline) -> "object | None":
    """The trial's report, with its figures measured against `baseline` (the baseline's report; None: it is
    the baseline); None when the trial left no readable run."""
    from gpuprof.report import build_report

    try:
        report = build_report(trial.run_dir)
    except GpuprofError as error:
        if trial.status == "pending":
            trial.status, trial.error = "failed", str(error)
        return None
    times = report.summary.measured_step_times
    trial.measured_steps = len(times)
    trial.step_time_mean_s = float(times.mean()) if len(times) else None
    trial.verdict = report.verdict.headline
    trial.edits = [edit for name in trial.knobs for edit in (report.meta.get("config") or {}).get("knobs", {}).get(name, [])]
    if baseline is None:
        trial.status = "measured" if trial.status == "pending" else trial.status
        return report
    if trial.status == "pending":
        try:
            trial.speedup = speedup_interval(baseline.summary.measured_step_times.to_numpy(), times.to_numpy())
            trial.status = "measured"
        except TooFewStepsError as error:
            trial.status, trial.error = "failed", str(error)
    trial.parity = parity(baseline, report)
    return report


def bracket(trial: Trial, report, before, after) -> None:
    """Times a measured trial against the baseline runs either side of it (reports; `after` None when its
    rerun failed): the interval spans both comparisons, so the machine's speed drifting between runs widens
    it instead of reading as the knob's effect."""
    if trial.status != "measured" or report is None:
        return
    times = report.summary.measured_step_times.to_numpy()
    intervals = []
    for baseline in (run for run in (before, after) if run is not None):
        try:
            intervals.append(speedup_interval(baseline.summary.measured_step_times.to_numpy(), times))
        except TooFewStepsError:
            continue
    if not intervals:
        return
    trial.speedup = Interval(_bracketed_point([interval.point for interval in intervals]), min(i.low for i in intervals),
                             max(i.high for i in intervals), intervals[0].confidence)


def _bracketed_point(points: list[float]) -> float:
    """The trial's speedup from its comparisons with the baselines either side: where both read faster (or both
    slower) the one nearer 1, the least flattering, so that a knob gains only by what it gains over each;
    where they disagree, the machine drifted across the trial, and their geometric mean sits between them."""
    if all(point > 1 for point in points) or all(point < 1 for point in points):
        return min(points, key=lambda point: abs(math.log(point)))
    return math.prod(points) ** (1 / len(points))


RETUNE_QUIETLY = "tune again on a quiet machine to be sure"  # the advice for a figure another host load may hold


def host_load_note(trial: Trial, report, baselines) -> str | None:
    """The warning that other processes' work may hold part of the trial's figure; marks the trial. Either the
    trial's share of that work differs from a baseline report's beside it (gpuprof.report.contract.
    host_load_difference), or a gain or loss was measured where the load was not followed (a run with too few
    host samples, gpuprof.analysis.run.host_load.MIN_FOLLOWED_SAMPLES), or while they contended for the host's
    cores in the trial or a baseline: the same median load still takes a different share of each run from step
    to step.
    A warning, not a veto: a loop waiting on its loader gains from workers whatever the load, and CI's own
    machine is shared."""
    beside = [run for run in baselines if run is not None]
    for baseline in beside:
        difference = host_load_difference(baseline.host_load, report.host_load)
        if difference is not None:
            trial.host_load_caveat = True
            return (f"{trial.name} and a baseline beside it ran under different loads ({difference.a} against "
                    f"{difference.b} in the trial): part of its figure may be the load's; {RETUNE_QUIETLY}")
    if trial.effect in (None, "within noise"):
        return None
    unfollowed = [run for run in (report, *beside) if run.host_load is None or not run.host_load.followed]
    if unfollowed:
        trial.host_load_caveat = True
        return (f"{trial.name} read {trial.effect} over runs too short for gpuprof to follow other processes' load "
                f"({len(unfollowed)} of them with under {MIN_FOLLOWED_SAMPLES} host samples in their measured "
                f"steps): part of its figure may be the load's; {RETUNE_QUIETLY}")
    contended = [run.host_load for run in (report, *beside) if run.host_load is not None and run.host_load.contended]
    if not contended:
        return None
    trial.host_load_caveat = True
    cores = max(load.other_cpu_cores for load in contended)
    return (f"{trial.name} read {trial.effect} while other processes held up to {cores:.1f} of "
            f"{contended[0].cpu_count} CPUs in it or a baseline beside it: their share of each run moves from step "
            f"to step, so part of its figure may be the load's; {RETUNE_QUIETLY}")


def parity(baseline, report) -> dict:
    """The trial's loss curve against the baseline's over the same steps: the same numbers (a same-seed
    script), within the noise, or diverged (also: non-finite where the baseline was finite)."""
    a = _losses(baseline)
    b = _losses(report)
    common = a.index.intersection(b.index)
    if len(common) == 0:
        return {"status": "not recorded", "steps": 0}
    a, b = a[common], b[common]
    finite_a = a.map(math.isfinite)
    finite_b = b.map(math.isfinite)
    if (finite_a & ~finite_b).any():
        return {"status": "diverged", "steps": len(common), "reason": "non-finite losses the baseline did not have"}
    a, b = a[finite_a & finite_b], b[finite_a & finite_b]
    max_rel = float(((b - a).abs() / a.abs().clip(lower=1e-12)).max()) if len(a) else None
    result = {"steps": len(a), "max_rel_diff": max_rel}
    if max_rel is not None and max_rel <= SAME_LOSS_REL:
        return {"status": "identical", **result}
    try:
        shift = loss_shift_interval(a.to_numpy(), b.to_numpy())
        diverged = loss_diverges(a.to_numpy(), b.to_numpy())
    except TooFewStepsError:
        return {"status": "too few steps", **result}
    return {"status": "diverged" if diverged else "within noise", "loss_shift": shift.to_dict(), **result}


def _losses(report):
    steps = report.run.steps
    if "loss" not in steps.columns:
        import pandas as pd

        return pd.Series(dtype=float)
    losses = steps.groupby("step")["loss"].mean().dropna().astype(float)
    # a run that began recording after the script's first iteration numbers its second one step 0
    if str((report.meta.get("config") or {}).get("first_iteration", "")).startswith("not recorded"):
        losses.index = losses.index + 1
    return losses


def _kill(child: subprocess.Popen) -> None:
    """The child and everything it started (DataLoader workers, compile workers)."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.wait()


def _last_line(log_path: Path) -> str:
    try:
        lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no output"
    return " | ".join(lines[-LOG_LINES_KEPT:]) if lines else "no output"
