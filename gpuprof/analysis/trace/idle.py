"""Device idle time by cause per stream, as HTA's `get_idle_time_breakdown`.

A gap before a device event on a stream is "host wait" when the event's launch call
started after the previous event on the stream ended (the host was late), "kernel wait"
when the gap is shorter than `kernel_wait_us` (back-to-back launch overhead), else "other".
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from gpuprof.analysis.trace.events import device_events, host_events
from gpuprof.analysis.trace.loader import Trace

CATEGORIES = ("host_wait", "kernel_wait", "other")
COLUMNS = ["rank", "stream", "idle_category", "idle_time_us", "idle_time_pct"]
KERNEL_WAIT_US = 30  # HTA's default consecutive_kernel_delay


def launch_times(events: pd.DataFrame, device: pd.DataFrame) -> np.ndarray:
    """Start of the host event (the launch call) correlated with each device event; NaN if none."""
    host = host_events(events)
    host = host[host["correlation"].to_numpy() >= 0].drop_duplicates("correlation")
    by_correlation = pd.Series(host["ts_us"].to_numpy(), index=host["correlation"].to_numpy())
    return by_correlation.reindex(device["correlation"].to_numpy()).to_numpy(dtype=np.float64)


def idle_by_stream(trace: Trace, kernel_wait_us: float = KERNEL_WAIT_US) -> pd.DataFrame:
    tables = []
    for rank, rank_trace in trace.ranks.items():
        device = device_events(rank_trace.events)
        device = device[device["stream"].to_numpy() >= 0]
        if device.empty:
            continue
        device = device.assign(launch_us=launch_times(rank_trace.events, device))
        device = device.sort_values(["stream", "ts_us"], kind="stable")
        previous_end = device.groupby("stream")["end_us"].shift(1)
        gap = (device["ts_us"] - previous_end).clip(lower=0)
        host_wait = device["launch_us"] > previous_end
        category = np.where(host_wait, "host_wait", np.where(gap < kernel_wait_us, "kernel_wait", "other"))
        gaps = pd.DataFrame({"stream": device["stream"], "idle_category": category, "idle_time_us": gap})
        gaps = gaps[previous_end.notna()]
        table = gaps.groupby(["stream", "idle_category"])["idle_time_us"].sum()
        full = pd.MultiIndex.from_product([sorted(device["stream"].unique()), CATEGORIES])
        table = table.reindex(full, fill_value=0).rename_axis(["stream", "idle_category"]).reset_index()
        stream_total = table.groupby("stream")["idle_time_us"].transform("sum")
        table["idle_time_pct"] = (100 * table["idle_time_us"] / stream_total.replace(0, np.nan)).round(2)
        table["idle_time_us"] = table["idle_time_us"].astype(np.int64)
        table["rank"] = rank
        tables.append(table[COLUMNS])
    return pd.concat(tables, ignore_index=True) if tables else pd.DataFrame(columns=COLUMNS)
