"""Host-side readings of the per-step values, once they arrive: each returns events to write.

- `ScalerTimeline`: GradScaler backoffs during warm-up (benign), persistent overflow,
  scale below 1, and recovery.
- `SpikeDetector`: a loss or gradient-norm value far above its rolling window (z-score).
- `LayerGradients`: a block whose gradient norm is far above (exploding) or below
  (vanishing) the median block at the same step.
- `oversized_update`: the step whose update made the weights jump, for a later non-finite step;
  `nonfinite_update`: the step whose update made them non-finite.
An event is a dict with kind, severity, message, step and details (Profiler.event's arguments).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

from gpuprof.blocks import block_groups, combined_norm
from gpuprof.run.schema import EventKind


Event = dict[str, Any]
PERSISTENT_OVERFLOW_STEPS = 3  # GradScaler skips in a row, after warm-up, that make it a real problem


def _event(kind: str, severity: str, message: str, step: int, **details: Any) -> Event:
    return {"kind": kind, "severity": severity, "message": message, "step": step, "details": details}


class ScalerTimeline:
    """Backoffs before the first successful step are warm-up; a streak later is an overflow."""

    def __init__(self, persistent_after: int = PERSISTENT_OVERFLOW_STEPS):
        self.persistent_after = persistent_after
        self._warmed_up = False
        self._streak = 0
        self._below_one_reported = False

    def observe(self, step: int, skipped: bool | None, scale: float | None) -> list[Event]:
        if skipped is None or scale is None:
            return []
        events = []
        if skipped:
            events += self._backoff(step, scale)
        elif self._streak >= self.persistent_after:
            events.append(_event(EventKind.SCALER_RECOVERY, "info",
                                 f"GradScaler recovered at step {step} after {self._streak} skipped steps "
                                 f"(scale {scale:g})", step, skipped_steps=self._streak, scale=scale))
        if not skipped:
            self._warmed_up, self._streak = True, 0
        if scale < 1 and not self._below_one_reported:
            self._below_one_reported = True
            events.append(_event(EventKind.SCALER_SCALE_BELOW_ONE, "critical",
                                 f"GradScaler scale fell to {scale:g} at step {step}: gradients are Inf/NaN "
                                 "even unscaled, a real non-finite value rather than an fp16 range problem",
                                 step, scale=scale))
        return events

    def _backoff(self, step: int, scale: float) -> list[Event]:
        if not self._warmed_up:
            return [_event(EventKind.SCALER_BACKOFF, "info",
                           f"GradScaler warm-up backoff at step {step} (scale now {scale:g}): benign",
                           step, scale=scale, warm_up=True)]
        self._streak += 1
        if self._streak != self.persistent_after:
            return []
        return [_event(EventKind.SCALER_PERSISTENT_OVERFLOW, "warning",
                       f"GradScaler skipped {self._streak} steps in a row up to step {step} "
                       f"(scale now {scale:g}): persistent overflow", step,
                       skipped_steps=self._streak, scale=scale)]


class SpikeDetector:
    """A value more than `z` standard deviations above the mean of the last `window` values."""

    def __init__(self, kind: str, what: str, z: float = 6.0, window: int = 50, min_history: int = 10):
        self.kind, self.what, self.z = kind, what, z
        self.min_history = min_history
        self._values: deque[float] = deque(maxlen=window)
        # Running sums keep observe() O(1): it runs once per step, over 100k-step runs too.
        self._sum = self._sum_sq = 0.0

    def observe(self, step: int, value: float | None) -> list[Event]:
        if value is None or not math.isfinite(value):
            return []
        events = []
        if len(self._values) >= self.min_history:
            mean, std = self._mean_std()
            score = (value - mean) / std if std > 0 else 0.0
            if score > self.z:
                events.append(_event(self.kind, "warning",
                                     f"{self.what} spike at step {step}: {value:.4g} is {score:.1f} standard "
                                     f"deviations above the last {len(self._values)} steps' mean {mean:.4g}",
                                     step, value=value, z_score=score, mean=mean, std=std))
        self._push(value)
        return events

    def _push(self, value: float) -> None:
        if len(self._values) == self._values.maxlen:
            dropped = self._values[0]
            self._sum -= dropped
            self._sum_sq -= dropped * dropped
        self._values.append(value)
        self._sum += value
        self._sum_sq += value * value

    def _mean_std(self) -> tuple[float, float]:
        count = len(self._values)
        mean = self._sum / count
        return mean, math.sqrt(max(self._sum_sq / count - mean * mean, 0.0))


class LayerGradients:
    """Blocks whose gradient norm is `factor` times above or below the median block (each reported once)."""

    def __init__(self, names: list[str], factor: float = 1e3):
        self.blocks = block_groups(names)
        self.factor = factor
        self._reported: set[tuple[str, str]] = set()

    def observe(self, step: int, param_grad_norms: list[float] | None) -> list[Event]:
        if not param_grad_norms or len(self.blocks) < 2:
            return []
        norms = {block: combined_norm(param_grad_norms, indices) for block, indices in self.blocks.items()}
        finite = [n for n in norms.values() if math.isfinite(n)]
        median = statistics.median(finite) if finite else 0.0
        if median <= 0:
            return []
        events = []
        for block, norm in norms.items():
            kind = EventKind.EXPLODING_GRADIENT if norm > median * self.factor else \
                EventKind.VANISHING_GRADIENT if norm < median / self.factor else None
            if kind and (kind, block) not in self._reported:
                self._reported.add((kind, block))
                events.append(_event(kind, "warning",
                                     f"{kind.replace('_', ' ')} in {block} at step {step}: gradient norm "
                                     f"{norm:.3g} vs the median block's {median:.3g}", step,
                                     layer=block, grad_norm=norm, median_block_grad_norm=median))
        return events


def oversized_update(history: list[dict[str, Any]], bad_step: int, ratio: float = 100.0,
                     lookback: int = 20) -> dict[str, Any] | None:
    """The step before `bad_step` whose update multiplied the largest |weight| by `ratio` or more.

    `history` holds, per step, `param_absmax` at the start of the step and `lrs`, each param
    group's lr it used (of several optimizers, theirs in order).
    """
    by_step = {row["step"]: row for row in history}
    for step in range(bad_step - 1, max(-1, bad_step - 1 - lookback), -1):
        before, after = by_step.get(step), by_step.get(step + 1)
        if not before or not after or not before.get("param_absmax"):
            continue
        growth = after["param_absmax"] / before["param_absmax"]
        if math.isfinite(growth) and growth >= ratio:  # a non-finite weight is nonfinite_update's
            return _update_cause("oversized_update", by_step, step, lookback, before["param_absmax"],
                                 after["param_absmax"], f"grew the largest |weight| from {before['param_absmax']:.3g} "
                                 f"to {after['param_absmax']:.3g}")
    return None


def nonfinite_update(history: list[dict[str, Any]], bad_step: int, lookback: int = 20) -> dict[str, Any] | None:
    """The update of the step before `bad_step` when it made the weights non-finite: the largest |weight|
    (`param_absmax` in `history`, as oversized_update reads it) finite as that step began and not right after its
    update (`param_absmax_after`). That step's loss and gradients were finite, or it would be the bad step."""
    by_step = {row["step"]: row for row in history}
    step = bad_step - 1
    row = by_step.get(step) or {}
    before, after = row.get("param_absmax"), row.get("param_absmax_after")
    if before is None or after is None or not math.isfinite(before) or math.isfinite(after):
        return None
    return _update_cause("nonfinite_update", by_step, step, lookback, before, after,
                         f"made the weights non-finite: the largest |weight| {before:.3g} as it began, "
                         f"{after} after it")


def _update_cause(kind: str, by_step: dict[int, dict[str, Any]], step: int, lookback: int, before: float,
                  after: float, what: str) -> dict[str, Any]:
    """The cause dict of step `step`'s update, which did `what`, with the lr it ran with."""
    group, lr, median_lr = _largest_lr_rise(by_step, step, lookback)
    lr_text = "lr unknown" if lr is None else f"lr {lr:.3g}" + (
        f" of param group {group}" if len(by_step[step].get("lrs") or []) > 1 else "")
    if lr is not None and median_lr and math.isfinite(lr):
        lr_text += f", {lr / median_lr:.3g}x the median lr before it"
    return {"kind": kind, "step": step, "param_absmax_before": before, "param_absmax_after": after, "lr": lr,
            "median_lr": median_lr, "param_group": group, "summary": f"step {step}'s update {what} ({lr_text})"}


def _largest_lr_rise(by_step: dict[int, dict[str, Any]], step: int, lookback: int):
    """(param group, its lr at `step`, its median lr over the steps before) for the group whose lr rose
    most against that median; (None, None, None) without lrs."""
    rises = []
    for group, lr in enumerate(by_step[step].get("lrs") or []):
        if lr is None:
            continue
        past = [row["lrs"][group] for s in range(step - lookback, step) if (row := by_step.get(s))
                and len(row.get("lrs") or []) > group and row["lrs"][group]]
        median_lr = statistics.median(past) if past else None
        rises.append((lr / median_lr if median_lr else 0.0, group, lr, median_lr))
    if not rises:
        return None, None, None
    # a nan lr (its rise nan) is the largest rise of all
    _, group, lr, median_lr = max(rises, key=lambda rise: rise[0] if math.isfinite(rise[0]) else math.inf)
    return group, lr, median_lr
