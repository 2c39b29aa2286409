"""Kernel launch statistics: host launch-call time vs device time, launch delay, short kernels.

Definitions follow HTA's `get_cuda_kernel_launch_stats`: a kernel is "short" when it runs
for less time on the device than its launch call took on the host; launch delay is the
device start minus the launch call's start.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from gpuprof.analysis.trace.events import device_events, host_events
from gpuprof.analysis.trace.loader import Trace

LAUNCH_COLUMNS = ["rank", "stream", "name", "launch_call", "cpu_duration_us", "gpu_duration_us", "launch_delay_us"]
SUMMARY_COLUMNS = [
    "rank",
    "launches",
    "cpu_launch_time_us",
    "gpu_time_us",
    "launch_delay_mean_us",
    "launch_delay_p50_us",
    "launch_delay_p95_us",
    "launch_delay_max_us",
    "short_kernels",
    "short_kernel_pct",
    "long_launch_calls",
    "long_launch_delays",
]
LONG_LAUNCH_CALL_US = 50  # HTA's runtime_cutoff
LONG_LAUNCH_DELAY_US = 100  # HTA's launch_delay_cutoff


def kernel_launches(trace: Trace) -> pd.DataFrame:
    """One row per device event whose launch call is in the trace."""
    tables = []
    for rank, rank_trace in trace.ranks.items():
        events = rank_trace.events
        calls = host_events(events)
        calls = calls[calls["kind"].eq("runtime").to_numpy() & (calls["correlation"].to_numpy() >= 0)]
        calls = calls.drop_duplicates("correlation")[["correlation", "name", "ts_us", "dur_us"]]
        device = device_events(events)[["correlation", "stream", "name", "ts_us", "dur_us"]]
        joined = device.merge(calls, on="correlation", suffixes=("", "_call"))
        if joined.empty:
            continue
        tables.append(
            pd.DataFrame(
                {
                    "rank": rank,
                    "stream": joined["stream"].to_numpy(),
                    "name": joined["name"].astype(str).to_numpy(),
                    "launch_call": joined["name_call"].astype(str).to_numpy(),
                    "cpu_duration_us": joined["dur_us_call"].to_numpy(),
                    "gpu_duration_us": joined["dur_us"].to_numpy(),
                    "launch_delay_us": (joined["ts_us"] - joined["ts_us_call"]).to_numpy(),
                }
            )
        )
    return pd.concat(tables, ignore_index=True) if tables else pd.DataFrame(columns=LAUNCH_COLUMNS)


def launch_summary(trace: Trace) -> pd.DataFrame:
    launches = kernel_launches(trace)
    rows = []
    for rank, group in launches.groupby("rank"):
        delay = group["launch_delay_us"].to_numpy()
        short = int((group["gpu_duration_us"] < group["cpu_duration_us"]).sum())
        rows.append(
            [
                rank,
                len(group),
                int(group["cpu_duration_us"].sum()),
                int(group["gpu_duration_us"].sum()),
                round(float(delay.mean()), 2),
                float(np.percentile(delay, 50)),
                float(np.percentile(delay, 95)),
                int(delay.max()),
                short,
                round(100 * short / len(group), 2),
                int((group["cpu_duration_us"] > LONG_LAUNCH_CALL_US).sum()),
                int((delay > LONG_LAUNCH_DELAY_US).sum()),
            ]
        )
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)
