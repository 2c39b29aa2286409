"""on_nonfinite="skip": an update made from non-finite gradients is undone, from the kept state.

Right after `optimizer.step()` one device value says whether any gradient it used is non-finite
(read then, not before the step: Lightning runs forward and backward inside `step(closure)`), and
every parameter and optimizer state tensor is put back where it was (`torch.where` on that value:
no host sync); state the step created (Adam's first step) goes back to zeros. With several
optimizers (gpuprof.optimizers) each one's step is undone on its own: its parameters and its state.
"""

from __future__ import annotations

import torch

from gpuprof.modules import eager_model, local_tensor
from gpuprof.numerics.keeping import StepKeeping, absmax_of
from gpuprof.numerics.state import live_tensors
from gpuprof.torch_compat import foreach_copy_
from gpuprof.optimizers import params_of


class SkipBadUpdates:
    def __init__(self, keeping: StepKeeping, device: torch.device):
        self._keeping, self._device = keeping, device

    def hooks(self, optimizer, guard, owner) -> list:
        return [optimizer.register_step_post_hook(guard(owner, "optimizer_post_hook", self._undo_bad_update))]

    def _undo_bad_update(self, optimizer, args, kwargs) -> None:
        keeper, grads = self._keeping.keeper, optimizer_grads(optimizer)
        if not grads or keeper is None or self._keeping.current is None:
            return
        bad = ~torch.isfinite(absmax_of(grads, self._device))
        kept = keeper.current_views()
        model = eager_model(self._keeping.model)
        owned = {id(p) for p in params_of(optimizer)}
        others = {name for name, p in model.named_parameters() if id(p) not in owned}  # another optimizer's
        live = {n: t for n, t in live_tensors(model, optimizer).items() if t.device == keeper.device and n not in others}
        with torch.no_grad():
            before = [kept[n] if n in kept else torch.zeros_like(t) for n, t in live.items()]
            restored = [torch.where(bad, old, t) for old, t in zip(before, live.values())]
            foreach_copy_(list(live.values()), restored)


def optimizer_grads(optimizer) -> list[torch.Tensor]:
    return [local_tensor(p.grad) for p in params_of(optimizer) if p.grad is not None]
