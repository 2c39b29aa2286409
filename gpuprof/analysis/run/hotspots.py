"""Where each phase's time goes in the user's own code, from the stack sampler's rows.

A phase's measured share of the step (the phase timings, exact) is split among the user functions
its stack samples landed in: the share of a function is the phase's share times the fraction of
the phase's samples that were in it. Samples with no user frame (a library's own loop) stay the
libraries'. Read from the first rank's samples of the measured steps (warm-up left out), which are
the loop's own; "eval" shares are of the whole run's time, the others of the training step's (as
`RunSummary.phase_split_pct`).
"""

from __future__ import annotations

import os

import pandas as pd

LIBRARIES = "libraries"  # the label of samples with no frame of the user's
COLUMNS = ["phase", "function", "file", "line", "samples", "phase_samples", "phase_fraction", "share_pct", "label"]
# A phase's samples needed before its time is split among functions: below, a share rests on one or two
# samples (a short run at 20 samples a second), and is not named.
MIN_PHASE_SAMPLES = 10
# The phases whose time is not the model's own work: the ones a black box would hide.
OUTSIDE_MODEL = ("data", "eval", "other")


def site_label(function: str | None, filename: str | None, line) -> str:
    """`get_batch (train.py:116)`: the one spelling of a place in the user's code."""
    if function is None or pd.isna(function):
        return LIBRARIES
    return f"{function} ({os.path.basename(str(filename))}:{int(line)})"


def hotspots(run, summary) -> pd.DataFrame:
    """One row per (phase, user function) of the first rank's measured samples, largest share first."""
    ranks = run.query.ranks_with_steps
    if not ranks or not run.query.rows("stacks"):
        return pd.DataFrame(columns=COLUMNS)
    samples = run.query.rank_frame("stacks", ranks[0], ["step", "phase", "function", "file", "line"])
    samples = samples[pd.to_numeric(samples["step"], errors="coerce") >= summary.warmup.first_measured_step]
    if samples.empty:
        return pd.DataFrame(columns=COLUMNS)
    samples = samples.assign(function=samples["function"].astype(object).where(samples["function"].notna(), None))
    counts = (samples.groupby(["phase", "function", "file", "line"], dropna=False).size()
              .rename("samples").reset_index())
    counts["phase_samples"] = counts.groupby("phase")["samples"].transform("sum")
    counts["phase_fraction"] = counts["samples"] / counts["phase_samples"]
    shares = {**summary.phase_split_pct, "eval": summary.evaluation.get("share_pct")}
    counts["share_pct"] = [fraction * shares[phase] if shares.get(phase) is not None else None
                           for phase, fraction in zip(counts["phase"], counts["phase_fraction"])]
    counts["label"] = [site_label(*site) for site in zip(counts["function"], counts["file"], counts["line"])]
    return counts.sort_values(["share_pct", "samples"], ascending=False, ignore_index=True)[COLUMNS]


def top_sites(table: pd.DataFrame, phase: str, limit: int = 3, min_fraction: float = 0.1) -> pd.DataFrame:
    """The user functions holding at least `min_fraction` of a phase's samples, largest first; none when the phase
    has fewer than MIN_PHASE_SAMPLES."""
    rows = table[(table["phase"] == phase) & (table["label"] != LIBRARIES) & (table["phase_fraction"] >= min_fraction)
                 & (table["phase_samples"] >= MIN_PHASE_SAMPLES)]
    return rows.head(limit)


def phase_samples(table: pd.DataFrame, phase: str) -> int:
    """The stack samples taken in `phase`."""
    rows = table[table["phase"] == phase]
    return int(rows["phase_samples"].iloc[0]) if len(rows) else 0

