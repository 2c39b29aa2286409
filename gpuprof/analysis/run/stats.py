"""Figures with their uncertainty: confidence intervals from a moving-block bootstrap over steps.

Neighbouring steps are not independent: a page-cache miss, a collector's GC pause or another
job on the machine slows several steps in a row. Resampling single steps would treat that as
noise that averages out and give intervals too narrow. The moving-block bootstrap resamples runs
of `block_length` consecutive steps instead, so a resample keeps the run's autocorrelation. The
block length is chosen from the data by Politis & White's rule (2004, with Patton, Politis &
White's 2009 correction): long when the steps' autocorrelation decays slowly, one step when the
steps are independent. Each run is resampled on its own (two runs share no steps).

Every figure is a ratio of means over the same resampled steps (speedup, throughput, phase
shares), so figures computed from one run's steps never contradict each other: speedup and
throughput ratio agree exactly when every step trains the same number of tokens.
The intervals are bootstrap percentile intervals. Method and its checks: docs/compare.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from gpuprof.errors import GpuprofError

DEFAULT_CONFIDENCE = 0.95
N_RESAMPLES = 2000
# A bootstrap of fewer steps says nothing about their spread.
MIN_STEPS = 3
# B's loss over the later half of the steps may sit this much (relative) above A's before a
# difference the interval is sure of counts as a divergence: rounding in another kernel order
# moves a loss by far less, a numerics bug by far more.
LOSS_TOLERANCE_REL = 0.01
# Politis & White's threshold constant and their ceiling on the block length.
_PW_THRESHOLD_C = 2.0


class TooFewStepsError(GpuprofError):
    """Fewer measured steps than a bootstrap needs."""


@dataclass(frozen=True)
class Interval:
    """A point estimate and its confidence interval, low <= point <= high."""

    point: float
    low: float
    high: float
    confidence: float

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high

    def inverted(self) -> Interval:
        """The interval of 1/x (a speedup as a slowdown ratio)."""
        return Interval(1 / self.point, 1 / self.high, 1 / self.low, self.confidence)

    def to_dict(self) -> dict:
        return {"point": self.point, "low": self.low, "high": self.high, "confidence": self.confidence}


def block_length(values) -> int:
    """Politis & White's optimal block length for a moving-block bootstrap of the mean of `values`."""
    x = np.asarray(values, dtype=float)
    n = len(x)
    if n < MIN_STEPS:
        return 1
    x = x - x.mean()
    n_check = max(5, math.ceil(math.sqrt(math.log10(n))))
    max_lag = min(math.ceil(math.sqrt(n)) + n_check, n - 1)
    acov = np.array([x[: n - k] @ x[k:] / n for k in range(max_lag + 1)])
    if acov[0] <= 0:
        return 1
    bandwidth = 2 * _last_significant_lag(acov / acov[0], n, n_check)
    if bandwidth == 0:
        return 1
    lags = np.arange(-bandwidth, bandwidth + 1)
    weights = _flat_top(lags / bandwidth) * acov[np.minimum(np.abs(lags), max_lag)]
    long_run_var, g = weights.sum(), (np.abs(lags) * weights).sum()
    if long_run_var <= 0 or g == 0:
        return 1
    length = (2 * g**2 / (4 / 3 * long_run_var**2)) ** (1 / 3) * n ** (1 / 3)
    return int(min(max(math.ceil(length), 1), math.ceil(min(3 * math.sqrt(n), n / 3))))


def _last_significant_lag(rho: np.ndarray, n: int, n_check: int) -> int:
    """The smallest lag after which `n_check` autocorrelations in a row are insignificant."""
    threshold = _PW_THRESHOLD_C * math.sqrt(math.log10(n) / n)
    insignificant = np.abs(rho[1:]) < threshold  # index i is lag i + 1
    for lag in range(len(insignificant) - n_check + 1):
        if insignificant[lag: lag + n_check].all():
            return lag
    return len(rho) - 1


def _flat_top(t: np.ndarray) -> np.ndarray:
    t = np.abs(t)
    return np.where(t <= 0.5, 1.0, np.where(t <= 1.0, 2 * (1 - t), 0.0))


@dataclass(frozen=True)
class Estimate:
    """A figure's observed value and its value in every bootstrap resample; arithmetic on
    estimates of the same resamples keeps them paired (a ratio of two columns, of two runs)."""

    point: float
    replicates: np.ndarray

    def interval(self, confidence: float = DEFAULT_CONFIDENCE) -> Interval:
        return percentile_interval(self.point, self.replicates, confidence)

    def __truediv__(self, other: Estimate) -> Estimate:
        return Estimate(self.point / other.point, self.replicates / other.replicates)

    def __sub__(self, other: Estimate) -> Estimate:
        return Estimate(self.point - other.point, self.replicates - other.replicates)

    def __mul__(self, factor: float) -> Estimate:
        return Estimate(self.point * factor, self.replicates * factor)


@dataclass(frozen=True)
class Resampled:
    """One run's column means: observed, and over `N_RESAMPLES` block-bootstrap resamples of its steps."""

    observed: dict
    replicates: dict
    n_steps: int
    block_steps: int

    def mean(self, column: str) -> Estimate:
        return Estimate(float(self.observed[column]), self.replicates[column])


def resample_means(columns: dict, *, seed=0, n_resamples: int = N_RESAMPLES) -> Resampled:
    """Resample one run's steps in blocks, every column with the same steps (a row per step).
    The block length is the longest any column asks for."""
    table = np.column_stack([np.asarray(values, dtype=float) for values in columns.values()])
    n = len(table)
    if n < MIN_STEPS:
        raise TooFewStepsError(f"{n} measured steps are too few to tell the noise (at least {MIN_STEPS})")
    length = max(block_length(table[:, index]) for index in range(table.shape[1]))
    means = _block_means(table, length, n_resamples, np.random.default_rng(seed))
    return Resampled(
        observed=dict(zip(columns, table.mean(axis=0))),
        replicates={name: means[:, index] for index, name in enumerate(columns)},
        n_steps=n, block_steps=length,
    )


def _block_means(table: np.ndarray, length: int, n_resamples: int, rng) -> np.ndarray:
    """Column means of `n_resamples` resamples of `n` rows made of random blocks of `length`
    consecutive rows (the last block cut short), from prefix sums: no resample is materialised."""
    n = len(table)
    n_full, rest = divmod(n, length)
    prefix = np.vstack([np.zeros(table.shape[1]), np.cumsum(table, axis=0)])
    starts = rng.integers(0, n - length + 1, size=(n_resamples, n_full + (rest > 0)))
    full = starts[:, :n_full]
    sums = (prefix[full + length] - prefix[full]).sum(axis=1)
    if rest:
        sums += prefix[starts[:, -1] + rest] - prefix[starts[:, -1]]
    return sums / n


def percentile_interval(point: float, replicates: np.ndarray, confidence: float = DEFAULT_CONFIDENCE) -> Interval:
    alpha = 1 - confidence
    low, high = np.quantile(replicates, [alpha / 2, 1 - alpha / 2])
    return Interval(float(point), float(min(low, point)), float(max(high, point)), confidence)


def speedup_interval(a_step_times_s, b_step_times_s, *, confidence: float = DEFAULT_CONFIDENCE,
                     seed: int = 0) -> Interval:
    """Speedup of B over A, mean step time of A over B's (above 1: B is faster), with its interval."""
    a = resample_means({"step_time_s": a_step_times_s}, seed=(seed, 0))
    b = resample_means({"step_time_s": b_step_times_s}, seed=(seed, 1))
    return (a.mean("step_time_s") / b.mean("step_time_s")).interval(confidence)


def mean_interval(values, *, confidence: float = DEFAULT_CONFIDENCE, seed: int = 0) -> Interval:
    return resample_means({"value": values}, seed=seed).mean("value").interval(confidence)


def scaled_steps(n_steps: int, half_width: float, target_half_width: float) -> int:
    """Steps for an interval of `target_half_width` where `n_steps` gave `half_width`: widths fall as 1/sqrt(n)."""
    if target_half_width <= 0:
        raise GpuprofError(f"the interval's target half-width must be positive, got {target_half_width}")
    return max(MIN_STEPS, math.ceil(n_steps * (half_width / target_half_width) ** 2))


def steps_needed(step_times_s, rel_half_width: float, *, confidence: float = DEFAULT_CONFIDENCE,
                 seed: int = 0) -> int:
    """Measured steps that give the mean step time an interval of +-`rel_half_width` (0.05: +-5 %),
    extrapolated from these steps' own noise and autocorrelation."""
    interval = mean_interval(step_times_s, confidence=confidence, seed=seed)
    return scaled_steps(len(step_times_s), interval.half_width / interval.point, rel_half_width)


def loss_shift_interval(a_losses, b_losses, *, confidence: float = DEFAULT_CONFIDENCE, seed: int = 0) -> Interval:
    """How far B's loss sits above A's over the later half of their common steps, relative to A's
    (0.02: 2 % higher). Steps are paired by position (the caller aligns them by step number), so
    the same data order cancels out; each loss must be finite."""
    n = min(len(a_losses), len(b_losses))
    a = np.asarray(a_losses[:n], dtype=float)[n // 2:]
    b = np.asarray(b_losses[:n], dtype=float)[n // 2:]
    resampled = resample_means({"shift": b - a, "a": np.abs(a)}, seed=seed)
    return (resampled.mean("shift") / resampled.mean("a")).interval(confidence)


def loss_diverges(a_losses, b_losses, *, confidence: float = DEFAULT_CONFIDENCE,
                  tolerance_rel: float = LOSS_TOLERANCE_REL, seed: int = 0) -> bool:
    """Whether B's loss curve sits above A's beyond its noise: the whole interval of
    `loss_shift_interval` lies past `tolerance_rel`."""
    return loss_shift_interval(a_losses, b_losses, confidence=confidence, seed=seed).low > tolerance_rel
