"""What the slowest training steps do that the others do not, in the loop's own terms.

Given the slowest steps (the step-time-variance rule's: its slowest tenth, evaluation taken out), each
phase's excess is the median over those steps of its time less its median over all measured steps; the
phase with the largest positive excess is where their extra time goes. The first rank's stack samples
taken in that phase of those steps name the user's lines (`site_label`), however few: a slow step is rare
and short, so they are evidence, counted, not a share of the step (gpuprof.analysis.run.hotspots). A line
holding under MIN_SITE_SHARE of those samples is not named: one stray sample (a print the loop runs every
step, caught while another process held the core) says nothing of where the extra time went.
Also said: how many of those steps evaluate (nanoGPT saves its checkpoint right after evaluating).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from gpuprof.analysis.run.hotspots import LIBRARIES, site_label
from gpuprof.run.schema import SPLIT_PHASES

MAX_SITES = 3
MIN_SITE_SHARE = 0.1


@dataclass(frozen=True)
class SlowSteps:
    steps: list[int]
    phase: str | None = None  # where most of their extra time goes; None when no phase's time grew
    excess_s: float | None = None  # the median extra time of that phase over a typical step
    evaluating: int = 0  # how many of them also evaluate
    samples: int = 0  # the first rank's stack samples in that phase of those steps
    sites: dict[str, int] = field(default_factory=dict)  # the user's sites among them -> samples, most first

    def to_dict(self) -> dict:
        return {"slow_steps_phase": self.phase, "slow_steps_excess_s": self.excess_s,
                "slow_steps_evaluating": self.evaluating, "slow_steps_samples": self.samples,
                "slow_steps_sites": self.sites}


def slow_steps(query, measured: pd.Index, slow: pd.Index, evaluation: pd.Series, rank: int | None) -> SlowSteps:
    """`slow` among the `measured` steps (both step indexes), `evaluation` their eval time per step, read
    through the run's `query`; `rank`, the one whose stack samples are read."""
    excess = {phase: _excess_s(query.step_series(f"{phase}_time_s", "max"), measured, slow) for phase in SPLIT_PHASES}
    phase = max(excess, key=excess.get)
    evaluating = int((evaluation.reindex(slow).fillna(0.0) > 0).sum())
    if excess[phase] <= 0:
        return SlowSteps(steps=[int(step) for step in slow], evaluating=evaluating)
    sites = sample_sites(query, rank, slow, phase)
    named = named_sites(sites)
    return SlowSteps(steps=[int(step) for step in slow], phase=phase, excess_s=excess[phase], evaluating=evaluating,
                     samples=int(sites.sum()), sites={label: int(n) for label, n in named.items()})


def _excess_s(times: pd.Series, measured: pd.Index, slow: pd.Index) -> float:
    times = times.reindex(measured).fillna(0.0)  # a phase a step did not run took no time in it
    return float((times.reindex(slow) - times.median()).median())


def sample_sites(query, rank: int | None, steps: pd.Index, phase: str) -> pd.Series:
    """Samples per user site (LIBRARIES: no frame of the user's) in `phase` of `steps`, most first."""
    if rank is None or not query.rows("stacks"):
        return pd.Series(dtype="int64")
    samples = query.rank_frame("stacks", rank, ["step", "phase", "function", "file", "line"])
    samples = samples[samples["step"].isin(steps) & (samples["phase"] == phase)]
    labels = [site_label(*site) for site in zip(samples["function"], samples["file"], samples["line"])]
    return pd.Series(labels, dtype=object).value_counts()


def named_sites(sites: pd.Series) -> pd.Series:
    """The user's sites among `sites` (samples per site, most first) worth naming: each holding at least
    MIN_SITE_SHARE of all, at most MAX_SITES."""
    return sites[sites >= MIN_SITE_SHARE * sites.sum()].drop(LIBRARIES, errors="ignore").head(MAX_SITES)
