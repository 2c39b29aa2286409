"""The GPU sits idle for much of the run: from NVML samples, else from the device trace."""

from __future__ import annotations

from gpuprof.diagnoses.finding import Finding
from gpuprof.diagnoses.registry import rule
from gpuprof.run import query as q

GPU_UTIL_WARNING_PCT = 70.0
GPU_UTIL_CRITICAL_PCT = 40.0
# Fewer samples than this (a very short run) say too little about utilization.
MIN_SAMPLES = 5


def busy_pct(ctx) -> tuple[float, dict] | None:
    """Mean GPU busy share and where it comes from."""
    util = ctx.device_figures
    if util["gpu_util_samples"] >= MIN_SAMPLES:
        return util["gpu_util_mean_pct"], {"source": "nvml", "samples": util["gpu_util_samples"]}
    trace = ctx.device_trace
    temporal = trace.temporal_breakdown() if trace is not None else None
    if temporal is None or temporal.empty:
        return None
    return float(100 - temporal["idle_time_pct"].mean()), {"source": "trace", "ranks": len(temporal)}


@rule("low-gpu-utilization", "host", gpu_only=True)
def low_gpu_utilization(ctx):
    measured = busy_pct(ctx)
    if measured is None or measured[0] >= GPU_UTIL_WARNING_PCT:
        return None
    mean_pct, details = measured
    if details["source"] == "nvml":  # the evidence: a second pass, only over runs that were mostly idle
        details["gpu_util_p10_pct"] = ctx.device_samples({"p10": q.quantile("gpu_util_pct", 0.1)})["p10"]
    return Finding(
        rule="low-gpu-utilization",
        severity="critical" if mean_pct < GPU_UTIL_CRITICAL_PCT else "warning",
        title=f"The GPU is busy only {mean_pct:.0f}% of the time",
        evidence={"gpu_busy_pct": mean_pct, **details, "threshold_pct": GPU_UTIL_WARNING_PCT},
        fix=(
            "Find what the GPU waits for: the data loader, host-device syncs or kernel launches "
            "(see the other findings); then raise the micro-batch size so each step gives it more work."
        ),
    )
