"""What the integrations read from batches and model calls they did not write: tokens.

The loss is not read here: it is what backward() is called on (gpuprof.capture.losses)."""

from __future__ import annotations

from typing import Any

import torch

from gpuprof import module_hooks
from gpuprof.capture.phases import is_training_call


def batch_tokens(batch: Any) -> int:
    """Token count of a batch: its `input_ids` when it is a mapping, else its first tensor's elements."""
    if isinstance(batch, torch.Tensor):
        return batch.numel()
    if hasattr(batch, "keys"):
        return batch_tokens(batch["input_ids"] if "input_ids" in batch else next(iter(batch.values()), None))
    if isinstance(batch, (list, tuple)) and batch:
        return batch_tokens(batch[0])
    return 0


def call_tokens(args: tuple, kwargs: dict) -> int:
    """Token count of a model call: its `input_ids` keyword, else its first positional tensor's elements."""
    return batch_tokens(kwargs["input_ids"] if "input_ids" in kwargs else args)


class ForwardInputs:
    """A collector counting the tokens of each training forward of `model`: the elements of
    `input_ids` (or of the first positional tensor) of every training call in the step."""

    name = "forward_inputs"

    def __init__(self, model: torch.nn.Module):
        self._model = model
        self._handles: list = []
        self.tokens = 0

    def on_start(self, prof) -> None:
        guard = prof.collectors.guard  # its hooks run eagerly under torch.compile
        self._handles = [
            module_hooks.register(self._model, "forward_pre", guard(self, "forward_pre_hook", self._before_forward),
                                  with_kwargs=True),
        ]

    def on_close(self, prof) -> None:
        for handle in self._handles:
            handle.remove()

    def on_step_start(self, prof, step: int) -> None:
        self.tokens = 0

    def _before_forward(self, module, args, kwargs) -> None:
        if is_training_call(module):
            self.tokens += call_tokens(args, kwargs)
