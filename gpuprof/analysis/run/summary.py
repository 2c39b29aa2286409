"""The headline figures of one run: step time, throughput, MFU, memory, utilization, health.

Step times are taken after warm-up: the first steps pay for lazy initialisation,
allocator growth, autotuning and compilation and would inflate every average. The
summary says how many steps it excluded and why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from gpuprof.analysis.run.jsonable import json_safe

PHASES = ("data", "forward", "backward", "optimizer", "other")

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
    health: dict = field(default_factory=dict)
    per_rank: pd.DataFrame = field(default_factory=pd.DataFrame)
    # Run-level time of every recorded step, warm-up included (see `step_times`); not in to_dict.
    step_times: pd.Series = field(default_factory=lambda: pd.Series(dtype=float), repr=False)

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

    def to_dict(self) -> dict:
        data = {key: getattr(self, key) for key in self.__dataclass_fields__ if key not in ("per_rank", "step_times")}
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


def after_warmup(frame: pd.DataFrame, warmup: Warmup) -> pd.DataFrame:
    """The rows of a per-step table that belong to measured (post-warm-up) steps."""
    if frame.empty or "step" not in frame.columns:
        return frame
    return frame[pd.to_numeric(frame["step"], errors="coerce") >= warmup.first_measured_step]


def after_warmup_times(times: pd.Series, warmup: Warmup) -> pd.Series:
    """The entries of a `step_times` series that belong to measured (post-warm-up) steps."""
    return times[times.index >= warmup.first_measured_step]


def measured_window_start_s(steps: pd.DataFrame, warmup: Warmup) -> float | None:
    """Wall-clock time at which the first measured step began (the end of the last warm-up step)."""
    if warmup.n_steps == 0 or steps.empty:
        return None
    last_warm = steps[steps["step"] == warmup.first_measured_step - 1]
    return float(column(last_warm, "time_unix_s").max()) if not last_warm.empty else None


def measured_samples(system: pd.DataFrame, steps: pd.DataFrame, warmup: Warmup) -> pd.DataFrame:
    """System samples taken while measured steps ran."""
    start_s = measured_window_start_s(steps, warmup)
    if system.empty or start_s is None:
        return system
    return system[column(system, "time_unix_s") >= start_s]


def percentile(values: pd.Series, q: float) -> float | None:
    values = values.dropna()
    return float(np.percentile(values, q)) if len(values) else None


def time_weighted(values: pd.Series, weights: pd.Series) -> float | None:
    known = values.notna() & weights.notna()
    total = weights[known].sum()
    return float((values[known] * weights[known]).sum() / total) if total > 0 else None


def throughput_tokens_per_s(tokens: pd.Series, total_time_s: float) -> float | None:
    """Throughput over a set of steps; None when no step recorded its tokens."""
    if not tokens.notna().any() or not total_time_s > 0:
        return None
    return float(tokens.sum() / total_time_s)


def max_or_none(values: pd.Series) -> float | None:
    values = values.dropna()
    return float(values.max()) if len(values) else None


def phase_split_pct(steps: pd.DataFrame) -> dict:
    """Share of summed step time spent in each phase; None for phases the run did not time."""
    total_s = column(steps, "step_time_s").sum()
    split = {}
    for phase in PHASES:
        values = column(steps, f"{phase}_time_s")
        split[phase] = float(100 * values.sum() / total_s) if total_s > 0 and values.notna().any() else None
    return split


def health(steps: pd.DataFrame) -> dict:
    """Loss, gradient and GradScaler figures over every step (problems in warm-up count too)."""
    loss = column(steps, "loss").dropna()
    grad_norm = column(steps, "grad_norm")
    scale = column(steps, "scaler_scale").dropna()
    return {
        "loss_first": float(loss.iloc[0]) if len(loss) else None,
        "loss_last": float(loss.iloc[-1]) if len(loss) else None,
        "nonfinite_loss_steps": count_false(steps, "loss_finite"),
        "nonfinite_grad_steps": count_false(steps, "grad_norm_finite"),
        "skipped_steps": count_true(steps, "step_skipped"),
        "grad_norm_p50": percentile(grad_norm[np.isfinite(grad_norm)], 50),
        "grad_norm_max": max_or_none(grad_norm[np.isfinite(grad_norm)]),
        "scaler_scale_last": float(scale.iloc[-1]) if len(scale) else None,
        "scaler_scale_min": float(scale.min()) if len(scale) else None,
    }


def flag(steps: pd.DataFrame, name: str, default: bool) -> pd.Series:
    """A boolean column with unrecorded values taken as `default`."""
    if name not in steps.columns:
        return pd.Series(default, index=steps.index, dtype=bool)
    return steps[name].astype("boolean").fillna(default).astype(bool)


def count_true(steps: pd.DataFrame, name: str) -> int:
    return int(flag(steps, name, False).sum())


def count_false(steps: pd.DataFrame, name: str) -> int:
    return int((~flag(steps, name, True)).sum())


def per_rank(measured: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for rank, frame in measured.groupby("rank"):
        times = column(frame, "step_time_s")
        row = {"rank": int(rank), "steps": len(frame)}
        row["step_time_p50_s"] = percentile(times, 50)
        row["step_time_p90_s"] = percentile(times, 90)
        for phase in PHASES:
            row[f"{phase}_time_p50_s"] = percentile(column(frame, f"{phase}_time_s"), 50)
        row["tokens_per_s"] = throughput_tokens_per_s(column(frame, "tokens"), times.sum())
        row["mfu"] = time_weighted(column(frame, "mfu"), times)
        row["peak_mem_allocated_bytes"] = max_or_none(column(frame, "mem_peak_allocated_bytes"))
        rows.append(row)
    return pd.DataFrame(rows)


def primary_device(meta: dict) -> dict:
    devices = meta.get("devices") or [{}]
    return devices[0] or {}


def summarize(run) -> RunSummary:
    """The run's headline figures, after leaving out warm-up steps (see `detect_warmup`)."""
    steps = run.steps
    times = step_times(steps)
    warmup = detect_warmup(times)
    measured = after_warmup(steps, warmup)
    measured_times = after_warmup_times(times, warmup)
    mean_s = float(measured_times.mean()) if len(measured_times) else None
    samples = measured_samples(run.system, steps, warmup)
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
        step_time_p50_s=percentile(measured_times, 50),
        step_time_p90_s=percentile(measured_times, 90),
        step_time_p99_s=percentile(measured_times, 99),
        step_time_mean_s=mean_s,
        step_time_cv=float(measured_times.std(ddof=0) / mean_s) if mean_s else None,
        tokens_per_s=throughput_tokens_per_s(column(measured, "tokens"), measured_times.sum()),
        mfu=time_weighted(column(measured, "mfu"), column(measured, "step_time_s")),
        flops_per_s=time_weighted(column(measured, "flops_per_s"), column(measured, "step_time_s")),
        peak_mem_allocated_bytes=max_or_none(column(steps, "mem_peak_allocated_bytes")),
        peak_mem_reserved_bytes=max_or_none(column(steps, "mem_reserved_bytes")),
        peak_rss_bytes=max_or_none(column(steps, "mem_rss_bytes")),
        device_mem_total_bytes=device.get("total_memory_bytes") if device.get("kind") == "cuda" else None,
        gpu_util_mean_pct=mean_or_none(column(samples, "gpu_util_pct")),
        phase_split_pct=phase_split_pct(measured),
        health=health(steps),
        per_rank=per_rank(measured) if not measured.empty else pd.DataFrame(),
        step_times=times,
    )


def mean_or_none(values: pd.Series) -> float | None:
    values = values.dropna()
    return float(values.mean()) if len(values) else None
