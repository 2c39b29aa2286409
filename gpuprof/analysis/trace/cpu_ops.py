"""Top CPU operators by inclusive time: the host side, available even without a device."""

from __future__ import annotations

import pandas as pd

from gpuprof.analysis.trace.loader import Trace

COLUMNS = ["rank", "name", "count", "total_us", "mean_us", "max_us"]


def top_cpu_ops(trace: Trace, limit: int = 10) -> pd.DataFrame:
    tables = []
    for rank, rank_trace in trace.ranks.items():
        events = rank_trace.events
        ops = events[events["kind"].eq("cpu_op").to_numpy()]
        if ops.empty:
            continue
        stats = ops.groupby("name", observed=True)["dur_us"].agg(
            count="count", total_us="sum", mean_us="mean", max_us="max"
        )
        stats = stats.reset_index().sort_values("total_us", ascending=False, kind="stable").head(limit)
        stats["name"] = stats["name"].astype(str)
        stats["mean_us"] = stats["mean_us"].round(2)
        stats["rank"] = rank
        tables.append(stats[COLUMNS])
    return pd.concat(tables, ignore_index=True) if tables else pd.DataFrame(columns=COLUMNS)
