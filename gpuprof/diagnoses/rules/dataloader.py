"""Steps that wait for the next batch.

Read from the measured data phase (DataLoader iteration and the loop's own batch function,
wherever in the step they run: gpuprof.capture.phases), else from a trace's step breakdown (its
DataLoader `__next__` spans, as the TensorBoard plugin read them), and, for the fix, what the loop
fetches with: the DataLoader capture saw (workers, pinning, prefetch), or, for a loop without one,
the function where the time goes (the stack samples, else the batch function gpuprof timed).
"""

from __future__ import annotations

import os

import pandas as pd

from gpuprof.diagnoses.finding import Finding
from gpuprof.diagnoses.fits import LOADER_PREFETCH_FACTOR, Hardware
from gpuprof.diagnoses.knob import knob
from gpuprof.diagnoses.registry import rule
from gpuprof.run import query as q

DATA_SHARE_WARNING_PCT = 15.0
DATA_SHARE_CRITICAL_PCT = 40.0
UNEVEN_FACTOR = 2.0  # a rank waiting this many times the median rank's share is named
EVIDENCE_RANKS = 10
PIN_MEMORY_FIX = " The loader does not pin memory: pin_memory=True lets each batch's copy to the GPU run asynchronously."


def trainer_loader_arguments(workers: int) -> str:
    """Where a Hugging Face Trainer builds the DataLoader from its TrainingArguments (the run's config holds them)."""
    return (f" (the Trainer builds it: TrainingArguments(dataloader_num_workers={workers}, "
            f"dataloader_persistent_workers=True, dataloader_prefetch_factor={LOADER_PREFETCH_FACTOR}), "
            f"--dataloader_num_workers={workers} where the script parses them)")


def fix_for(num_workers, hardware: Hardware, flags: str = "") -> str:
    if not num_workers:
        return (
            f"Prepare batches in background workers so they overlap compute: DataLoader("
            f"{hardware.loader_arguments()}){flags}; tokenize and augment offline, not per step."
        )
    return (
        f"The {num_workers} loader workers do not keep up: make each batch cheaper (tokenize offline, "
        "memory-map the data), raise prefetch_factor, and add workers only if CPU cores are free "
        "(workers compete with the training process for them)."
    )


def fix_without_loader(site: str | None, hardware: Hardware) -> str:
    """For a loop that makes its own batches (nanoGPT's get_batch): the same overlap, in its terms."""
    where = f"{site} takes the time: " if site else ""
    device = (" Keep the batch in pinned memory (tensor.pin_memory()) and copy it with "
              ".to(device, non_blocking=True) so the copy overlaps compute." if hardware.pin_memory else "")
    return (
        f"{where}prepare the next batches while the step computes: in a background thread filling a "
        "queue.Queue a few batches ahead, or wrap the batch logic in a torch.utils.data.Dataset and iterate a "
        f"DataLoader(dataset, {hardware.loader_arguments()}); make each batch "
        f"cheaper (memory-map the data, tokenize offline).{device}"
    )


def loader_arguments(ctx) -> str:
    """Where the loop's DataLoader is built from a Hugging Face Trainer's TrainingArguments, their names."""
    if ctx.config_value("dataloader_num_workers") is None:
        return ""
    return trainer_loader_arguments(ctx.hardware.loader_workers)


def num_workers(ctx):
    """From the DataLoader capture saw; a workload's num_workers knob when it saw none."""
    loader = ctx.loop("loader")
    return loader.get("num_workers") if loader else ctx.config_value("num_workers")


def data_share(ctx) -> tuple[float, dict] | None:
    """Share of step time spent waiting for data (pct) and its source: the measured data phase, else the
    data-loader time of the traced steps; None when neither was recorded."""
    phase_pct = ctx.summary.phase_split_pct.get("data")
    if phase_pct is not None:
        return phase_pct, {"source": "phase timings",
                           "data_time_p50_s": ctx.measured({"p50": q.quantile("data_time_s", 0.5)})["p50"].iloc[0]}
    steps = ctx.trace.step_breakdown() if ctx.trace is not None else None
    if steps is None or steps.empty or not steps["step_time_us"].sum():
        return None
    share_pct = 100 * float(steps["dataloader_us"].sum() / steps["step_time_us"].sum())
    return share_pct, {"source": "trace", "data_time_p50_s": float(steps["dataloader_us"].median()) / 1e6}


@rule("dataloader-bound", "input", on_trace=True)
def dataloader_bound(ctx):
    measured = data_share(ctx)
    if measured is None or measured[0] < DATA_SHARE_WARNING_PCT:
        return None
    data_share_pct, source = measured
    workers = num_workers(ctx)
    loader = ctx.loop("loader")
    site = ctx.top_site("data")
    hardware = ctx.hardware
    if loader or workers is not None or ctx.bare_trace:  # a trace's data time is its DataLoader's
        fix = fix_for(workers, hardware, ctx.workload_flags("--num-workers") or loader_arguments(ctx))
        fix += PIN_MEMORY_FIX if hardware.pin_memory and loader.get("pin_memory") is False else ""
    else:
        fix = fix_without_loader(site, hardware)
    # the estimate assumes the workers the fix names
    helpers = hardware.loader_workers if not workers else None
    by_rank = rank_data_shares(ctx.summary.per_rank)
    uneven = one_rank_waits(by_rank)
    return Finding(
        rule="dataloader-bound",
        severity="critical" if data_share_pct >= DATA_SHARE_CRITICAL_PCT else "warning",
        title=f"{data_share_pct:.0f}% of step time is spent waiting for the next batch" + (
            f", most of it on rank {uneven[0]} ({uneven[1]:.0f}% of its step; the other ranks {uneven[2]:.0f}%)"
            if uneven else ""),
        evidence={
            "data_share_pct": data_share_pct,
            "data_share_pct_by_rank": dict(by_rank.nlargest(EVIDENCE_RANKS).sort_index().items()) or None,
            **source,
            "step_time_p50_s": ctx.summary.step_time_p50_s,
            "num_workers": workers,
            "loader": loader or None,
            "batch_function": site,
            "estimate_workers": helpers,
            "threshold_pct": DATA_SHARE_WARNING_PCT,
        },
        fix=fix,
        # With workers already, cheaper batches can hide the whole wait; see hidden_by_workers_pct otherwise.
        est_gain_pct=data_share_pct if helpers is None else hidden_by_workers_pct(data_share_pct, helpers),
    )


def rank_data_shares(per_rank: pd.DataFrame) -> pd.Series:
    """Each rank's median data time over its median step time (pct), by rank; empty for one rank."""
    if len(per_rank) < 2:
        return pd.Series(dtype=float)
    table = per_rank.set_index("rank")
    return (100 * table["data_time_p50_s"] / table["step_time_p50_s"]).dropna().rename(index=int)


def one_rank_waits(shares: pd.Series) -> tuple[int, float, float] | None:
    """(rank, its share, the other ranks' median) when one rank's data share is at least UNEVEN_FACTOR times the
    other ranks' median: the average over ranks then hides where the wait is (the others wait for that rank
    elsewhere, at a collective)."""
    if len(shares) < 2:
        return None
    rank = int(shares.idxmax())
    others = float(shares.drop(rank).median())
    return (rank, float(shares.max()), others) if shares.max() >= UNEVEN_FACTOR * max(others, 1.0) else None


def hidden_by_workers_pct(data_share_pct: float, workers: int) -> float:
    """The saving of step time when `workers` prepare the batches while the step computes (the fix's workers, at
    most one per core of the run's host): each batch still takes its whole data time in one worker, so a step
    falls to the longer of its other work and its data time over the workers. Recalibrated from a trial
    (docs/rules.md#estimates-checked-by-trials): 'the whole wait' read 21.8x where 2 workers measured 2.14x."""
    data = data_share_pct / 100
    return 100 * (1 - max(1 - data, data / workers))


def loader_workers_for_host() -> int:
    """The workers the loader knob gives: those a fix advises for the cores this process may use."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return Hardware(cpu_count=cores or 1).loader_workers


@knob("loader-workers", rule="dataloader-bound", train_flags=("--num-workers", "2"))
def loader_workers(patch):
    """DataLoaders built without workers get them: num_workers = one per CPU core (at most 4),
    persistent_workers=True, prefetch_factor=2, and pin_memory=True where CUDA is present.

    A loader the script gave workers, and one over an IterableDataset (each worker would iterate the
    whole of it), are left as they are. Batches come in the same order: the sampler still runs in the
    main process. Random augmentation inside the dataset draws from each worker's own seed."""
    import torch

    def choose(bound) -> dict:
        given = bound.arguments
        if given.get("num_workers") or isinstance(given.get("dataset"), torch.utils.data.IterableDataset):
            return {}
        chosen = {"num_workers": loader_workers_for_host(), "persistent_workers": True,
                  "prefetch_factor": LOADER_PREFETCH_FACTOR}
        if torch.cuda.is_available() and not given.get("pin_memory"):
            chosen["pin_memory"] = True
        return chosen

    patch.keywords(torch.utils.data.DataLoader, choose)
