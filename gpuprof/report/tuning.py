"""A `gpuprof tune` result as people read it: the trials table and the lines around it, for the terminal,
the HTML page and the dashboard's Tune page alike. Everything here reads the result's plain form
(`TuneResult.to_dict()`, which tune also leaves in its folder as `tune.json`)."""

from __future__ import annotations

from gpuprof.analysis.run.stats import Interval
from gpuprof.report.format import MISSING, fmt_interval

TRIAL_HEADERS = ("trial", "estimate", "measured (95% CI)", "effect", "numerics", "verdict after", "status")


def speedup_of(trial: dict) -> Interval | None:
    """A trial's measured speedup over the baseline (above 1: faster), or None when it was not measured."""
    speedup = trial.get("speedup")
    return Interval(**speedup) if speedup else None


def trial_label(trial: dict) -> str:
    return f"combined: {' + '.join(trial['knobs'])}" if trial["name"] == "combined" else trial["name"]


def trial_rows(result: dict) -> list[tuple[str, ...]]:
    """One row of TRIAL_HEADERS per trial."""
    return [(
        trial_label(trial),
        f"{trial['estimate']:.2f}× ({trial['rule']})" if trial.get("estimate") else (trial.get("rule") or MISSING),
        fmt_interval(speedup, "×", brief=True) if (speedup := speedup_of(trial)) else MISSING,
        effect_text(trial), (trial.get("parity") or {}).get("status", MISSING),
        trial.get("verdict") or MISSING, trial["status"] + (f": {trial['error']}" if trial.get("error") else ""),
    ) for trial in result["trials"]]


def effect_text(trial: dict) -> str:
    effect = trial.get("effect") or MISSING
    return f"{effect} (under host load)" if trial.get("host_load_caveat") else effect


def text_lines(result: dict) -> dict[str, list[str]]:
    """The lines around the table: the baseline above it; the findings to fix by hand, notes, the conclusion
    below it; after the diff, its notes and where the trials' runs are."""
    baseline, interval = result["baseline"], result.get("baseline_step_time_s")
    spread = (f" ±{50 * (interval['high'] - interval['low']) / interval['point']:.1f}% (95% CI)"
              if interval else "")
    return {
        "above": [f"baseline: {baseline['measured_steps']} measured steps, mean step time "
                  f"{baseline['step_time_mean_s']:.4g} s{spread}; {baseline['verdict']}"],
        "below": [*(f"by hand ({item['rule']}): {item['title']}. {item['fix']}" for item in result["by_hand"]),
                  *(f"note: {note}" for note in result["notes"]), result["conclusion"]],
        "after_diff": [*(f"also: {note}" for note in result["diff_notes"]), f"trials recorded in {result['out_dir']}"],
    }


def diff_title(result: dict) -> str:
    return "the command to run:" if result["diff"].startswith("gpuprof") else "the change to make:"
