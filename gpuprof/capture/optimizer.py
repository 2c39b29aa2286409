"""Learning rate and optimizer-step bookkeeping per step.

Counts `optimizer.step()` calls with a step pre-hook (no sync): a step with none was
skipped. The learning rate recorded is the one `optimizer.step()` used (read in that hook),
not the one a scheduler set for the next step: its first param group's, and with several optimizers
(gpuprof.optimizers) the first one's. Notes an LR scheduler that advanced on a skipped step (an event), since the
schedule then runs ahead of the weights.
"""

from __future__ import annotations

import torch

from gpuprof.run.schema import EventKind


def _lr(optimizer) -> float | torch.Tensor | None:
    groups = optimizer.param_groups
    lr = groups[0].get("lr") if groups else None
    return lr.detach() if isinstance(lr, torch.Tensor) else lr


class OptimizerCollector:
    name = "optimizer"

    def __init__(self, optimizer, lr_scheduler=None, scaler=None):
        self._optimizer = optimizer
        self._scheduler = lr_scheduler
        self._scaler_decides = scaler is not None and scaler.is_enabled()
        self._calls = 0
        self._lr_used = None
        self._scheduler_epoch = None
        self._handle = None

    def on_start(self, prof) -> None:
        self._handle = prof.collectors.hook(self, self._optimizer, "step_pre", self._count)

    def on_close(self, prof) -> None:
        if self._handle is not None:
            self._handle.remove()

    def _count(self, optimizer, args, kwargs) -> None:
        self._calls += 1
        if self._calls == 1:
            self._lr_used = _lr(self._optimizer)

    def on_step_start(self, prof, step: int) -> None:
        self._calls, self._lr_used = 0, None
        self._scheduler_epoch = getattr(self._scheduler, "last_epoch", None)

    def on_step_end(self, prof, state) -> dict:
        fields = {"lr": self._lr_used if self._calls else _lr(self._optimizer)}
        if not self._scaler_decides:
            fields["step_skipped"] = self._calls == 0
        if self._scheduler is not None:
            fields["_lr_scheduler_stepped"] = getattr(self._scheduler, "last_epoch", None) != self._scheduler_epoch
        return fields

    def on_step_record(self, prof, record: dict) -> None:
        if record.get("step_skipped") and record.get("_lr_scheduler_stepped"):
            prof.event(
                EventKind.LR_STEP_ON_SKIPPED,
                f"LR scheduler stepped on step {record['step']}, where optimizer.step() was skipped",
                severity="warning", step=record["step"], lr=record.get("lr"),
            )
