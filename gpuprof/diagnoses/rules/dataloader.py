"""Steps that wait for the data loader."""

from __future__ import annotations

from gpuprof.analysis.run.summary import column, percentile
from gpuprof.diagnoses.finding import Finding
from gpuprof.diagnoses.registry import rule

DATA_SHARE_WARNING_PCT = 15.0
DATA_SHARE_CRITICAL_PCT = 40.0


def fix_for(num_workers) -> str:
    if not num_workers:
        return (
            "Prepare batches in background workers so they overlap compute: DataLoader(num_workers=4, "
            "pin_memory=True, persistent_workers=True, prefetch_factor=2) (gpuprof train: --num-workers); "
            "tokenize and augment offline, not per step."
        )
    return (
        f"The {num_workers} loader workers do not keep up: make each batch cheaper (tokenize offline, "
        "memory-map the data), raise prefetch_factor, and add workers only if CPU cores are free "
        "(workers compete with the training process for them)."
    )


@rule("dataloader-bound")
def dataloader_bound(ctx):
    data_share_pct = ctx.summary.phase_split_pct.get("data")
    if data_share_pct is None or data_share_pct < DATA_SHARE_WARNING_PCT:
        return None
    severity = "critical" if data_share_pct >= DATA_SHARE_CRITICAL_PCT else "warning"
    return Finding(
        rule="dataloader-bound",
        severity=severity,
        title=f"{data_share_pct:.0f}% of step time is spent waiting for the next batch",
        evidence={
            "data_share_pct": data_share_pct,
            "data_time_p50_s": percentile(column(ctx.measured, "data_time_s"), 50),
            "step_time_p50_s": ctx.summary.step_time_p50_s,
            "num_workers": ctx.config_value("num_workers"),
            "threshold_pct": DATA_SHARE_WARNING_PCT,
        },
        fix=fix_for(ctx.config_value("num_workers")),
        # Workers can hide the whole wait when they keep up with compute.
        est_gain_pct=data_share_pct,
    )
