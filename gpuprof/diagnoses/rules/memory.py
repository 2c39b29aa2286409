"""Device memory: near the limit, largely unused, or fragmented."""

from __future__ import annotations

import os

from gpuprof.diagnoses.finding import Finding
from gpuprof.diagnoses.knob import knob
from gpuprof.diagnoses.registry import rule
from gpuprof.run import query as q
from gpuprof.run.schema import EventKind

NEAR_LIMIT_WARNING_FRACTION = 0.90
NEAR_LIMIT_CRITICAL_FRACTION = 0.97
UNUSED_BELOW_FRACTION = 0.35
# Reserved-but-unallocated memory counts as fragmentation above both of these.
FRAGMENTED_GAP_FRACTION = 0.30
FRAGMENTED_GAP_MIN_BYTES = 1 << 30


def peak_used_bytes(ctx) -> float | None:
    """Peak device memory in use: what the allocator reserved, or NVML's view when larger."""
    candidates = [
        ctx.summary.peak_mem_reserved_bytes,
        ctx.all_steps({"max": q.maximum("mem_nvml_used_bytes")})["max"],
    ]
    known = [value for value in candidates if value is not None]
    return max(known) if known else None


def memory_fraction(ctx) -> tuple[float, float, float] | None:
    total_bytes = ctx.summary.device_mem_total_bytes
    used_bytes = peak_used_bytes(ctx)
    if not total_bytes or used_bytes is None:
        return None
    return used_bytes / total_bytes, used_bytes, total_bytes


def oom_count(ctx) -> int:
    ooms = ctx.all_steps({"max": q.maximum("mem_ooms")})["max"] or 0
    return int(max(ooms, len(ctx.events_of(EventKind.OOM))))


def half_activations(hardware) -> str:
    """16-bit activations in the dtype the GPU has (fp16 needs a GradScaler)."""
    if hardware.bf16 is False:
        return "fp16 activations (autocast with a GradScaler)"
    return "bf16 activations (autocast)"


@rule("memory-near-limit", "memory", gpu_only=True)
def memory_near_limit(ctx):
    usage = memory_fraction(ctx)
    ooms = oom_count(ctx)
    if usage is None or (usage[0] < NEAR_LIMIT_WARNING_FRACTION and not ooms):
        return None
    fraction, used_bytes, total_bytes = usage
    critical = ooms or fraction >= NEAR_LIMIT_CRITICAL_FRACTION
    return Finding(
        rule="memory-near-limit",
        severity="critical" if critical else "warning",
        title=f"Peak device memory is {100 * fraction:.0f}% of the GPU's"
        + (f", with {ooms} out-of-memory error(s)" if ooms else ""),
        evidence={
            "peak_used_bytes": used_bytes,
            "device_total_bytes": total_bytes,
            "peak_used_pct": 100 * fraction,
            "ooms": ooms,
            "threshold_pct": 100 * NEAR_LIMIT_WARNING_FRACTION,
        },
        fix=(
            "Trade a little speed for memory: activation checkpointing"
            f"{ctx.workload_flags('--activation-checkpointing')}, a smaller micro-batch with gradient accumulation"
            f"{ctx.workload_flags('--grad-accum')}, "
            f"{half_activations(ctx.hardware)}."
        ),
    )


@rule("memory-underused", "memory", gpu_only=True)
def memory_underused(ctx):
    usage = memory_fraction(ctx)
    if usage is None or usage[0] >= UNUSED_BELOW_FRACTION or oom_count(ctx):
        return None
    fraction, used_bytes, total_bytes = usage
    return Finding(
        rule="memory-underused",
        severity="info",
        title=f"Only {100 * fraction:.0f}% of device memory is used: room for a larger batch",
        evidence={
            "peak_used_bytes": used_bytes,
            "device_total_bytes": total_bytes,
            "peak_used_pct": 100 * fraction,
            "headroom_factor": 1 / fraction,
            "threshold_pct": 100 * UNUSED_BELOW_FRACTION,
        },
        fix=(
            f"Raise the micro-batch size (up to about {0.8 / fraction:.1f}x fits) and fold the gradient "
            "accumulation into it; larger batches keep the GPU busier per launch."
        ),
    )


@rule("allocator-fragmentation", "memory", gpu_only=True)
def allocator_fragmentation(ctx):
    gap = q.difference("mem_reserved_bytes", "mem_allocated_bytes")
    figures = ctx.all_steps({
        # The caching allocator's retry counter is cumulative over the process.
        "retries": q.maximum("mem_alloc_retries"),
        "gap_bytes": q.maximum(gap),
        "gap_fraction": q.maximum(q.ratio(gap, "mem_reserved_bytes")),
    })
    retries = int(figures["retries"] or 0)
    gap_bytes = figures["gap_bytes"]
    gap_fraction = figures["gap_fraction"] or 0.0 if gap_bytes is not None else 0.0
    fragmented = gap_bytes is not None and gap_bytes >= FRAGMENTED_GAP_MIN_BYTES and gap_fraction >= FRAGMENTED_GAP_FRACTION
    if not retries and not fragmented:
        return None
    return Finding(
        rule="allocator-fragmentation",
        severity="warning" if retries else "info",
        title=(
            f"The CUDA caching allocator had to free its cache and retry {retries} time(s)"
            if retries
            else f"{100 * gap_fraction:.0f}% of reserved memory is cached but unallocated (fragmentation)"
        ),
        evidence={
            "alloc_retries": retries,
            "reserved_unallocated_max_bytes": gap_bytes,
            "reserved_unallocated_max_pct": 100 * gap_fraction,
        },
        fix=(
            "Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; keep tensor shapes stable "
            "(pad sequences to fixed buckets); free large temporaries before the backward pass."
        ),
    )


ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE = "expandable_segments:True"


@knob("expandable-segments", rule="allocator-fragmentation")
def expandable_segments(patch):
    """PYTORCH_CUDA_ALLOC_CONF gets expandable_segments:True (after what it already holds): the CUDA
    caching allocator grows segments instead of caching blocks of fixed sizes. No effect without CUDA."""
    given = os.environ.get(ALLOC_CONF)
    value = EXPANDABLE if not given else f"{given},{EXPANDABLE}"
    patch.environment(ALLOC_CONF, value, f'import os\nos.environ["{ALLOC_CONF}"] = "{value}"  # before torch initialises CUDA')
