"""`gpuprof tune`: measure each fix the diagnoses recommend, one knob at a time, then together.

1. The baseline: the unmodified script (or workload) for N steps, N enough for a ±5 % interval on the
   mean step time (a pilot of PILOT_STEPS says how many; `steps` fixes it).
2. Its findings, each with the knobs that apply its fix from outside (gpuprof.diagnoses.knob): one trial
   per knob, that knob alone. Findings with no such knob are listed with their fix, to make by hand.
   After each trial the baseline runs again, and a trial is timed against the baseline runs either side
   of it: runs follow one another, and a machine whose speed drifts between them would otherwise make a
   knob that changes nothing read as faster or slower.
3. One trial combining the knobs that helped (faster beyond the noise, loss curve not diverged), and for
   the reference workload its optimized variant; tune says where either is slower than one of its own
   knobs alone (their intervals apart).
The winning set (the fastest trial that helped) ends in the diff a user applies to their own files.
The result is left in the folder as RESULT_FILE (its plain form), for the dashboard's Tune page.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil

from gpuprof.analysis.run.stats import Interval, TooFewStepsError, mean_interval, speedup_interval, steps_needed
from gpuprof.diagnoses.knob import all_knobs, knobs_of
from gpuprof.errors import GpuprofError
from gpuprof.run.jsonable import json_safe
from gpuprof.run.tune_result import RESULT_FILE
from gpuprof.run.writer import write_json_atomic
from gpuprof.tune.edits import diff_of
from gpuprof.tune.trials import (
    RETUNE_QUIETLY, Trial, WorkloadTarget, await_file, bracket, effect_of, host_load_note, launch, read,
)

PILOT_STEPS = 20
MAX_STEPS = 200
TARGET_REL_HALF_WIDTH = 0.05
# A trial may take this many times the baseline's wall time (compilation, workers starting) before it is stopped.
BUDGET_FACTOR = 4.0
BUDGET_MIN_S = 120.0
# Under torchrun: how the ranks after 0 wait for rank 0 to claim the out folder (`_claim`).
CLAIM_FILE = "tune.world"
CLAIM_WAIT_S = 120.0
CLAIM_CLOCK_SLACK_S = 2.0
# An estimate that misses the measured saving by more than this factor is called out (docs/rules.md).
ESTIMATE_MISS_FACTOR = 2.0


@dataclass
class TuneResult:
    target: str
    out_dir: str
    steps: int
    baseline: Trial
    baseline_step_time: Interval | None
    trials: list[Trial] = field(default_factory=list)
    baseline_reruns: list[Trial] = field(default_factory=list)  # the baseline again, after each trial
    by_hand: list[dict] = field(default_factory=list)  # findings whose fix no knob applies: rule, title, fix
    winner: Trial | None = None
    diff: str = ""
    diff_notes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def conclusion(self) -> str:
        if self.winner is None:
            tried = sum(trial.speedup is not None for trial in self.trials)
            return (f"No knob gained outside the noise ({tried} measured)" if tried
                    else "Nothing to try: no finding has a fix tune can apply from outside the script")
        parity = self.winner.parity.get("status", "not recorded")
        interval = self.winner.speedup
        load = (f"; measured while other processes loaded the host: {RETUNE_QUIETLY}"
                if self.winner.host_load_caveat else "")
        return (f"{' + '.join(self.winner.knobs)}: {interval.point:.2f}x faster (95% CI {interval.low:.2f}-"
                f"{interval.high:.2f}x), numerics {parity}{load}")

    def to_dict(self) -> dict:
        return {
            "target": self.target, "out_dir": self.out_dir, "steps": self.steps, "conclusion": self.conclusion,
            "baseline": self.baseline.to_dict(),
            "baseline_step_time_s": self.baseline_step_time.to_dict() if self.baseline_step_time else None,
            "trials": [trial.to_dict() for trial in self.trials],
            "baseline_reruns": [rerun.to_dict() for rerun in self.baseline_reruns], "by_hand": self.by_hand,
            "winner": self.winner.name if self.winner else None, "diff": self.diff, "diff_notes": self.diff_notes,
            "notes": self.notes,
        }


def tune(target, out_dir, *, steps: int | None = None, only: list[str] | None = None, budget_s: float | None = None,
         progress: Callable[[str], None] = lambda line: None) -> TuneResult:
    out = Path(out_dir)
    _claim(out)
    applicable = target.knobs()
    unknown = [name for name in only or () if name not in applicable]
    if unknown:
        raise GpuprofError(f"no knob {', '.join(unknown)} for {target.title}; choose from {', '.join(applicable)}")
    baseline, baseline_report, steps = _baseline(target, out, steps, budget_s, progress)
    budget_s = budget_s or max(BUDGET_MIN_S, BUDGET_FACTOR * baseline.wall_s)
    result = TuneResult(target.title, str(out), steps, baseline, _step_time_interval(baseline_report))
    plan, result.by_hand = _plan(target, baseline_report.findings, only)
    baselines = _Baselines(target, out, steps, budget_s, progress, result, first=baseline_report,
                           latest=baseline_report)
    for knob_name, finding in plan:
        trial = Trial(knob_name, (knob_name,), str(out / knob_name), rule=finding.rule if finding else None,
                      estimate=_estimated_speedup(finding))
        result.trials.append(_run(target, trial, baselines))
    helped = [trial for trial in result.trials if trial.helped]
    if len(helped) > 1:
        combined = Trial("combined", tuple(name for trial in helped for name in trial.knobs), str(out / "combined"))
        result.trials.append(_run(target, combined, baselines))
    if isinstance(target, WorkloadTarget) and only is None:
        optimized = Trial("optimized", (), str(out / "optimized"))
        result.trials.append(_run(target, optimized, baselines, extra=("--variant", "optimized")))
    _conclude(target, result)
    if os.environ.get("RANK", "0") == "0":  # whole or absent: the dashboard may read it at any time
        write_json_atomic(out / RESULT_FILE, json_safe(result.to_dict()))
    return result


@dataclass
class _Baselines:
    """The baseline's runs: the first, which every trial's numerics are held against, and the latest; rerun
    after each trial, so that the next trial has one before it and each trial one either side."""

    target: object
    out: Path
    steps: int
    budget_s: float
    progress: Callable[[str], None]
    result: TuneResult
    first: object
    latest: object

    def rerun_after(self, trial: Trial):
        """The baseline run again after `trial`: its report, or None when that run failed (noted)."""
        rerun = Trial(f"baseline-after-{trial.name}", (), str(self.out / f"baseline-after-{trial.name}"))
        self.progress(f"baseline again: {self.steps} steps")
        launch(self.target, rerun, self.steps, self.budget_s)
        report = read(rerun, None)
        self.result.baseline_reruns.append(rerun)
        if rerun.status != "measured" or report is None:
            self.result.notes.append(f"the baseline's run after {trial.name} {rerun.status}: {trial.name} is timed "
                                     f"against the run before it alone ({rerun.error})")
            return None
        self._note_drift(trial, report)
        self.latest = report
        return report

    def _note_drift(self, trial: Trial, report) -> None:
        try:
            drift = speedup_interval(self.latest.summary.measured_step_times.to_numpy(),
                                     report.summary.measured_step_times.to_numpy())
        except TooFewStepsError:
            return
        if effect_of(drift) != "within noise":
            self.result.notes.append(
                f"the machine's speed drifted around {trial.name}: the baseline ran {drift.point:.2f}x as fast after "
                f"it as before (95% CI {drift.low:.2f}-{drift.high:.2f}x); its interval spans both")


def _claim(out: Path) -> None:
    """Makes `out` this tune's own folder. Under torchrun every rank runs tune into the same folder: rank 0
    checks that it is empty and leaves a mark naming this world; the others write nothing before they see it."""
    world = ":".join(os.environ.get(name, "") for name in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                                                            "TORCHELASTIC_RESTART_COUNT"))
    mark = out / CLAIM_FILE
    if os.environ.get("RANK", "0") == "0":
        if out.exists() and any(out.iterdir()):
            raise GpuprofError(f"{out} is not empty: tune writes its trials into a folder of its own")
        out.mkdir(parents=True, exist_ok=True)
        mark.write_text(world)
        return
    started = psutil.Process().create_time()
    # a mark left by an earlier tune of the same world is older than this process
    if await_file(mark, lambda text, stat: text == world and stat.st_mtime >= started - CLAIM_CLOCK_SLACK_S,
                  CLAIM_WAIT_S) is None:
        raise GpuprofError(f"rank 0 did not claim {out} within {CLAIM_WAIT_S:.0f} s")


def _baseline(target, out: Path, steps: int | None, budget_s, progress):
    """The baseline trial and its report, and the steps every trial runs: `steps`, else enough for a
    ±TARGET_REL_HALF_WIDTH interval on the mean step time, from a pilot of PILOT_STEPS (in out/pilot, which
    is the baseline when it already has enough)."""
    if steps is not None:
        baseline = Trial("baseline", (), str(out / "baseline"))
        return baseline, _measure_baseline(target, baseline, steps, budget_s, progress), steps
    pilot = Trial("baseline", (), str(out / "pilot"))
    report = _measure_baseline(target, pilot, PILOT_STEPS, budget_s, progress)
    needed = min(MAX_STEPS, steps_needed(report.summary.measured_step_times.to_numpy(), TARGET_REL_HALF_WIDTH))
    if needed <= pilot.measured_steps:
        return pilot, report, PILOT_STEPS
    baseline = Trial("baseline", (), str(out / "baseline"))
    return baseline, _measure_baseline(target, baseline, needed, budget_s, progress), needed


def _measure_baseline(target, baseline: Trial, steps: int, budget_s, progress):
    progress(f"baseline: {steps} steps of {target.title}")
    launch(target, baseline, steps, budget_s)
    report = read(baseline, None)
    if baseline.status != "measured" or report is None:
        raise GpuprofError(f"the baseline run failed, so there is nothing to compare against: {baseline.error}")
    return report


def _run(target, trial: Trial, baselines: _Baselines, extra=()) -> Trial:
    progress = baselines.progress
    progress(f"trial {trial.name}: {baselines.steps} steps")
    launch(target, trial, baselines.steps, baselines.budget_s, extra)
    report = read(trial, baselines.first)
    if trial.status == "measured" and not isinstance(target, WorkloadTarget) and trial.knobs and not trial.edits:
        trial.status = "nothing to change"
    if trial.status == "measured":
        before, after = baselines.latest, baselines.rerun_after(trial)
        bracket(trial, report, before, after)
        note = host_load_note(trial, report, (before, after))
        if note is not None:
            baselines.result.notes.append(note)
    progress(f"trial {trial.name}: {trial.status}"
             + (f", {trial.speedup.point:.2f}x ({trial.speedup.low:.2f}-{trial.speedup.high:.2f})" if trial.speedup else ""))
    return trial


def _plan(target, findings, only: list[str] | None) -> tuple[list[tuple[str, object]], list[dict]]:
    """(knob, the finding recommending it or None) to try, in the findings' order; and the findings whose
    fix no knob the target can apply makes."""
    applicable = set(target.knobs())
    plan: dict[str, object] = {}
    by_hand = []
    for finding in findings:
        knobs = [knob.name for knob in knobs_of(finding.rule) if knob.name in applicable]
        for name in knobs:
            plan.setdefault(name, finding)
        if not knobs:
            by_hand.append({"rule": finding.rule, "title": finding.title, "fix": finding.fix})
    if isinstance(target, WorkloadTarget):  # the reference workload shows every knob it has, recommended or not
        for name in target.knobs():
            plan.setdefault(name, None)
    if only is not None:
        plan = {name: plan.get(name) for name in only}
    return list(plan.items()), by_hand


def _estimated_speedup(finding) -> float | None:
    gain_pct = getattr(finding, "est_gain_pct", None)
    if gain_pct is None or not 0 < gain_pct < 100:
        return None
    return 100 / (100 - gain_pct)


def _step_time_interval(report) -> Interval | None:
    times = report.summary.measured_step_times.to_numpy()
    try:
        return mean_interval(times)
    except GpuprofError:
        return None


def _conclude(target, result: TuneResult) -> None:
    helped = [trial for trial in result.trials if trial.helped and trial.name != "optimized"]
    result.winner = max(helped, key=lambda trial: trial.speedup.point, default=None)
    singles = [trial for trial in result.trials if len(trial.knobs) == 1 and trial.name != "combined"
               and trial.status == "measured" and trial.speedup]
    for composite in (trial for trial in result.trials if trial.name in ("combined", "optimized") and trial.speedup):
        own = [single for single in singles if single.knobs[0] in
               (composite.knobs if composite.name == "combined" else _optimized_knobs(target))]
        for single in own:
            if single.speedup.low > composite.speedup.high:  # slower beyond the noise of either
                what = "the combination" if composite.name == "combined" else "the optimized variant"
                result.notes.append(f"{what} ({composite.speedup.point:.2f}x) is slower than its own {single.name} "
                                    f"knob alone ({single.speedup.point:.2f}x)")
    for trial in result.trials:
        if trial.estimate_missed(ESTIMATE_MISS_FACTOR):
            result.notes.append(f"{trial.rule} estimated {trial.estimate:.2f}x for {trial.name}, measured "
                                f"{trial.speedup.point:.2f}x: off by more than {ESTIMATE_MISS_FACTOR:g}x")
    if result.winner is None:
        return
    if isinstance(target, WorkloadTarget):
        result.diff = "gpuprof train " + " ".join(target.flags_with(result.winner.knobs))
    else:
        result.diff, result.diff_notes = diff_of(result.winner.edits)


def _optimized_knobs(target: WorkloadTarget) -> list[str]:
    """The knobs whose flags change a setting the optimized variant changes from the baseline preset."""
    from gpuprof.workloads.gpt2.config import VARIANTS

    changed = {name for name, value in VARIANTS["optimized"].items() if VARIANTS["baseline"][name] != value}
    return [name for name in target.knobs() if _flag_fields(all_knobs()[name].train_flags) <= changed]


def _flag_fields(flags: tuple[str, ...]) -> set[str]:
    """The TrainConfig fields `gpuprof train` flags set (`--fused-adamw` -> fused_adamw)."""
    return {flag[2:].replace("-", "_") for flag in flags if flag.startswith("--")}
