"""Notices the end of every backward pass through the model's parameters.

A post-accumulate-grad hook on each parameter queues one autograd-engine callback per
backward pass; the callback runs when the pass is complete, i.e. when every gradient of
this micro-batch has been accumulated, before the user clips or steps. Under
torch.distributed the callback re-queues itself once so that it runs after DDP's own
end-of-backward callback, which finishes the gradient all-reduce.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

logger = logging.getLogger("gpuprof")


class BackwardWatcher:
    def __init__(self, model: torch.nn.Module, on_backward_end: Callable[[], None]):
        self._model = model
        self._on_backward_end = on_backward_end
        self._handles: list = []
        self._queued = False
        # a model wrapped in DDP elsewhere (e.g. by the HF Trainer) still needs to wait for the all-reduce
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        self._is_ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel) or distributed

    def attach(self) -> None:
        for param in self._model.parameters():
            if param.requires_grad:
                self._handles.append(param.register_post_accumulate_grad_hook(self._on_grad))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _on_grad(self, _param: torch.Tensor) -> None:
        if self._queued:
            return
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._after_ddp if self._is_ddp else self._finish)
            self._queued = True
        except Exception as error:  # noqa: BLE001 - never fail the user's backward pass
            logger.warning("gpuprof: cannot watch backward passes (%r); gradient capture is off", error)
            self.detach()

    def _after_ddp(self) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _finish(self) -> None:
        self._queued = False
        self._on_backward_end()
