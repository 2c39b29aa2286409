"""What the device trace shows about kernels: launch-bound steps and pageable host copies."""

from __future__ import annotations

from gpuprof.analysis.trace.classify import PAGEABLE_COPY_RE, matches
from gpuprof.diagnoses.finding import Finding
from gpuprof.diagnoses.registry import rule

# Launch-bound: the GPU idles waiting for the host while most kernels are shorter than the
# host call that launched them (HTA's definition of a short kernel).
LAUNCH_BOUND_IDLE_PCT = 30.0
LAUNCH_BOUND_SHORT_KERNEL_PCT = 50.0
PAGEABLE_WARNING_PCT_OF_STEP = 1.0


def worst_rank(frame, column: str):
    """The row of the rank with the largest `column`."""
    return frame.loc[frame[column].idxmax()]


@rule("launch-bound", "host", gpu_only=True, on_trace=True)
def launch_bound(ctx):
    trace = ctx.device_trace
    if trace is None:
        return None
    temporal, launches = trace.temporal_breakdown(), trace.launch_summary()
    if temporal.empty or launches.empty:
        return None
    idle = worst_rank(temporal, "idle_time_pct")
    by_rank = launches.set_index("rank")
    if idle["idle_time_pct"] < LAUNCH_BOUND_IDLE_PCT or idle["rank"] not in by_rank.index:
        return None
    short = by_rank.loc[idle["rank"]]
    if short["short_kernel_pct"] < LAUNCH_BOUND_SHORT_KERNEL_PCT:
        return None
    return Finding(
        rule="launch-bound",
        severity="warning",
        title=f"Launch-bound: the GPU idles {idle['idle_time_pct']:.0f}% of the time while "
        f"{short['short_kernel_pct']:.0f}% of kernels run shorter than their launch",
        evidence={
            "rank": int(idle["rank"]),
            "idle_time_pct": float(idle["idle_time_pct"]),
            "short_kernel_pct": float(short["short_kernel_pct"]),
            "launches": int(short["launches"]),
            "launch_delay_p50_us": float(short["launch_delay_p50_us"]),
            "thresholds": {"idle_time_pct": LAUNCH_BOUND_IDLE_PCT, "short_kernel_pct": LAUNCH_BOUND_SHORT_KERNEL_PCT},
        },
        fix=(
            "Give each launch more work or launch less often: torch.compile(model) fuses small "
            "kernels, CUDA graphs (torch.compile(mode='reduce-overhead')) replay a step with one "
            "launch, fused optimizers (fused=True), larger micro-batches."
        ),
    )


@rule("pageable-memcpy", "input", gpu_only=True, on_trace=True)
def pageable_memcpy(ctx):
    trace = ctx.device_trace
    if trace is None:
        return None
    kernels = trace.top_kernels(limit=None)
    pageable = kernels[matches(kernels["name"], PAGEABLE_COPY_RE)]
    if pageable.empty:
        return None
    steps = trace.step_breakdown()
    step_time_us = steps["step_time_us"].sum() if not steps.empty else None
    share_pct = 100 * pageable["total_us"].sum() / step_time_us if step_time_us else None
    return Finding(
        rule="pageable-memcpy",
        severity="warning" if (share_pct or 0) >= PAGEABLE_WARNING_PCT_OF_STEP else "info",
        title=f"{int(pageable['count'].sum())} host-device copies use pageable (unpinned) host memory",
        evidence={
            "copies": {str(name): int(count) for name, count in pageable.groupby("name")["count"].sum().items()},
            "copy_time_us": int(pageable["total_us"].sum()),
            "copy_share_of_step_pct": share_pct,
            "loader_pin_memory": ctx.loop("loader").get("pin_memory"),
            "threshold_pct": PAGEABLE_WARNING_PCT_OF_STEP,
        },
        fix=(
            "Pin host memory so copies are asynchronous DMA: DataLoader(pin_memory=True) and "
            f"tensor.to(device, non_blocking=True){ctx.workload_flags('--pin-memory')}; read results back "
            "into a pinned buffer."
        ),
    )
