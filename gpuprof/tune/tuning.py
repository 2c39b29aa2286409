"""`gpuprof tune`: measure each fix the diagnoses recommend, one knob at a time, then together.

1. The baseline: the unmodified script (or workload) for N steps, N enough for a ±5 % interval on the
   mean step time (a pilot of PILOT_STEPS says how many; `steps` fixes it).
2. Its findings, each with the knobs that apply its fix from outside (gpuprof.diagnoses.knob): one trial
   per knob, that knob alone. Findings with no such knob are listed with their fix, to make by hand.
3. One trial combining the knobs that helped (faster beyond the noise, loss curve not diverged), and for
   the reference workload its optimized variant; tune says where either is slower than one of its own
   knobs alone (their intervals apart).
The winning set (the fastest trial that helped) ends in the diff a user applies to their own files.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from gpuprof.analysis.run.stats import Interval, mean_interval, steps_needed
from gpuprof.diagnoses.knob import all_knobs, knobs_of
from gpuprof.errors import GpuprofError
from gpuprof.tune.edits import diff_of
from gpuprof.tune.trials import Trial, WorkloadTarget, launch, read

PILOT_STEPS = 20
MAX_STEPS = 200
TARGET_REL_HALF_WIDTH = 0.05
# A trial may take this many times the baseline's wall time (compilation, workers starting) before it is stopped.
BUDGET_FACTOR = 4.0
BUDGET_MIN_S = 120.0
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
        return (f"{' + '.join(self.winner.knobs)}: {interval.point:.2f}x faster (95% CI {interval.low:.2f}-"
                f"{interval.high:.2f}x), numerics {parity}")

    def to_dict(self) -> dict:
        return {
            "target": self.target, "out_dir": self.out_dir, "steps": self.steps, "conclusion": self.conclusion,
            "baseline": self.baseline.to_dict(),
            "baseline_step_time_s": self.baseline_step_time.to_dict() if self.baseline_step_time else None,
            "trials": [trial.to_dict() for trial in self.trials], "by_hand": self.by_hand,
            "winner": self.winner.name if self.winner else None, "diff": self.diff, "diff_notes": self.diff_notes,
            "notes": self.notes,
        }


def tune(target, out_dir, *, steps: int | None = None, only: list[str] | None = None, budget_s: float | None = None,
         progress: Callable[[str], None] = lambda line: None) -> TuneResult:
    out = Path(out_dir)
    # under torchrun rank 0 alone checks: the other ranks may look after it has begun writing the baseline
    if os.environ.get("RANK", "0") == "0" and out.exists() and any(out.iterdir()):
        raise GpuprofError(f"{out} is not empty: tune writes its trials into a folder of its own")
    applicable = target.knobs()
    unknown = [name for name in only or () if name not in applicable]
    if unknown:
        raise GpuprofError(f"no knob {', '.join(unknown)} for {target.title}; choose from {', '.join(applicable)}")
    baseline, baseline_report, steps = _baseline(target, out, steps, budget_s, progress)
    budget_s = budget_s or max(BUDGET_MIN_S, BUDGET_FACTOR * baseline.wall_s)
    result = TuneResult(target.title, str(out), steps, baseline, _step_time_interval(baseline_report))
    plan, result.by_hand = _plan(target, baseline_report.findings, only)
    for knob_name, finding in plan:
        trial = Trial(knob_name, (knob_name,), str(out / knob_name), rule=finding.rule if finding else None,
                      estimate=_estimated_speedup(finding))
        result.trials.append(_run(target, trial, baseline_report, steps, budget_s, progress))
    helped = [trial for trial in result.trials if trial.helped]
    if len(helped) > 1:
        combined = Trial("combined", tuple(name for trial in helped for name in trial.knobs), str(out / "combined"))
        result.trials.append(_run(target, combined, baseline_report, steps, budget_s, progress))
    if isinstance(target, WorkloadTarget) and only is None:
        optimized = Trial("optimized", (), str(out / "optimized"))
        result.trials.append(_run(target, optimized, baseline_report, steps, budget_s, progress,
                                  extra=("--variant", "optimized")))
    _conclude(target, result)
    return result


def _baseline(target, out: Path, steps: int | None, budget_s, progress):
    """The baseline trial and its report, and the steps every trial runs: `steps`, else enough for a
    ±TARGET_REL_HALF_WIDTH interval on the mean step time, from a pilot of PILOT_STEPS."""
    baseline = Trial("baseline", (), str(out / "baseline"))
    report = _measure_baseline(target, baseline, steps or PILOT_STEPS, budget_s, progress)
    if steps is not None:
        return baseline, report, steps
    needed = min(MAX_STEPS, steps_needed(report.summary.measured_step_times.to_numpy(), TARGET_REL_HALF_WIDTH))
    if needed <= baseline.measured_steps:
        return baseline, report, PILOT_STEPS
    shutil.move(baseline.run_dir, out / "pilot")
    shutil.move(baseline.run_dir + ".log", out / "pilot.log")
    baseline = Trial("baseline", (), str(out / "baseline"))
    return baseline, _measure_baseline(target, baseline, needed, budget_s, progress), needed


def _measure_baseline(target, baseline: Trial, steps: int, budget_s, progress):
    progress(f"baseline: {steps} steps of {target.title}")
    launch(target, baseline, steps, budget_s)
    report = read(baseline, None)
    if baseline.status != "measured" or report is None:
        raise GpuprofError(f"the baseline run failed, so there is nothing to compare against: {baseline.error}")
    return report


def _run(target, trial: Trial, baseline_report, steps: int, budget_s: float, progress, extra=()) -> Trial:
    progress(f"trial {trial.name}: {steps} steps")
    launch(target, trial, steps, budget_s, extra)
    read(trial, baseline_report)
    if trial.status == "measured" and not isinstance(target, WorkloadTarget) and trial.knobs and not trial.edits:
        trial.status = "nothing to change"
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
