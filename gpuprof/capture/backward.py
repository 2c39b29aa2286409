"""Notices the end of every backward pass through the model's parameters.

A post-accumulate-grad hook on a parameter queues one autograd-engine callback per
backward pass; the callback runs when the pass is complete, i.e. when every gradient of
this micro-batch has been accumulated, before the user clips or steps. Any parameter the
pass reaches will do, so after the first pass only the last two that fired keep a hook: those
nearest the input (the embeddings), which any pass through the model reaches (a Python call
per parameter per pass costs ~1 us each). `attach()` hooks them all again when a pass went
unseen; that pass has no gradient norms. Under
torch.distributed the callback re-queues itself once so that it runs after DDP's own
end-of-backward callback, which finishes the gradient all-reduce.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from gpuprof.modules import initialized
from gpuprof.torch_compat import private

logger = logging.getLogger("gpuprof")


KEPT_HOOKS = 2


class BackwardWatcher:
    def __init__(self, model: torch.nn.Module, on_backward_end: Callable[[], None]):
        self._model = model
        self._on_backward_end = on_backward_end
        self._handles: dict[torch.Tensor, object] = {}
        self._fired: list[torch.Tensor] | None = None  # while narrowing: the parameters seen this pass
        self._queued = False
        # a model wrapped in DDP elsewhere (e.g. by the HF Trainer) still needs to wait for the all-reduce
        self._is_ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel) or initialized()

    def attach(self) -> None:
        """A hook on every trainable parameter, narrowed again after the next pass (a lazy module's once its first
        forward made it: the step's end attaches again when a pass went unseen)."""
        if private("torch.autograd.Variable._execution_engine") is None:
            return  # no end of a backward pass to see (said once)
        for param in self._model.parameters():
            if param.requires_grad and param not in self._handles and not torch.nn.parameter.is_lazy(param):
                self._handles[param] = param.register_post_accumulate_grad_hook(self._on_grad)
        self._fired = []

    def detach(self) -> None:
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()

    def _on_grad(self, param: torch.Tensor) -> None:
        if self._fired is not None:
            self._fired.append(param)
        if self._queued:
            return
        try:
            engine = private("torch.autograd.Variable._execution_engine")
            engine.queue_callback(self._after_ddp if self._is_ddp else self._finish)
            self._queued = True
        except Exception as error:  # noqa: BLE001 - never fail the user's backward pass
            logger.warning("gpuprof: cannot watch backward passes (%r); gradient capture is off", error)
            self.detach()

    def _after_ddp(self) -> None:
        private("torch.autograd.Variable._execution_engine").queue_callback(self._finish)

    def _finish(self) -> None:
        self._queued = False
        if self._fired:
            self._narrow(self._fired[-KEPT_HOOKS:])
        self._on_backward_end()

    def _narrow(self, kept: list[torch.Tensor]) -> None:
        for param in [param for param in self._handles if not any(param is k for k in kept)]:
            self._handles.pop(param).remove()
        self._fired = None
