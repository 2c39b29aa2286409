"""GPU clocks held down by temperature or power limits."""

from __future__ import annotations

from gpuprof.diagnoses.context import THERMAL_OR_POWER, THROTTLED
from gpuprof.diagnoses.finding import Finding
from gpuprof.diagnoses.registry import rule
from gpuprof.run import query as q

THROTTLED_SHARE_WARNING_PCT = 10.0


@rule("gpu-throttling", "compute", gpu_only=True)
def gpu_throttling(ctx):
    counts = ctx.device_figures
    if not counts["samples"]:
        return None
    share_pct = 100 * counts["throttled_samples"] / counts["samples"]
    if share_pct < THROTTLED_SHARE_WARNING_PCT:
        return None
    figures = ctx.device_samples({  # the evidence: a second pass, only over runs that were throttled
        "temp_max_c": q.maximum("temp_c"),
        "power_max_w": q.maximum("power_w"),
        "sm_clock_throttled_median_mhz": q.quantile("sm_clock_mhz", 0.5, where=THROTTLED),
        "sm_clock_unthrottled_median_mhz": q.quantile("sm_clock_mhz", 0.5, where=q.negate(THROTTLED)),
    })
    reasons = ctx.device_sample_counts("throttle_reasons")
    reasons = reasons[reasons.index.str.lower().str.contains("|".join(THERMAL_OR_POWER))]
    return Finding(
        rule="gpu-throttling",
        severity="warning",
        title=f"The GPU was thermally or power throttled in {share_pct:.0f}% of samples",
        evidence={
            "throttled_samples_pct": share_pct,
            "reasons": {name: int(count) for name, count in reasons.items()},
            "temp_max_c": figures["temp_max_c"],
            "power_max_w": figures["power_max_w"],
            "sm_clock_throttled_median_mhz": figures["sm_clock_throttled_median_mhz"],
            "sm_clock_unthrottled_median_mhz": figures["sm_clock_unthrottled_median_mhz"],
            "threshold_pct": THROTTLED_SHARE_WARNING_PCT,
        },
        fix=(
            "Check cooling and the power limit (nvidia-smi -q -d PERFORMANCE,POWER,TEMPERATURE); "
            "on shared nodes ask for the power cap to be raised; compare against an unthrottled GPU."
        ),
    )
