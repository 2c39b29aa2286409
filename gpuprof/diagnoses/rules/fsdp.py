"""Sharded training (FSDP2): exposed all-gathers and reduce-scatters, prefetch that does not
overlap, memory per rank against what DDP would need, and the reshard_after_forward trade-off.

A run is sharded when capture recorded `distributed.sharding` in its meta (gpuprof found
DTensor parameters; it also reads reshard_after_forward from the FSDP2 units). Collective times
come from the trace (gpuprof.analysis.trace.collectives), memory from the step records and the meta.
"""

from __future__ import annotations

from gpuprof.diagnoses.finding import Finding
from gpuprof.diagnoses.registry import rule
from gpuprof.run import query as q
from gpuprof.units import bytes_text

SHARDED_KINDS = ("all_gather", "reduce_scatter")
EXPOSED_WARNING_PCT = 10.0
EXPOSED_CRITICAL_PCT = 30.0
PREFETCH_MIN_PCT = 5.0  # all-gather time, as a share of step time, worth overlapping
PREFETCH_OVERLAP_PCT = 50.0
DDP_FITS_PCT = 80.0  # DDP's estimated peak per rank, as a share of the memory a rank has
RESHARD_HEADROOM_PCT = 50.0  # peak per rank below this share of memory: room to keep parameters gathered
RESHARD_TIGHT_PCT = 90.0
RESHARD_EXPOSED_PCT = 5.0
BYTES_PER_DTYPE = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}


def sharding(ctx) -> dict | None:
    """What capture found on the model objects (DTensor parameters, FSDP2 units); in a bare trace, the
    all-gathers and reduce-scatters it holds; None when unsharded."""
    if ctx.bare_trace:
        kinds = ctx.trace.collective_times()["collective"]
        return {"seen_in": "trace collectives"} if kinds.isin(SHARDED_KINDS).any() else None
    return (ctx.meta.get("distributed") or {}).get("sharding") or None


def collective_table(ctx):
    """Per rank: all-gather and reduce-scatter time and exposed time per step, and exposed % of step."""
    trace = ctx.trace
    if trace is None:
        return None

    def compute():
        times = trace.collective_times()
        steps = trace.step_breakdown()
        if times.empty or steps.empty:
            return None
        times = times[times["collective"].isin(SHARDED_KINDS)]
        step_us = steps.groupby("rank")["step_time_us"].mean()
        per_step = times.assign(**{column_: times[column_] / times["steps"] for column_ in ("time_us", "exposed_us", "count")})
        table = per_step.pivot(index="rank", columns="collective", values=["time_us", "exposed_us", "overlap_pct", "count"])
        table.columns = [f"{kind}_{value}" for value, kind in table.columns]
        table["step_time_us"] = step_us
        for kind in SHARDED_KINDS:
            for value in ("time_us", "exposed_us", "overlap_pct", "count"):
                table[f"{kind}_{value}"] = table.get(f"{kind}_{value}", 0.0)
        exposed = table[[f"{kind}_exposed_us" for kind in SHARDED_KINDS]].fillna(0).sum(axis=1)
        table["exposed_pct"] = 100 * exposed / table["step_time_us"]
        return table

    return ctx.memo("fsdp_collectives", compute)


def _worst_rank(table):
    return table.loc[table["exposed_pct"].idxmax()]


@rule("fsdp-exposed-collectives", "communication", on_trace=True)
def exposed_collectives(ctx):
    table = collective_table(ctx) if sharding(ctx) is not None else None
    if table is None or table["exposed_pct"].max() < EXPOSED_WARNING_PCT:
        return None
    worst = _worst_rank(table)
    evidence = {"rank": int(worst.name), "exposed_pct": float(worst["exposed_pct"]),
                "step_time_us": float(worst["step_time_us"]), "threshold_pct": EXPOSED_WARNING_PCT}
    for kind in SHARDED_KINDS:
        for value in ("time_us", "exposed_us", "count"):
            evidence[f"{kind}_{value}_per_step"] = float(worst[f"{kind}_{value}"])
    return Finding(
        rule="fsdp-exposed-collectives",
        severity="critical" if worst["exposed_pct"] >= EXPOSED_CRITICAL_PCT else "warning",
        title=f"{worst['exposed_pct']:.0f}% of step time waits on FSDP all-gathers and reduce-scatters "
        f"(rank {int(worst.name)})",
        evidence=evidence,
        fix=("Give each collective more compute to hide behind: a larger micro-batch or sequence per rank; "
             f"gather in 16 bits (MixedPrecisionPolicy(param_dtype={ctx.hardware.half_dtype}, "
             "reduce_dtype=torch.float32)) to halve all-gather bytes; fewer, larger fully_shard units; "
             "reshard_after_forward=False where memory allows (one all-gather per unit instead of two); "
             "under gradient accumulation set_requires_gradient_sync(False) on all but the last micro-batch; "
             "if the model fits, DDP."),
        est_gain_pct=float(worst["exposed_pct"]),
    )


@rule("fsdp-prefetch-not-overlapped", "communication", gpu_only=True, on_trace=True)
def prefetch_not_overlapped(ctx):
    table = collective_table(ctx) if sharding(ctx) is not None else None
    if table is None:
        return None
    share = 100 * table["all_gather_time_us"] / table["step_time_us"]
    candidates = table[(share >= PREFETCH_MIN_PCT) & (table["all_gather_overlap_pct"] < PREFETCH_OVERLAP_PCT)]
    if candidates.empty:
        return None
    worst = candidates.loc[candidates["all_gather_overlap_pct"].idxmin()]
    exposed_pct = float(100 * worst["all_gather_exposed_us"] / worst["step_time_us"])
    return Finding(
        rule="fsdp-prefetch-not-overlapped",
        severity="warning",
        title=f"FSDP all-gathers overlap compute only {worst['all_gather_overlap_pct']:.0f}% of the time: "
        f"the next unit's parameters are not prefetched behind this one's compute (rank {int(worst.name)})",
        evidence={"rank": int(worst.name), "all_gather_overlap_pct": float(worst["all_gather_overlap_pct"]),
                  "all_gather_time_us_per_step": float(worst["all_gather_time_us"]),
                  "all_gather_exposed_pct": exposed_pct, "threshold_overlap_pct": PREFETCH_OVERLAP_PCT},
        fix=("Let the CPU run ahead of the GPU so all-gathers are issued early: remove host syncs (.item(), "
             "printing tensors) from the step, and launch less per step (CUDA graphs, torch.compile). Prefetch "
             "explicitly: block_i.set_modules_to_forward_prefetch([block_i+1]) and "
             "set_modules_to_backward_prefetch([block_i-1]); call model.unshard() for the first unit before "
             "forward. Check that all-gathers run on their own stream (no all-gather kernels between compute "
             "kernels of the same stream)."),
        est_gain_pct=exposed_pct,
    )


def rank_memory(ctx) -> dict | None:
    """Peak memory a rank used and had, in bytes: CUDA allocator on a GPU, process RSS and host memory
    shared by the ranks on a CPU."""
    if ctx.on_gpu:
        peak = ctx.all_steps({"peak": q.maximum("mem_peak_allocated_bytes")})["peak"]
        capacity = ctx.device.get("total_memory_bytes")
    else:
        peak = ctx.all_steps({"peak": q.maximum("mem_rss_bytes")})["peak"]
        host = ctx.run.query.aggregate("system", {"total": q.maximum("host_mem_total_bytes")})["total"].iloc[0]
        capacity = host / ctx.world_size if host == host and host else None
    if not peak or not capacity:
        return None
    return {"peak_bytes_per_rank": float(peak), "capacity_bytes_per_rank": float(capacity)}


@rule("fsdp-memory-vs-ddp", "communication")
def memory_vs_ddp(ctx):
    facts, memory = sharding(ctx), rank_memory(ctx)
    if not facts or "model_state_bytes" not in facts or memory is None:
        return None
    ddp_bytes = memory["peak_bytes_per_rank"] - facts["model_state_bytes_per_rank"] + facts["model_state_bytes"]
    ddp_pct = 100 * ddp_bytes / memory["capacity_bytes_per_rank"]
    if ddp_pct > DDP_FITS_PCT:
        return None
    table = collective_table(ctx)
    exposed_pct = float(table["exposed_pct"].max()) if table is not None else None
    costly = exposed_pct is not None and exposed_pct >= EXPOSED_WARNING_PCT
    saved = facts["model_state_bytes"] - facts["model_state_bytes_per_rank"]
    return Finding(
        rule="fsdp-memory-vs-ddp",
        severity="warning" if costly else "info",
        title=f"The model would fit without sharding: DDP would peak near {bytes_text(ddp_bytes)} per rank "
        f"({ddp_pct:.0f}% of {bytes_text(memory['capacity_bytes_per_rank'])}); FSDP saves {bytes_text(saved)} per rank",
        evidence={**memory, "model_state_bytes": facts["model_state_bytes"],
                  "model_state_bytes_per_rank": facts["model_state_bytes_per_rank"],
                  "ddp_peak_bytes_per_rank_est": ddp_bytes, "ddp_peak_pct": ddp_pct,
                  "exposed_collectives_pct": exposed_pct, "threshold_pct": DDP_FITS_PCT},
        fix=("Sharding buys memory with communication. Where the memory is not needed, DDP (one all-reduce "
             "per step, overlapped with backward) is usually faster; or spend the memory on a larger "
             "micro-batch or reshard_after_forward=False, which hide FSDP's collectives better."),
        est_gain_pct=exposed_pct if costly else None,
    )


@rule("fsdp-reshard-after-forward", "communication")
def reshard_after_forward(ctx):
    facts, memory, table = sharding(ctx), rank_memory(ctx), collective_table(ctx)
    reshard = facts.get("reshard_after_forward") if facts else None
    if not facts or memory is None or reshard is None or "param_bytes" not in facts:
        return None
    peak_pct = 100 * memory["peak_bytes_per_rank"] / memory["capacity_bytes_per_rank"]
    # parameters kept gathered from forward to backward: the whole model in the compute dtype, less the shard
    dtype_bytes = BYTES_PER_DTYPE.get(ctx.meta.get("compute_dtype") or "fp32", 4)
    gathered = facts["param_bytes"] * dtype_bytes / 4 - facts["param_bytes_per_rank"]
    evidence = {"reshard_after_forward": reshard, "peak_pct_of_memory": peak_pct,
                "gathered_param_bytes": gathered, **memory}
    if reshard and table is not None and peak_pct < RESHARD_HEADROOM_PCT:
        worst = _worst_rank(table)
        gather_pct = float(100 * worst["all_gather_exposed_us"] / worst["step_time_us"])
        if gather_pct < RESHARD_EXPOSED_PCT:
            return None
        return Finding(
            rule="fsdp-reshard-after-forward", severity="warning",
            title=f"Parameters are re-gathered for backward although memory is {peak_pct:.0f}% used: "
            f"exposed all-gathers take {gather_pct:.0f}% of the step",
            evidence={**evidence, "all_gather_exposed_pct": gather_pct,
                      "all_gathers_per_step": float(worst["all_gather_count"]),
                      "threshold_headroom_pct": RESHARD_HEADROOM_PCT},
            fix=(f"fully_shard(..., reshard_after_forward=False){ctx.workload_flags('--no-reshard-after-forward')} keeps "
                 f"each unit's parameters gathered until its backward: about {bytes_text(gathered)} more per rank, "
                 "and the backward all-gathers disappear; or reshard_after_forward=N to keep them gathered "
                 "within groups of N ranks."),
            est_gain_pct=gather_pct / 2,  # about half the all-gathers are backward's
        )
    if not reshard and peak_pct >= RESHARD_TIGHT_PCT:
        return Finding(
            rule="fsdp-reshard-after-forward", severity="warning",
            title=f"Parameters stay gathered from forward to backward with memory {peak_pct:.0f}% used",
            evidence={**evidence, "threshold_tight_pct": RESHARD_TIGHT_PCT},
            fix=(f"reshard_after_forward=True frees about {bytes_text(gathered)} per rank after each unit's forward, "
                 "at the cost of gathering the parameters again in backward."),
        )
    return None
