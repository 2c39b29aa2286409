"""Across ranks: per-rank step-time spread and straggler candidates.

In synchronous data parallel training the slow rank ("straggler") does more work per
step and waits least in collectives, while its peers wait for it inside communication.
A rank is a candidate when its work per step exceeds the cross-rank median by more
than `threshold_pct` of the median step time, or its communication time is below the
median by that much.
"""

from __future__ import annotations

import pandas as pd

SPREAD_COLUMNS = [
    "rank",
    "steps",
    "step_time_mean_us",
    "step_time_p50_us",
    "step_time_max_us",
    "step_time_std_us",
    "step_time_vs_median_pct",
]
STRAGGLER_COLUMNS = [
    "rank",
    "work_per_step_us",
    "communication_per_step_us",
    "work_vs_median_pct",
    "communication_vs_median_pct",
    "straggler",
]
THRESHOLD_PCT = 5.0


def rank_spread(steps: pd.DataFrame) -> pd.DataFrame:
    """Step-time statistics per rank from a `step_breakdown` table."""
    grouped = steps.groupby("rank")["step_time_us"]
    table = grouped.agg(
        steps="count", step_time_mean_us="mean", step_time_p50_us="median", step_time_max_us="max", step_time_std_us="std"
    ).reset_index()
    median = table["step_time_mean_us"].median()
    table["step_time_vs_median_pct"] = 100 * (table["step_time_mean_us"] - median) / median
    return table[SPREAD_COLUMNS].round(2)


def stragglers(steps: pd.DataFrame, threshold_pct: float = THRESHOLD_PCT) -> pd.DataFrame:
    """Straggler candidates among ranks (needs at least two ranks)."""
    if steps["rank"].nunique() < 2:
        return pd.DataFrame(columns=STRAGGLER_COLUMNS)
    per_step = steps.assign(work_us=steps["step_time_us"] - steps["communication_us"] - steps["other_us"])
    table = per_step.groupby("rank").agg(
        work_per_step_us=("work_us", "mean"),
        communication_per_step_us=("communication_us", "mean"),
        step_time_us=("step_time_us", "mean"),
    )
    scale = table["step_time_us"].median()
    work_excess = 100 * (table["work_per_step_us"] - table["work_per_step_us"].median()) / scale
    comm_vs_median = 100 * (table["communication_per_step_us"] - table["communication_per_step_us"].median()) / scale
    table["work_vs_median_pct"] = work_excess
    table["communication_vs_median_pct"] = comm_vs_median
    table["straggler"] = (work_excess > threshold_pct) | (comm_vs_median < -threshold_pct)
    table = table.reset_index().sort_values("work_vs_median_pct", ascending=False, ignore_index=True)
    return table[STRAGGLER_COLUMNS].round(2)
