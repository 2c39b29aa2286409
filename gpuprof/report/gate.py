"""`gpuprof compare --gate`: the CI decision on a comparison, and its exit codes.
No heavy imports: the CLI's parser reads the defaults before it loads pandas."""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpuprof.errors import GpuprofError
from gpuprof.report.format import ci_text, figure_text, fmt_ratio_interval

DEFAULT_MAX_REGRESSION_PCT = 5.0
# How a baseline of several runs stands as A: their steps pooled, or the run of median mean step time.
POOLINGS = ("pooled", "median")


class Exit:
    """The gate's exit codes (2, bad input, is every command's)."""

    PASS = 0
    REGRESSION = 3
    NOT_COMPARABLE = 4
    TOO_NOISY = 5


@dataclass(frozen=True)
class Gate:
    exit_code: int
    outcome: str
    reason: str
    steps_needed: int | None = None  # measured steps per run that would decide, when too noisy

    def to_dict(self) -> dict:
        return {"exit_code": self.exit_code, "outcome": self.outcome, "reason": self.reason,
                "steps_needed": self.steps_needed}


def decide(comparison, max_regression_pct: float = DEFAULT_MAX_REGRESSION_PCT) -> Gate:
    """Not comparable (4); a numerics regression, or the whole interval of B's slowdown past the
    threshold (3); the whole interval within it (0); else too noisy (5), with the steps that would tell.
    Where the hosts' load differed, never a pass, and a regression only where B's host took no more from its loop
    than A's did (`Comparison.b_host_no_busier`): else too noisy (5), saying so."""
    from gpuprof.analysis.run import stats
    from gpuprof.report.contract import host_load_caution

    if not math.isfinite(max_regression_pct) or max_regression_pct < 0:
        raise GpuprofError(f"--max-regression-pct must be a number of at least 0, got {max_regression_pct}")
    if comparison.blocking:
        return Gate(Exit.NOT_COMPARABLE, "not comparable", comparison.conclusion)
    if comparison.numerics.regressed:
        return Gate(Exit.REGRESSION, "regression", comparison.numerics.text)
    slowdown, threshold = comparison.slowdown, 1 + max_regression_pct / 100
    n_steps = min(comparison.a_side.n_steps, comparison.b_side.n_steps)
    if not isinstance(slowdown, stats.Interval):
        return Gate(Exit.TOO_NOISY, "too noisy", f"too few measured steps to tell the noise ({n_steps}; at least "
                    f"{stats.MIN_STEPS} after warm-up in each run)", stats.MIN_STEPS)
    limit = f"the {max_regression_pct:g} % threshold"
    speed = speed_text(slowdown)
    if comparison.host_load is not None:
        # a loop's share of the CPU understates what load costs it (its other threads wait too, caches go cold):
        # only a B whose host took no more from its loop is slower for its own reasons
        if comparison.b_host_no_busier and slowdown.low > threshold:
            return Gate(Exit.REGRESSION, "regression", f"{speed}: past {limit}, on a host that took no more from "
                        "its loop than A's did (load slows a run, it never speeds one)")
        return Gate(Exit.TOO_NOISY, "too noisy", f"{speed}, {host_load_caution(comparison.host_load)}")
    if slowdown.low > threshold:
        return Gate(Exit.REGRESSION, "regression", f"{speed}: past {limit}")
    if slowdown.high <= threshold:
        return Gate(Exit.PASS, "pass", f"{speed}: within {limit}")
    distance = abs(threshold - slowdown.point)
    half = slowdown.high - slowdown.point if threshold > slowdown.point else slowdown.point - slowdown.low
    needed = stats.scaled_steps(n_steps, half, distance) if distance > 0 else None
    more = (f"about {needed} measured steps in each run would tell (now {n_steps})" if needed
            else "B's slowdown sits on the threshold: no number of steps would tell")
    return Gate(Exit.TOO_NOISY, "too noisy",
                f"B/A step time {fmt_ratio_interval(slowdown)} straddles {limit}; {more}", needed)


def speed_text(slowdown) -> str:
    """"B is 1.42× faster (95 % CI 1.31–1.55×)" from B's step time over A's."""
    from gpuprof.analysis.run import stats

    if not isinstance(slowdown, stats.Interval):
        return "speed not compared (too few measured steps to tell the noise)"
    if slowdown.contains(1.0):
        return f"B and A run at the same speed within the noise (B/A step time {fmt_ratio_interval(slowdown)})"
    faster = slowdown.high < 1
    ratio = slowdown.inverted() if faster else slowdown
    return f"B is {figure_text(ratio.point, '×')} {'faster' if faster else 'slower'} ({ci_text(ratio, '×')})"
