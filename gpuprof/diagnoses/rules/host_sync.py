"""Host-device synchronisations inside the training step (.item(), .cpu(), print(loss)).

From the device trace when the run has one (the sync calls and the CPU ops that made them),
else from the run's config when it records the habit (the reference workload's --host-sync).
"""

from __future__ import annotations

from gpuprof.diagnoses.finding import Finding
from gpuprof.diagnoses.registry import rule

# Event syncs are how NCCL and the profiler itself wait on streams; the user's code makes
# the others (a device-to-host copy for .item()/.cpu(), stream or device synchronize).
USER_SYNC_TYPES = ("device-to-host copy", "stream sync", "device sync")
SYNCS_PER_STEP_MIN = 1.0
FIX = (
    "Keep values on the device inside the step: accumulate loss.detach() into a tensor and read it "
    "every N steps (log_every), drop print(loss)/.item()/.cpu()/.tolist() from the loop, and avoid "
    "data-dependent control flow on tensor values."
)


def trace_finding(ctx, trace) -> Finding | None:
    syncs = trace.host_device_syncs()
    syncs = syncs[syncs["sync_type"].isin(USER_SYNC_TYPES) & syncs["step"].notna()]
    steps = trace.step_breakdown()
    if syncs.empty or steps.empty:
        return None
    per_step = len(syncs) / len(steps)
    if per_step < SYNCS_PER_STEP_MIN:
        return None
    blocked_pct = 100 * syncs["dur_us"].sum() / steps["step_time_us"].sum()
    causes = syncs["innermost_cpu_op"].fillna(syncs["cpu_op"]).fillna("unknown").value_counts()
    return Finding(
        rule="host-device-sync",
        severity="warning",
        title=f"{per_step:.1f} host-device syncs per step, mostly from {causes.index[0]}",
        evidence={
            "source": "trace",
            "syncs_per_step": per_step,
            "by_cpu_op": {str(op): int(count) for op, count in causes.head(5).items()},
            "by_type": {str(kind): int(count) for kind, count in syncs["sync_type"].value_counts().items()},
            "host_blocked_pct_of_step": blocked_pct,
            "threshold_per_step": SYNCS_PER_STEP_MIN,
        },
        fix=FIX,
        # The host stops feeding the GPU for the time it blocks.
        est_gain_pct=blocked_pct,
    )


def config_finding(ctx) -> Finding | None:
    if not ctx.config_value("host_sync", "sync_every_step"):
        return None
    return Finding(
        rule="host-device-sync",
        severity=ctx.gpu_warning,
        title="The loop reads a tensor value on the host every step (loss.item()), stalling the GPU queue",
        evidence={"source": "config", "host_sync": True, "device_kind": ctx.summary.device_kind},
        fix=FIX,
    )


@rule("host-device-sync")
def host_device_sync(ctx):
    trace = ctx.device_trace
    found = trace_finding(ctx, trace) if trace is not None else None
    return found or config_finding(ctx)
