"""The headline figures of one run: step time, throughput, MFU, memory, utilization, health.

Step times are taken after warm-up: the first steps pay for lazy initialisation,
allocator growth, autotuning and compilation and would inflate every average. The
summary says how many steps it excluded and why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from gpuprof.run import query as q
from gpuprof.run.jsonable import json_safe
from gpuprof.run.schema import EVAL_PHASE, SPLIT_PHASES, STEP_PHASES

# Phases outside the one that holds DDP's gradient all-reduce (backward): a rank's own work.
OWN_WORK_PHASES = tuple(phase for phase in SPLIT_PHASES if phase != "backward")

# Step 0 always pays for lazy init and allocator growth; later leading steps count as
# warm-up while they are this much slower than the median of the steps after them.
WARMUP_ALWAYS_STEPS = 1
WARMUP_SLOW_FACTOR = 1.5
# Never call more than this share of a run warm-up, and keep every step of a run this short.
WARMUP_MAX_FRACTION = 0.25
WARMUP_MIN_RUN_STEPS = 4


@dataclass(frozen=True)
class Warmup:
    n_steps: int
    reason: str
    # Step number of the first measured step (runs resumed from a checkpoint do not start at 0).
    first_measured_step: int = 0


@dataclass
class RunSummary:
    name: str
    path: str
    status: str | None
    world_size: int
    device_kind: str
    device_name: str | None
    n_steps: int
    warmup: Warmup
    step_time_p50_s: float | None
    step_time_p90_s: float | None
    step_time_p99_s: float | None
    step_time_mean_s: float | None
    step_time_cv: float | None
    tokens_per_s: float | None
    mfu: float | None
    flops_per_s: float | None
    peak_mem_allocated_bytes: float | None
    peak_mem_reserved_bytes: float | None
    peak_rss_bytes: float | None
    device_mem_total_bytes: float | None
    gpu_util_mean_pct: float | None
    phase_split_pct: dict = field(default_factory=dict)
    # Evaluation inside the loop over the measured steps (`evaluation_figures`); empty when the loop has none.
    evaluation: dict = field(default_factory=dict)
    health: dict = field(default_factory=dict)
    per_rank: pd.DataFrame = field(default_factory=pd.DataFrame)
    # Run-level time of every recorded step, warm-up included (see `step_times`); not in to_dict.
    step_times: pd.Series = field(default_factory=lambda: pd.Series(dtype=float), repr=False)
    # Each measured step's evaluation inside the loop, where it evaluated (`evaluation_times`); not in to_dict.
    eval_times: pd.Series = field(default_factory=lambda: pd.Series(dtype=float), repr=False)
    # Ranks of the world that left no readable steps (killed before writing, folder lost or damaged).
    missing_ranks: list = field(default_factory=list)
    # Of those, the ranks whose steps file is there but damaged (left out by the reader).
    damaged_ranks: list = field(default_factory=list)
    # The `device_figures` summarize was asked for, over the measured device samples; not in to_dict.
    device_figures: dict = field(default_factory=dict, repr=False)

    @property
    def peak_memory_bytes(self) -> float | None:
        """The headline peak: the allocator's on a GPU, the process RSS on a CPU."""
        return self.peak_mem_allocated_bytes if self.peak_mem_allocated_bytes is not None else self.peak_rss_bytes

    @property
    def measured_steps(self) -> int:
        return max(self.n_steps - self.warmup.n_steps, 0)

    @property
    def measured_step_times(self) -> pd.Series:
        return after_warmup_times(self.step_times, self.warmup)

    @property
    def training_step_times(self) -> pd.Series:
        """The measured step times less their evaluation: what the step-time figures are of."""
        return training_times(self.measured_step_times, self.eval_times)

    def to_dict(self) -> dict:
        data = {key: getattr(self, key) for key in self.__dataclass_fields__
                if key not in ("per_rank", "step_times", "eval_times", "device_figures")}
        data["warmup"] = dict(vars(self.warmup))
        data["measured_steps"] = self.measured_steps
        data["per_rank"] = self.per_rank.to_dict(orient="records")
        return json_safe(data)


def column(frame: pd.DataFrame, name: str) -> pd.Series:
    """A numeric column, or all-NaN when the run did not record it."""
    if name not in frame.columns:
        return pd.Series(np.nan, index=frame.index, dtype=float)
    return pd.to_numeric(frame[name], errors="coerce").astype(float)


def step_times(steps: pd.DataFrame) -> pd.Series:
    """Run-level time of each optimizer step: the slowest rank sets the pace of a synchronous step."""
    if steps.empty:
        return pd.Series(dtype=float)
    return column(steps, "step_time_s").groupby(steps["step"]).max().sort_index()


def detect_warmup(times: pd.Series) -> Warmup:
    """How many leading steps to leave out of the averages, and why."""
    n_steps = len(times)
    if n_steps < WARMUP_MIN_RUN_STEPS:
        first = int(times.index[0]) if n_steps else 0
        return Warmup(0, f"only {n_steps} steps recorded, too few to leave any out", first)
    max_steps = max(WARMUP_ALWAYS_STEPS, int(n_steps * WARMUP_MAX_FRACTION))
    values = times.to_numpy()
    n_warm = WARMUP_ALWAYS_STEPS
    while n_warm < max_steps and values[n_warm] > WARMUP_SLOW_FACTOR * np.median(values[n_warm + 1 :]):
        n_warm += 1
    reason = "the first step pays for lazy initialisation and allocator growth"
    if n_warm > WARMUP_ALWAYS_STEPS:
        reason = (
            f"the first step pays for lazy initialisation, and the next {n_warm - 1} were over "
            f"{WARMUP_SLOW_FACTOR}x the median of the later steps (compilation, autotuning)"
        )
    return Warmup(n_warm, reason, int(times.index[n_warm]))


def after_warmup_times(times: pd.Series, warmup: Warmup) -> pd.Series:
    """The entries of a `step_times` series that belong to measured (post-warm-up) steps."""
    return times[times.index >= warmup.first_measured_step]


def evaluation_times(query, measured_times: pd.Series) -> pd.Series:
    """Each measured step's evaluation time (the slowest rank's), only for the steps that evaluated."""
    evaluating = query.step_series(f"{EVAL_PHASE}_time_s", "max").dropna()
    return evaluating[evaluating.index.isin(measured_times.index)]


def training_times(measured_times: pd.Series, eval_times: pd.Series) -> pd.Series:
    """`measured_times` less each step's evaluation: evaluation is reported apart, and periodic
    evaluation is not erratic training."""
    return measured_times - eval_times.reindex(measured_times.index).fillna(0.0)


def run_step_times(query) -> pd.Series:
    """`step_times` of a whole run, aggregated out of core (the run's ranks never load into pandas)."""
    return query.step_series("step_time_s", "max")


def measured_steps(warmup: Warmup) -> list:
    """Query filter: the step rows of measured (post-warm-up) steps."""
    return [q.since_step(warmup.first_measured_step)]


def measured_samples(query, warmup: Warmup) -> list:
    """Query filter: system samples taken while measured steps ran (from the end of the last warm-up step)."""
    if warmup.n_steps == 0:
        return []
    end = query.aggregate("steps", {"end_s": q.maximum("time_unix_s")}, where=[q.at_step(warmup.first_measured_step - 1)])
    start_s = end["end_s"].iloc[0]
    return [q.since_time(float(start_s))] if pd.notna(start_s) else []


def measured_sample_figures(query, warmup: Warmup, device_figures: dict) -> dict:
    """The mean GPU utilization over the system samples of measured steps, and `device_figures`
    (name -> aggregate) over their device rows, as `device:NAME`: one scan of a stream that holds
    14 rows per step and rank (36M at 256 ranks), where a scan per figure costs most of a second."""
    device_rows = q.device_rows()
    aggregates = {"gpu_util_mean_pct": q.mean("gpu_util_pct"),
                  **{f"device:{name}": q.within(aggregate, device_rows) for name, aggregate in device_figures.items()}}
    return first_row(query.aggregate("system", aggregates, where=measured_samples(query, warmup)))


def first_row(frame: pd.DataFrame) -> dict:
    """The single row of an aggregate as plain numbers, None where unknown."""
    return json_safe(frame.iloc[0].to_dict(), digits=None)


def percentile(values: pd.Series, q: float) -> float | None:
    values = values.dropna()
    return float(np.percentile(values, q)) if len(values) else None


def flag(steps: pd.DataFrame, name: str, default: bool) -> pd.Series:
    """A boolean column with unrecorded values taken as `default`."""
    if name not in steps.columns:
        return pd.Series(default, index=steps.index, dtype=bool)
    return steps[name].astype("boolean").fillna(default).astype(bool)


def _known(value) -> float | None:
    return float(value) if value is not None and pd.notna(value) else None


def _figures(query, aggregates: dict, where=()) -> dict:
    row = query.aggregate("steps", aggregates, where=where).iloc[0]
    return {name: _known(row[name]) for name in aggregates}


MEASURED_FIGURES = {
    "tokens": q.total("tokens"),
    "mfu": q.weighted_mean("mfu", "step_time_s"),
    "flops_per_s": q.weighted_mean("flops_per_s", "step_time_s"),
    "step_time_total_s": q.total("step_time_s"),
    **{f"{phase}_total_s": q.total(f"{phase}_time_s") for phase in STEP_PHASES},
    "eval_rows": q.count(f"{EVAL_PHASE}_time_s"),
    "rows": q.count(),
}

WHOLE_RUN_FIGURES = {
    "peak_mem_allocated_bytes": q.maximum("mem_peak_allocated_bytes"),
    "peak_mem_reserved_bytes": q.maximum("mem_reserved_bytes"),
    "peak_rss_bytes": q.maximum("mem_rss_bytes"),
    "loss_first": q.first("loss"),
    "loss_last": q.last("loss"),
    "loss_steps": q.count("loss_finite"),  # steps that recorded a loss
    # steps, not rows: under torchrun every rank records each step
    "nonfinite_loss_steps": q.steps_where(q.is_false("loss_finite")),
    "nonfinite_grad_steps": q.steps_where(q.is_false("grad_norm_finite")),
    "skipped_steps": q.steps_where(q.is_true("step_skipped")),
    "grad_norm_p50": q.quantile(q.finite_only("grad_norm"), 0.5),
    "grad_norm_max": q.maximum(q.finite_only("grad_norm")),
    "scaler_scale_last": q.last("scaler_scale"),
    "scaler_scale_min": q.minimum("scaler_scale"),
}
HEALTH_KEYS = ("loss_first", "loss_last", "nonfinite_loss_steps", "nonfinite_grad_steps", "skipped_steps",
               "grad_norm_p50", "grad_norm_max", "scaler_scale_last", "scaler_scale_min")
COUNT_KEYS = ("nonfinite_loss_steps", "nonfinite_grad_steps", "skipped_steps")


def throughput_tokens_per_s(tokens: float | None, total_time_s: float) -> float | None:
    """Throughput over a set of steps; None when no step recorded its tokens."""
    return float(tokens / total_time_s) if tokens is not None and total_time_s > 0 else None


def phase_split_pct(figures: dict) -> dict:
    """Share of the summed training step time (step time less evaluation) spent in each phase; None for
    phases the run did not time."""
    total_s = figures["step_time_total_s"]
    if total_s:
        total_s -= figures["eval_total_s"] or 0.0
    return {
        phase: 100 * figures[f"{phase}_total_s"] / total_s
        if total_s and figures[f"{phase}_total_s"] is not None else None
        for phase in SPLIT_PHASES
    }


def evaluation_figures(eval_times: pd.Series, measured_times: pd.Series) -> dict:
    """How often the loop evaluated (`every_steps`: the median spacing of the evaluating steps, None for one
    evaluation), how long each took (a step's evaluation is its slowest rank's, as its time is) and its share of
    the run's time (training and evaluation); empty when no step evaluated. `eval_times` is indexed by step."""
    total_s, run_s = float(eval_times.sum()), float(measured_times.sum())
    if not total_s:
        return {}
    evaluations = len(eval_times)
    spacing = np.diff(np.sort(eval_times.index.to_numpy(dtype=float)))
    return {"steps_with_eval": evaluations, "every_steps": float(np.median(spacing)) if len(spacing) else None,
            "mean_s": total_s / evaluations, "total_s": total_s, "share_pct": 100 * total_s / run_s if run_s else None}


def health(figures: dict) -> dict:
    """Loss, gradient and GradScaler figures over every step (problems in warm-up count too)."""
    values = {key: int(figures[key] or 0) if key in COUNT_KEYS else figures[key] for key in HEALTH_KEYS}
    if not figures["loss_steps"]:
        values["nonfinite_loss_steps"] = None  # no step recorded a loss: n/a, never "0 non-finite"
    return values


PER_RANK_FIGURES = {
    "steps": q.count(),
    "step_time_p50_s": q.quantile("step_time_s", 0.5),
    "step_time_p90_s": q.quantile("step_time_s", 0.9),
    **{f"{phase}_time_p50_s": q.quantile(f"{phase}_time_s", 0.5) for phase in SPLIT_PHASES},
    # Under DDP the gradient all-reduce runs inside backward, so every other phase is a rank's
    # own work: the rank that is slow there makes all the others wait (the straggler).
    "own_work_p50_s": q.quantile(q.row_total(*(f"{phase}_time_s" for phase in OWN_WORK_PHASES)), 0.5),
    "tokens": q.total("tokens"),
    "step_time_total_s": q.total("step_time_s"),
    "mfu": q.weighted_mean("mfu", "step_time_s"),
    "peak_mem_allocated_bytes": q.maximum("mem_peak_allocated_bytes"),
}


def per_rank(query, warmup: Warmup) -> pd.DataFrame:
    """Figures of each rank over the measured steps, one row per rank."""
    table = query.aggregate("steps", PER_RANK_FIGURES, by="rank", where=measured_steps(warmup))
    if table.empty:
        return pd.DataFrame()
    known = table["tokens"].notna() & (table["step_time_total_s"] > 0)
    table["tokens_per_s"] = (table["tokens"] / table["step_time_total_s"]).where(known)
    table = table.astype({"rank": int, "steps": int})
    columns = ["rank", "steps", "step_time_p50_s", "step_time_p90_s", *(f"{p}_time_p50_s" for p in SPLIT_PHASES),
               "own_work_p50_s", "tokens_per_s", "mfu", "peak_mem_allocated_bytes"]
    return table[columns]


def slowest_ranks(per_rank_table: pd.DataFrame, limit: int = 10) -> pd.DataFrame:
    """The ranks with the most own work per step (the straggler first), against the median rank;
    ranked by step time when no phase was timed."""
    if per_rank_table.empty:
        return pd.DataFrame()
    key = "own_work_p50_s" if per_rank_table["own_work_p50_s"].notna().any() else "step_time_p50_s"
    median = per_rank_table[key].median()
    table = per_rank_table[["rank", "step_time_p50_s", "own_work_p50_s"]].assign(
        vs_median_pct=100 * (per_rank_table[key] - median) / median if median else np.nan)
    return table.sort_values(key, ascending=False, ignore_index=True).head(limit)


def primary_device(meta: dict) -> dict:
    devices = meta.get("devices") or [{}]
    return devices[0] or {}


def step_time_figures(measured_times: pd.Series) -> dict:
    """Percentiles, mean and coefficient of variation of the measured step times (less evaluation), in seconds."""
    mean_s = float(measured_times.mean()) if len(measured_times) else None
    return {
        "step_time_p50_s": percentile(measured_times, 50),
        "step_time_p90_s": percentile(measured_times, 90),
        "step_time_p99_s": percentile(measured_times, 99),
        "step_time_mean_s": mean_s,
        "step_time_cv": float(measured_times.std(ddof=0) / mean_s) if mean_s else None,
    }


def summarize(run, device_figures: dict | None = None) -> RunSummary:
    """The run's headline figures, after leaving out warm-up steps (see `detect_warmup`), and the
    `device_figures` (name -> aggregate) over the measured device samples.

    Computed by the run's query engine (`run.query`), so memory stays bounded at any number of ranks."""
    query = run.query
    times = run_step_times(query)
    warmup = detect_warmup(times)
    measured_times = after_warmup_times(times, warmup)
    measured = _figures(query, MEASURED_FIGURES, measured_steps(warmup)) if len(times) else dict.fromkeys(MEASURED_FIGURES)
    whole = _figures(query, WHOLE_RUN_FIGURES) if len(times) else dict.fromkeys(WHOLE_RUN_FIGURES)
    samples = measured_sample_figures(query, warmup, device_figures or {})
    eval_times = evaluation_times(query, measured_times) if measured["eval_rows"] else pd.Series(dtype=float)
    device = primary_device(run.meta)
    return RunSummary(
        name=run.name,
        path=str(run.path),
        status=run.meta.get("status"),
        world_size=int(run.meta.get("world_size") or 1),
        device_kind=device.get("kind") or "cpu",
        device_name=device.get("name"),
        n_steps=len(times),
        warmup=warmup,
        **step_time_figures(training_times(measured_times, eval_times)),
        tokens_per_s=throughput_tokens_per_s(measured["tokens"], float(measured_times.sum())),
        mfu=measured["mfu"],
        flops_per_s=measured["flops_per_s"],
        peak_mem_allocated_bytes=whole["peak_mem_allocated_bytes"],
        peak_mem_reserved_bytes=whole["peak_mem_reserved_bytes"],
        peak_rss_bytes=whole["peak_rss_bytes"],
        device_mem_total_bytes=device.get("total_memory_bytes") if device.get("kind") == "cuda" else None,
        gpu_util_mean_pct=_known(samples["gpu_util_mean_pct"]),
        phase_split_pct=phase_split_pct(measured) if len(times) else dict.fromkeys(SPLIT_PHASES),
        evaluation=evaluation_figures(eval_times, measured_times),
        health=health(whole),
        per_rank=per_rank(query, warmup) if len(times) else pd.DataFrame(),
        step_times=times,
        eval_times=eval_times,
        missing_ranks=query.missing_ranks,
        damaged_ranks=query.damaged_ranks,
        device_figures={name: samples[f"device:{name}"] for name in device_figures or {}},
    )


TRACE_WARMUP_REASON = "a trace window: the profiler's schedule (wait, warmup) keeps warm-up steps out of it"


def trace_summary(name: str, path: str, step_breakdown: pd.DataFrame, meta: dict, device_figures=()) -> RunSummary:
    """The summary of a bare trace: its profiler steps' times (the slowest rank's, as a run's), its
    devices and ranks (`meta`, as the trace records them); everything only a gpuprof run records, the
    `device_figures` (names) included, is unknown (None), its counts zero."""
    steps = step_breakdown
    times = (steps.groupby("step")["step_time_us"].max().sort_index() / 1e6) if not steps.empty else pd.Series(dtype=float)
    device = primary_device(meta)
    unknown = dict.fromkeys(WHOLE_RUN_FIGURES)
    return RunSummary(
        name=name, path=path, status=None,
        world_size=int(meta.get("world_size") or 1),
        device_kind=device.get("kind") or "cpu", device_name=device.get("name"),
        n_steps=len(times), warmup=Warmup(0, TRACE_WARMUP_REASON, int(times.index[0]) if len(times) else 0),
        **step_time_figures(times),
        tokens_per_s=None, mfu=None, flops_per_s=None,
        peak_mem_allocated_bytes=None, peak_mem_reserved_bytes=None, peak_rss_bytes=None,
        device_mem_total_bytes=device.get("total_memory_bytes"), gpu_util_mean_pct=None,
        phase_split_pct=dict.fromkeys(SPLIT_PHASES), health=health(unknown), per_rank=pd.DataFrame(),
        step_times=times, device_figures=dict.fromkeys(device_figures),
    )


# Per measured step, across ranks: what `gpuprof compare` resamples (gpuprof.analysis.run.stats).
STEP_TABLE_FIGURES = {
    "step_time_s": q.maximum("step_time_s"),  # the run's step: the slowest rank sets its pace
    "rank_time_s": q.total("step_time_s"),  # what phase shares divide, as `phase_split_pct` does
    "tokens": q.total("tokens"),
    **{f"{phase}_time_s": q.total(f"{phase}_time_s") for phase in SPLIT_PHASES},
    "mfu": q.weighted_mean("mfu", "step_time_s"),
    "loss": q.mean(q.finite_only("loss")),
}


def measured_step_table(query, warmup: Warmup) -> pd.DataFrame:
    """One row per measured step (`STEP_TABLE_FIGURES`), in step order, with a `step` column."""
    return query.aggregate("steps", STEP_TABLE_FIGURES, by="step", where=measured_steps(warmup))
