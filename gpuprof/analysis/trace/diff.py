"""Two traces compared by op and by kernel, as HTA's `TraceDiff.compare_traces` and the TensorBoard
plugin's diff run: per name, how often and how long it ran in trace A and in trace B, and the change.

    trace_diff(TraceAnalysis("baseline/"), TraceAnalysis("optimized/"))
"""

from __future__ import annotations

import pandas as pd

COLUMNS = ["kind", "name", "count_a", "count_b", "count_diff", "total_us_a", "total_us_b", "total_us_diff"]


def _totals(table: pd.DataFrame) -> pd.DataFrame:
    """Count and total time per name, summed over ranks."""
    return table.groupby("name")[["count", "total_us"]].sum()


def trace_diff(a, b) -> pd.DataFrame:
    """Every kernel and CPU op of either trace (TraceAnalysis), B against A: counts and total µs in each
    (0 where a name is absent) and B − A; the largest change in time first."""
    frames = []
    for kind, method in (("kernel", "top_kernels"), ("cpu_op", "top_cpu_ops")):
        joined = pd.merge(_totals(getattr(a, method)(None)), _totals(getattr(b, method)(None)), how="outer",
                          left_index=True, right_index=True, suffixes=("_a", "_b"))
        joined = joined.fillna(0).astype("int64").reset_index()
        joined["count_diff"] = joined["count_b"] - joined["count_a"]
        joined["total_us_diff"] = joined["total_us_b"] - joined["total_us_a"]
        frames.append(joined.assign(kind=kind))
    table = pd.concat(frames, ignore_index=True)
    order = table["total_us_diff"].abs().sort_values(ascending=False, kind="stable").index
    return table.loc[order, COLUMNS].reset_index(drop=True)
