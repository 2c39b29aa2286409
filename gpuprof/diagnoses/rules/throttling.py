"""GPU clocks held down by temperature or power limits."""

from __future__ import annotations

import pandas as pd

from gpuprof.analysis.run.summary import column, max_or_none
from gpuprof.diagnoses.finding import Finding
from gpuprof.diagnoses.registry import rule

THROTTLED_SHARE_WARNING_PCT = 10.0
# NVML clock-event reasons that mean heat or power, not idleness or an application setting.
THERMAL_OR_POWER = ("thermal", "power", "hw_slowdown")


def thermal_or_power_reasons(reasons: pd.Series) -> pd.Series:
    """One row per (sample, thermal or power reason), indexed like the samples; vectorised
    because hours of 10 Hz samples are hundreds of thousands of rows."""
    names = reasons.explode().dropna().astype(str)
    return names[names.str.lower().str.contains("|".join(THERMAL_OR_POWER))]


@rule("gpu-throttling", gpu_only=True)
def gpu_throttling(ctx):
    samples = ctx.device_samples.reset_index(drop=True)  # reasons are matched back by index
    if samples.empty or "throttle_reasons" not in samples.columns:
        return None
    reasons = thermal_or_power_reasons(samples["throttle_reasons"])
    throttled = pd.Series(samples.index.isin(reasons.index), index=samples.index)
    share_pct = 100 * float(throttled.mean())
    if share_pct < THROTTLED_SHARE_WARNING_PCT:
        return None
    clocks = column(samples, "sm_clock_mhz")
    return Finding(
        rule="gpu-throttling",
        severity="warning",
        title=f"The GPU was thermally or power throttled in {share_pct:.0f}% of samples",
        evidence={
            "throttled_samples_pct": share_pct,
            "reasons": {name: int(count) for name, count in reasons.value_counts().items()},
            "temp_max_c": max_or_none(column(samples, "temp_c")),
            "power_max_w": max_or_none(column(samples, "power_w")),
            "sm_clock_throttled_median_mhz": float(clocks[throttled].median()),
            "sm_clock_unthrottled_median_mhz": float(clocks[~throttled].median()),
            "threshold_pct": THROTTLED_SHARE_WARNING_PCT,
        },
        fix=(
            "Check cooling and the power limit (nvidia-smi -q -d PERFORMANCE,POWER,TEMPERATURE); "
            "on shared nodes ask for the power cap to be raised; compare against an unthrottled GPU."
        ),
    )
