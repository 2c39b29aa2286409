"""Multi-rank problems: stragglers (by own work, and by arrival at the step's collectives), DataParallel,
and a non-NCCL backend on GPUs."""

from __future__ import annotations

import pandas as pd

from gpuprof.analysis.run.ranks import last_arrivals
from gpuprof.analysis.run.slow_steps import named_sites, sample_sites
from gpuprof.analysis.run.summary import OWN_WORK_PHASES
from gpuprof.diagnoses.finding import Finding
from gpuprof.diagnoses.registry import rule
from gpuprof.run.schema import SPLIT_PHASES

STRAGGLER_LAG_WARNING_PCT = 10.0
STRAGGLER_LAG_MIN_S = 0.002
EVIDENCE_RANKS = 10
SINGLE_PROCESS_WRAPPERS = {"DataParallel"}
# A rank that arrives last at the step's first all-reduce in more than this share of steps is the
# straggler; up to it, the last rank changes from step to step (jitter, no one rank at fault).
LAST_ARRIVAL_SHARE_PCT = 50.0
MIN_ARRIVAL_STEPS = 5


def ranks_wait_for_each_other(ctx) -> bool:
    """Several ranks in one process group (a run recorded before `process_group` was: taken as grouped)."""
    return ctx.world_size >= 2 and ctx.meta.get("process_group") is not False


@rule("independent-ranks", "communication")
def independent_ranks(ctx):
    """Processes launched as ranks of one job (torchrun sets RANK and WORLD_SIZE) that never joined a process group:
    each trains its own copy of the model, none waits for another, and the job is no faster than one of them."""
    if ctx.world_size < 2 or ctx.meta.get("process_group") is not False:
        return None
    return Finding(
        rule="independent-ranks",
        severity="warning",
        title=f"The {ctx.world_size} ranks never joined a process group: each trains alone, its own copy of the model",
        evidence={"world_size": ctx.world_size, "ranks_recorded": len(ctx.summary.per_rank)},
        fix=("Join the ranks into one job: torch.distributed.init_process_group() and DistributedDataParallel (or "
             "FSDP) in the script; Lightning: Trainer(devices=<processes per node>, strategy='ddp'); Accelerate: "
             "accelerate launch. Give each rank its shard of the data (DistributedSampler)."),
    )


@rule("rank-straggler", "communication")
def rank_straggler(ctx):
    # A rank's own work: the summary's per-rank median of the phases outside DDP's collectives.
    per_rank = ctx.summary.per_rank
    if not ranks_wait_for_each_other(ctx) or len(per_rank) < 2:
        return None
    per_rank_s = per_rank.set_index("rank")["own_work_p50_s"].dropna()
    if len(per_rank_s) < 2:
        return None
    slow_rank = int(per_rank_s.idxmax())
    others_s = float(per_rank_s.drop(slow_rank).median())
    lag_s = float(per_rank_s.max()) - others_s
    step_s = ctx.summary.step_time_p50_s
    lag_pct = 100 * lag_s / step_s if step_s else 0.0
    if lag_s < STRAGGLER_LAG_MIN_S or lag_pct < STRAGGLER_LAG_WARNING_PCT:
        return None
    return Finding(
        rule="rank-straggler",
        severity="warning",
        title=f"Rank {slow_rank} is a straggler: {1000 * lag_s:.0f} ms more work per step than the others wait for",
        evidence={
            "slow_rank": slow_rank,
            "lag_s": lag_s,
            "lag_pct_of_step": lag_pct,
            # the slowest ranks only: a 1024-rank run's every rank would drown the evidence
            "own_work_p50_s_by_rank": {int(rank): float(value) for rank, value in
                                       per_rank_s.nlargest(EVIDENCE_RANKS).sort_index().items()},
            "others_own_work_p50_s": others_s,
            "ranks": len(per_rank_s),
            "own_work_phases": list(OWN_WORK_PHASES),
            "threshold_pct": STRAGGLER_LAG_WARNING_PCT,
        },
        fix=(
            f"Find what rank {slow_rank} does more of: its data shard or loader, a busier host or CPU "
            "affinity, extra logging/checkpointing on that rank, a slower or throttled GPU. Balance the "
            "work; every rank waits for the slowest at each all-reduce."
        ),
        est_gain_pct=lag_pct,
    )


@rule("late-arrival", "communication")
def late_arrival(ctx):
    """A collective makes every rank wait for the slowest, in whatever phase it waits (DDP's all-reduce in the
    backward, a gather before the forward in "other"), so own work can hide the rank at fault; its arrivals
    at the step's collectives (host timestamps) do not."""
    if not ranks_wait_for_each_other(ctx):
        return None
    steps = last_arrivals(ctx.run)
    steps = steps[steps["step"] >= ctx.summary.warmup.n_steps]
    if len(steps) < MIN_ARRIVAL_STEPS:
        return None
    counts = steps["last_rank"].value_counts()
    rank, times = int(counts.index[0]), int(counts.iloc[0])
    share_pct = 100 * times / len(steps)
    lag_s = float(steps.loc[steps["last_rank"] == rank, "lag_s"].median())
    step_s = ctx.summary.step_time_p50_s
    lag_pct = 100 * lag_s / step_s if step_s else 0.0
    if lag_s < STRAGGLER_LAG_MIN_S or lag_pct < STRAGGLER_LAG_WARNING_PCT:
        return None
    late_steps = steps.loc[steps["last_rank"] == rank]
    collective = int(late_steps["collective"].mode().iloc[0])
    phase, excess_s = slower_phase(ctx.summary.per_rank, rank)
    waiting_at = waiting_sites(ctx, rank, pd.Index(late_steps["step"]))
    evidence = {"last_rank": rank, "last_in_steps": times, "steps": len(steps), "last_share_pct": share_pct,
                "lag_p50_s": lag_s, "lag_pct_of_step": lag_pct, "collective": collective,
                "slower_phase": phase, "slower_phase_excess_s": excess_s, "others_wait_at": waiting_at,
                "last_count_by_rank": {int(r): int(n) for r, n in counts.head(EVIDENCE_RANKS).items()}}
    if share_pct <= LAST_ARRIVAL_SHARE_PCT:
        return Finding(
            rule="late-arrival", severity="info", evidence=evidence,
            title=(f"A different rank arrives last at the step's collectives from step to step (rank {rank} most "
                   f"often, {times} of {len(steps)} steps): jitter, no one straggler"),
            fix="Look for what varies per step on every rank: data loading, host load, garbage collection.",
        )
    slower = f"its {phase} takes {1000 * excess_s:.0f} ms more per step than the other ranks'" if phase else None
    waiting = f"the others wait for it at {', '.join(waiting_at)}" if waiting_at else None
    return Finding(
        rule="late-arrival", severity="warning", evidence=evidence,
        title="; ".join(filter(None, [
            f"Rank {rank} arrives last at the step's collective {collective + 1} in {times} of {len(steps)} steps, "
            f"{1000 * lag_s:.0f} ms after the median rank" + (f": {slower}" if slower else ""), waiting])),
        fix=(f"Find what rank {rank} does more of before that collective{f' ({slower})' if slower else ''}: its data "
             "shard or loader, a busier host or CPU affinity, extra logging on that rank, a slower or throttled GPU."),
        est_gain_pct=lag_pct,
    )


def waiting_sites(ctx, late_rank: int, steps: pd.Index) -> list[str]:
    """Where another rank (the first) waits for `late_rank` in `steps`: its user's lines sampled in the phase
    where it spends the most more than `late_rank` does (its wait: `other` at a collective of the loop's,
    `backward` at DDP's); [] without stack samples of it."""
    table = ctx.summary.per_rank.set_index("rank")
    waiting = next((rank for rank in table.index if rank != late_rank), None)
    if waiting is None or late_rank not in table.index:
        return []
    phase, _ = phase_beyond(table, waiting, table.loc[late_rank], SPLIT_PHASES)
    return [] if phase is None else list(named_sites(sample_sites(ctx.run.query, int(waiting), steps, phase)).index)


def slower_phase(per_rank, rank: int) -> tuple[str | None, float | None]:
    """The phase of its own work in which `rank`'s median exceeds the other ranks' median the most, and by how
    much; (None, None) when none does."""
    table = per_rank.set_index("rank")
    if rank not in table.index or len(table) < 2:
        return None, None
    return phase_beyond(table, rank, table.drop(rank).median(numeric_only=True), OWN_WORK_PHASES)


def phase_beyond(table: pd.DataFrame, rank: int, reference: pd.Series, phases) -> tuple[str | None, float | None]:
    """Of `phases`, the one in which `rank`'s median time (its row of the per-rank `table`) exceeds `reference`
    (column -> seconds) the most, and by how much; (None, None) when it exceeds it in none."""
    excess = {phase: float(table.at[rank, column] - reference[column]) for phase in phases
              if pd.notna(table.at[rank, column := f"{phase}_time_p50_s"]) and pd.notna(reference.get(column))}
    phase = max(excess, key=excess.get, default=None)
    return (phase, excess[phase]) if phase is not None and excess[phase] > 0 else (None, None)


@rule("dataparallel", "communication")
def dataparallel(ctx):
    model = ctx.meta.get("model") or {}
    model_class = model.get("wrapper") or model.get("class")
    if model_class not in SINGLE_PROCESS_WRAPPERS:
        return None
    return Finding(
        rule="dataparallel",
        severity=ctx.gpu_warning,
        title="The model is wrapped in torch.nn.DataParallel (single process, one Python thread per GPU)",
        evidence={"model_class": model_class, "device_kind": ctx.summary.device_kind},
        fix=(
            "Use DistributedDataParallel with one process per GPU: torchrun --nproc-per-node N train.py, "
            "dist.init_process_group('nccl'), DDP(model, device_ids=[local_rank]). DataParallel "
            "re-scatters the model every step and is bound by the GIL."
        ),
    )


@rule("non-nccl-backend", "communication", gpu_only=True)
def non_nccl_backend(ctx):
    name = (ctx.meta.get("distributed") or {}).get("backend")
    if ctx.world_size < 2 or name is None or str(name).lower() == "nccl":
        return None
    return Finding(
        rule="non-nccl-backend",
        severity="warning",
        title=f"GPU ranks communicate through the {name!r} backend instead of NCCL",
        evidence={"backend": name, "world_size": ctx.world_size},
        fix="dist.init_process_group(backend='nccl') for CUDA tensors (gloo copies through host memory).",
    )
