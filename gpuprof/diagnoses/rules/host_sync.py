"""Host-device synchronisations inside the training step (.item(), .cpu(), print(loss)).

Read from the run's trace windows. A device trace shows the sync calls themselves and the
CPU ops that made them. A CPU-only trace has no device to wait for, but the loop's habit is
there all the same: every host read of a tensor value runs `aten::_local_scalar_dense`, which
on a GPU would block until the device catches up. Reads inside `optimizer.step()` (CPU step
counters) and gpuprof's own bookkeeping are not the loop's and are left out.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from gpuprof.analysis.trace.events import step_windows
from gpuprof.diagnoses.finding import Finding
from gpuprof.diagnoses.registry import rule
from gpuprof.run.schema import OWN_WORK_RANGE

# Event syncs are how NCCL and the profiler itself wait on streams; the user's code makes
# the others (a device-to-host copy for .item()/.cpu(), stream or device synchronize).
USER_SYNC_TYPES = ("device-to-host copy", "stream sync", "device sync")
SYNCS_PER_STEP_MIN = 1.0
HOST_READ_OP = "aten::_local_scalar_dense"
# Ranges whose host reads are not the loop's: torch's optimizer step (its per-parameter step
# counters live on the CPU) and gpuprof's own step-end work.
NOT_THE_LOOP = ("Optimizer.step#", OWN_WORK_RANGE)
FIX = (
    "Keep values on the device inside the step: accumulate loss.detach() into a tensor and read it "
    "every N steps (log_every), drop print(loss)/.item()/.cpu()/.tolist() from the loop, and avoid "
    "data-dependent control flow on tensor values."
)


def device_syncs(trace) -> tuple | None:
    """The loop's syncs in a device trace: (causes, steps, evidence, expected gain %)."""
    syncs = trace.host_device_syncs()
    syncs = syncs[syncs["sync_type"].isin(USER_SYNC_TYPES) & syncs["step"].notna()]
    steps = trace.step_breakdown()
    if syncs.empty or steps.empty:
        return None
    causes = syncs["innermost_cpu_op"].fillna(syncs["cpu_op"]).fillna("unknown").value_counts()
    blocked_pct = 100 * syncs["dur_us"].sum() / steps["step_time_us"].sum()
    evidence = {
        "source": "trace",
        "by_type": {str(kind): int(count) for kind, count in syncs["sync_type"].value_counts().items()},
        "host_blocked_pct_of_step": blocked_pct,
    }
    # The host stops feeding the GPU for the time it blocks.
    return causes, len(steps), evidence, blocked_pct


def enclosing(ranges: pd.DataFrame, ops: pd.DataFrame) -> np.ndarray:
    """For each op, whether one of `ranges` on its thread encloses it."""
    if ranges.empty or ops.empty:
        return np.zeros(len(ops), dtype=bool)
    same_thread = (ops["tid"].to_numpy()[:, None] == ranges["tid"].to_numpy()[None, :])
    starts_before = ops["ts_us"].to_numpy()[:, None] >= ranges["ts_us"].to_numpy()[None, :]
    ends_after = ops["end_us"].to_numpy()[:, None] <= ranges["end_us"].to_numpy()[None, :]
    return (same_thread & starts_before & ends_after).any(axis=1)


def rank_host_reads(rank_trace) -> tuple[int, int]:
    """The loop's host reads inside the profiler steps of one rank, and the number of steps."""
    events = rank_trace.events
    host = events[~events["is_device"].to_numpy()]
    names = host["name"].astype(str)
    reads = host[(names == HOST_READ_OP).to_numpy()]
    reads = reads[~enclosing(host[names.str.startswith(NOT_THE_LOOP).to_numpy()], reads)]
    windows = step_windows(rank_trace)
    windows = windows[windows["step"] >= 0]
    read_us = reads["ts_us"].to_numpy()[:, None]
    inside = (read_us >= windows["start_us"].to_numpy()) & (read_us < windows["end_us"].to_numpy())
    return int(inside.any(axis=1).sum()), len(windows)


def cpu_host_reads(trace) -> tuple | None:
    """The loop's host reads of tensor values in a CPU-only trace: (causes, steps, evidence, None)."""
    counts = [rank_host_reads(rank_trace) for rank_trace in trace.trace.ranks.values()]
    reads, n_steps = sum(count for count, _ in counts), sum(steps for _, steps in counts)
    if not reads or not n_steps:
        return None
    # A read costs nothing without a device to wait for: the habit is reported, not a time.
    return pd.Series({HOST_READ_OP: reads}), n_steps, {"source": "cpu-trace"}, None


@rule("host-device-sync", "host", on_trace=True)
def host_device_sync(ctx):
    if ctx.trace is None:
        return None
    on_device = ctx.device_trace is not None
    found = device_syncs(ctx.trace) if on_device else cpu_host_reads(ctx.trace)
    if found is None:
        return None
    causes, n_steps, evidence, est_gain_pct = found
    per_step = int(causes.sum()) / n_steps
    if per_step < SYNCS_PER_STEP_MIN:
        return None
    return Finding(
        rule="host-device-sync",
        severity="warning" if on_device else ctx.gpu_warning,
        title=(f"{per_step:.1f} host-device syncs per step, mostly from {causes.index[0]}" if on_device else
               f"{per_step:.1f} reads of tensor values on the host per step, mostly from {causes.index[0]}: "
               "each would be a host-device sync on a GPU"),
        evidence={
            "syncs_per_step": per_step,
            "by_cpu_op": {str(op): int(count) for op, count in causes.head(5).items()},
            **evidence,
            "device_kind": ctx.summary.device_kind,
            "threshold_per_step": SYNCS_PER_STEP_MIN,
        },
        fix=FIX,
        est_gain_pct=est_gain_pct,
    )
