"""GradScaler state per step: scale, growth tracker, and whether optimizer.step() was skipped.

`scaler.update()` is wrapped (on this instance only, undone at close) to read the
per-optimizer found-inf tensors that `scaler.step()` left, before `update()` clears them.
They are summed on the device; nothing is read on the host until the step record is
resolved, so there is no synchronization.
"""

from __future__ import annotations

import torch

from gpuprof.run.schema import EventKind


class ScalerCollector:
    name = "grad_scaler"

    def __init__(self, scaler):
        self._scaler = scaler
        self._found_inf: torch.Tensor | None = None
        self._skipped_optimizers: torch.Tensor | None = None  # with several optimizers: how many were skipped
        self._optimizers: int | None = None  # and of how many
        self._original_update = None

    def on_start(self, prof) -> None:
        if not self._scaler.is_enabled():
            return
        self._original_update = self._scaler.update
        capture = prof.collectors.guard(self, "scaler_update", self._capture_found_inf)
        original = self._original_update

        def update(new_scale=None):
            capture()
            return original(new_scale)

        self._scaler.update = update

    def on_close(self, prof) -> None:
        if self._original_update is not None:
            # back to what was there: another wrapper on this instance (gpuprof run's), else the class method
            if getattr(self._original_update, "__self__", None) is self._scaler:
                self._scaler.__dict__.pop("update", None)
            else:
                self._scaler.update = self._original_update
            self._original_update = None

    def on_step_start(self, prof, step: int) -> None:
        self._found_inf = self._skipped_optimizers = self._optimizers = None

    def _capture_found_inf(self) -> None:
        per_optimizer = [[found_inf.float() for found_inf in state["found_inf_per_device"].values()]
                         for state in self._scaler._per_optimizer_states.values()]
        per_optimizer = [found for found in per_optimizer if found]
        if not per_optimizer:
            return
        device = per_optimizer[0][0].device
        if len(per_optimizer) == 1:
            self._found_inf = _any_found(per_optimizer[0], device)
            return
        # several optimizers: the scaler skips each one's step apart, and the others step
        skipped = torch.stack([_any_found(found, device) for found in per_optimizer])
        self._skipped_optimizers, self._optimizers = skipped.sum(), len(per_optimizer)
        self._found_inf = self._skipped_optimizers > 0

    def on_step_end(self, prof, state) -> dict:
        scaler = self._scaler
        if not scaler.is_enabled() or scaler._scale is None:
            return {}
        return {
            "scaler_scale": scaler._scale,
            "scaler_growth_tracker": scaler._growth_tracker,
            "step_skipped": self._found_inf,
            "_skipped_optimizers": self._skipped_optimizers,
            "_optimizers": self._optimizers,
        }

    def on_step_record(self, prof, record: dict) -> None:
        if not record.get("step_skipped"):
            return
        skipped, optimizers = record.get("_skipped_optimizers"), record.get("_optimizers")
        counts = {} if skipped is None else {"skipped_optimizers": int(skipped), "optimizers": optimizers}
        prof.event(EventKind.STEP_SKIPPED, f"GradScaler skipped {_skipped_text(**counts)} at step {record['step']} "
                   f"(inf/NaN gradients); scale now {record.get('scaler_scale')}",
                   step=record["step"], scale=record.get("scaler_scale"), **counts)


def _any_found(found: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Whether any of one optimizer's per-device found-inf flags is set, on `device` (no sync)."""
    return torch.stack([flag.to(device).reshape(()) for flag in found]).sum() > 0


def _skipped_text(skipped_optimizers: int | None = None, optimizers: int | None = None) -> str:
    if skipped_optimizers is None:
        return "optimizer.step()"
    if skipped_optimizers == optimizers:
        return f"the step of all {optimizers} optimizers"
    return f"the step of {skipped_optimizers} of {optimizers} optimizers (the rest stepped)"
