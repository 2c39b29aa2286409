"""on_nonfinite="skip": an update made from non-finite gradients is undone, from the kept state.

Just before `optimizer.step()` one device value says whether any gradient is non-finite; just
after, every parameter and optimizer state tensor is put back where it was (`torch.where` on
that value: no host sync), and state the step created (Adam's first step) goes back to zeros.
"""

from __future__ import annotations

import torch

from gpuprof.modules import eager_model, local_tensor
from gpuprof.numerics.keeping import StepKeeping, absmax_of
from gpuprof.numerics.state import live_tensors


class SkipBadUpdates:
    def __init__(self, keeping: StepKeeping, device: torch.device):
        self._keeping, self._device = keeping, device
        self._bad: torch.Tensor | None = None

    def hooks(self, optimizer, guard, owner) -> list:
        return [optimizer.register_step_pre_hook(guard(owner, "optimizer_pre_hook", self._check_grads)),
                optimizer.register_step_post_hook(guard(owner, "optimizer_post_hook", self._undo_bad_update))]

    def _check_grads(self, optimizer, args, kwargs) -> None:
        grads = optimizer_grads(optimizer)
        self._bad = ~torch.isfinite(absmax_of(grads, self._device)) if grads else None

    def _undo_bad_update(self, optimizer, args, kwargs) -> None:
        keeper = self._keeping.keeper
        if self._bad is None or keeper is None or self._keeping.current is None:
            return
        kept = keeper.current_views()
        live = {n: t for n, t in live_tensors(eager_model(self._keeping.model), optimizer).items()
                if t.device == keeper.device}
        with torch.no_grad():
            before = [kept[n] if n in kept else torch.zeros_like(t) for n, t in live.items()]
            restored = [torch.where(self._bad, old, t) for old, t in zip(before, live.values())]
            torch._foreach_copy_(list(live.values()), restored)
        self._bad = None


def optimizer_grads(optimizer) -> list[torch.Tensor]:
    return [local_tensor(p.grad) for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
