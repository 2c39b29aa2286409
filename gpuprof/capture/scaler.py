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
        self._found_inf = None

    def _capture_found_inf(self) -> None:
        found = [
            found_inf.float()
            for state in self._scaler._per_optimizer_states.values()
            for found_inf in state["found_inf_per_device"].values()
        ]
        if found:
            device = found[0].device
            self._found_inf = torch.stack([f.to(device).reshape(()) for f in found]).sum() > 0

    def on_step_end(self, prof, state) -> dict:
        scaler = self._scaler
        if not scaler.is_enabled() or scaler._scale is None:
            return {}
        return {
            "scaler_scale": scaler._scale,
            "scaler_growth_tracker": scaler._growth_tracker,
            "step_skipped": self._found_inf,
        }

    def on_step_record(self, prof, record: dict) -> None:
        if record.get("step_skipped"):
            prof.event(EventKind.STEP_SKIPPED, f"GradScaler skipped optimizer.step() at step {record['step']} "
                       f"(inf/NaN gradients); scale now {record.get('scaler_scale')}",
                       step=record["step"], scale=record.get("scaler_scale"))
