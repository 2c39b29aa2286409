"""How busy the GPU is: idle for much of the run (from NVML samples, else the device trace), or
busy while its kernels reach only a small share of the peak FLOP/s (MFU)."""

from __future__ import annotations

from gpuprof.diagnoses.finding import Finding
from gpuprof.diagnoses.knob import knob
from gpuprof.diagnoses.recorded_loop import recorded_dtype
from gpuprof.diagnoses.registry import rule
from gpuprof.run import query as q

GPU_UTIL_WARNING_PCT = 70.0
GPU_UTIL_CRITICAL_PCT = 40.0
# Fewer samples than this (a very short run) say too little about utilization.
MIN_SAMPLES = 5
# A busy GPU below this MFU spends its time in kernels that do little math: the elementwise,
# normalization and softmax kernels between the matmuls, or matmuls too small to fill it.
LOW_MFU_PCT = 30.0
# What a well-fed transformer step reaches on one GPU; the gain estimate assumes the fix gets there.
REACHABLE_MFU_PCT = 40.0
# The idle causes of gpuprof.analysis.trace.idle, for people.
IDLE_CAUSES = {"host_wait": "the host to launch the next kernel", "kernel_wait": "back-to-back launch overhead",
               "other": "other waits (syncs, data, communication)"}


def busy_pct(ctx) -> tuple[float, dict] | None:
    """Mean GPU busy share and where it comes from."""
    util = ctx.device_figures
    if (util["gpu_util_samples"] or 0) >= MIN_SAMPLES:
        return util["gpu_util_mean_pct"], {"source": "nvml", "samples": util["gpu_util_samples"]}
    trace = ctx.device_trace
    temporal = trace.temporal_breakdown() if trace is not None else None
    if temporal is None or temporal.empty:
        return None
    return float(100 - temporal["idle_time_pct"].mean()), {"source": "trace", "ranks": len(temporal),
                                                          **idle_by_cause(trace)}


def idle_by_cause(trace) -> dict:
    """The device's idle time in the trace split by cause (HTA's host wait / kernel wait / other),
    as shares of all idle time, and the main cause."""
    idle = trace.idle_by_stream().groupby("idle_category")["idle_time_us"].sum()
    if not idle.sum():
        return {}
    shares = {f"idle_{cause}_pct": float(100 * time_us / idle.sum()) for cause, time_us in idle.items()}
    return {**shares, "idle_mostly": str(idle.idxmax())}


@rule("low-gpu-utilization", "host", gpu_only=True, on_trace=True)
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
        title=f"The GPU is busy only {mean_pct:.0f}% of the time"
        + (f", idle mostly for {IDLE_CAUSES[details['idle_mostly']]}" if "idle_mostly" in details else ""),
        evidence={"gpu_busy_pct": mean_pct, **details, "threshold_pct": GPU_UTIL_WARNING_PCT},
        fix=(
            "Find what the GPU waits for: the data loader, host-device syncs or kernel launches "
            "(see the other findings); then raise the micro-batch size so each step gives it more work."
        ),
    )


@rule("low-mfu", "compute", gpu_only=True)
def low_mfu(ctx):
    """Busy but slow: NVML (or the trace) says the GPU is computing, the step's FLOP/s say it does little."""
    measured, mfu = busy_pct(ctx), ctx.summary.mfu
    if measured is None or mfu is None or measured[0] < GPU_UTIL_WARNING_PCT or 100 * mfu >= LOW_MFU_PCT:
        return None
    busy, details = measured
    compiled = ctx.loop("model").get("compiled")
    return Finding(
        rule="low-mfu",
        severity="warning",
        title=f"The GPU is busy {busy:.0f}% of the time but reaches only {100 * mfu:.1f}% MFU",
        evidence={"mfu_pct": 100 * mfu, "gpu_busy_pct": busy, **details, "compiled": compiled,
                  "compute_dtype": recorded_dtype(ctx.meta),
                  "peak_flops_per_s": ctx.meta.get("peak_flops_per_s"), "threshold_pct": LOW_MFU_PCT,
                  "reachable_mfu_pct": REACHABLE_MFU_PCT},
        fix=(
            "Raise the work per kernel: a larger micro-batch while memory allows; then "
            "torch.compile(mode='max-autotune') or CUDA graphs, and the top kernels of a trace window."
            if compiled else
            "Compile the model: torch.compile(model) fuses the elementwise, normalization and softmax kernels "
            "between the matmuls, where a busy GPU at low MFU spends its time; then a larger micro-batch "
            "while memory allows."
        ),
        est_gain_pct=100 * (1 - 100 * mfu / REACHABLE_MFU_PCT),
    )


@knob("compile", rule="low-mfu", train_flags=("--compile",))
def compile_model(patch):
    """The model is compiled in place with model.compile() (torch.compile with its defaults), unless
    the script compiled it already. The first steps pay for the compilation: tune's figures leave
    them out as warm-up."""

    def compile_in_place(model) -> str | None:
        from gpuprof.capture.loopfacts import model_facts

        if model_facts(model)["compiled"]:
            return None
        model.compile()
        return "{model}.compile()"

    patch.model(compile_in_place)
