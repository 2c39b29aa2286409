"""Collective communication that the step waits for instead of overlapping it with compute."""

from __future__ import annotations

from gpuprof.diagnoses.finding import Finding
from gpuprof.diagnoses.registry import rule

EXPOSED_COMM_WARNING_PCT = 10.0
EXPOSED_COMM_CRITICAL_PCT = 30.0


def exposed_comm(trace):
    """Per rank: communication time not hidden behind computation, as a share of step time."""
    overlap = trace.comm_comp_overlap()
    steps = trace.step_breakdown()
    if overlap.empty or steps.empty:
        return None
    step_us = steps.groupby("rank")["step_time_us"].sum()
    table = overlap.set_index("rank").join(step_us)
    table["exposed_us"] = table["communication_time_us"] - table["overlapped_time_us"]
    table["exposed_pct"] = 100 * table["exposed_us"] / table["step_time_us"]
    return table


@rule("communication-bound", "communication", gpu_only=True, on_trace=True)
def communication_bound(ctx):
    trace = ctx.device_trace
    table = exposed_comm(trace) if trace is not None else None
    if table is None or table["exposed_pct"].max() < EXPOSED_COMM_WARNING_PCT:
        return None
    worst = table.loc[table["exposed_pct"].idxmax()]
    accumulation = ctx.gradient_accumulation
    return Finding(
        rule="communication-bound",
        severity="critical" if worst["exposed_pct"] >= EXPOSED_COMM_CRITICAL_PCT else "warning",
        title=f"{worst['exposed_pct']:.0f}% of step time is communication not overlapped with compute "
        f"(overlap {worst['comm_comp_overlap_pct']:.0f}%)",
        evidence={
            "rank": int(worst.name),
            "exposed_comm_pct": float(worst["exposed_pct"]),
            "communication_time_us": int(worst["communication_time_us"]),
            "comm_comp_overlap_pct": float(worst["comm_comp_overlap_pct"]),
            "gradient_accumulation": accumulation,
            "threshold_pct": EXPOSED_COMM_WARNING_PCT,
        },
        fix=(
            "Overlap the all-reduce with backward: DDP(model, bucket_cap_mb=50..100, "
            "gradient_as_bucket_view=True, static_graph=True); skip it on all but the last micro-batch "
            "with model.no_sync() under gradient accumulation; use NCCL, and fewer, larger steps "
            "(bigger batch) to amortise it."
        ),
        est_gain_pct=float(worst["exposed_pct"]),
    )
