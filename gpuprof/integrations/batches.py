"""What the integrations read from batches and model calls they did not write: tokens and the loss."""

from __future__ import annotations

from typing import Any

import torch

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


def output_loss(output: Any) -> torch.Tensor | None:
    """The loss a model call returned: its output's `loss`, or a tuple's one-element float tensor."""
    if isinstance(output, (tuple, list)):
        found = [item for item in output if isinstance(item, torch.Tensor) and item.numel() == 1
                 and item.is_floating_point()]
        loss = found[0] if len(found) == 1 else None
    else:
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


class ForwardInputs:
    """A collector reading each training forward of `model`: tokens in, and the loss out when the model returns one.

    Tokens are the elements of `input_ids` (or of the first positional tensor) of every training
    call in the step. The loss is an output's `loss` (Hugging Face models), or the one-element float
    tensor of a tuple output (nanoGPT's `logits, loss`), kept on the device:
    given `num_items_in_batch`, each micro-batch loss is already divided by the step's token count,
    so they add up; otherwise they are averaged.
    """

    name = "forward_inputs"

    def __init__(self, model: torch.nn.Module):
        self._model = model
        self._handles: list = []
        self.tokens = 0
        self._loss_sum: torch.Tensor | None = None
        self._losses = 0
        self._losses_are_partial = False

    def on_start(self, prof) -> None:
        guard = prof.collectors.guard  # its hooks run eagerly under torch.compile
        self._handles = [
            self._model.register_forward_pre_hook(guard(self, "forward_pre_hook", self._before_forward),
                                                  with_kwargs=True),
            self._model.register_forward_hook(guard(self, "forward_hook", self._after_forward)),
        ]

    def on_close(self, prof) -> None:
        for handle in self._handles:
            handle.remove()

    def on_step_start(self, prof, step: int) -> None:
        self.tokens, self._loss_sum, self._losses = 0, None, 0

    def step_loss(self) -> torch.Tensor | None:
        if not self._losses:
            return None
        return self._loss_sum if self._losses_are_partial else self._loss_sum / self._losses

    def _before_forward(self, module, args, kwargs) -> None:
        if is_training_call(module):
            self.tokens += batch_tokens(kwargs["input_ids"] if "input_ids" in kwargs else args)
            self._losses_are_partial = "num_items_in_batch" in kwargs

    def _after_forward(self, module, args, output) -> None:
        if not is_training_call(module):
            return
        loss = output_loss(output)
        if loss is not None:
            loss = loss.detach().float().reshape(())
            self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
            self._losses += 1
