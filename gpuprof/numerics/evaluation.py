"""The model's outputs in evaluations between training steps: a blow-up named when no training step follows.

An update can leave weights that only the next forward turns non-finite. When the loop evaluates (a forward with
gradients off: a validation loss, a sampling loop calling the model) right after that update and then dies, no
training step's flags ever see it. So each evaluation forward of the model adds one value to watch: its output's
loss (its scalar outputs; all of its outputs when it has none), with the inputs it ran on kept by reference.
A training forward pays nothing: the hook on the output is added at an evaluation's pre-hook and removes itself.
On the CPU the value is read at once (no sync); on an accelerator it is read once an evaluation is over, at the
next training forward or at close (one wait per evaluation, never one per step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from gpuprof import module_hooks
from gpuprof.numerics.state import rng_states
from gpuprof.numerics.tape import FORWARD_ARGS, FORWARD_KWARGS, autocast_now
from gpuprof.torch_compat import tree_flatten

UNREAD_LIMIT = 32  # evaluation forwards kept unread on an accelerator (a sampling loop calls the model per token)


@dataclass
class Evaluation:
    after_step: int  # the last training step whose update the evaluation ran on
    value: torch.Tensor | float  # non-finite when the output was
    batch: dict[str, Any]  # {FORWARD_ARGS: [...], FORWARD_KWARGS: {...}}, by reference
    rng: dict[str, Any]
    autocast: dict[str, str] | None

    def finite(self) -> bool:
        return math.isfinite(float(self.value))


class EvaluationOutputs:
    def __init__(self, model: torch.nn.Module, guard):
        self._model, self._guard = model, guard
        self._unread: list[Evaluation] = []
        self._bad: Evaluation | None = None
        self._handle = None

    def before_forward(self, after_step: int, args, kwargs) -> None:
        """An evaluation forward of the model begins (its pre-hook): its output is watched."""
        if after_step < 0 or self._bad is not None or self._handle is not None:
            return  # before any update, nothing of training to blame; after a bad one, the first stands
        evaluation = Evaluation(after_step, 0.0, {FORWARD_ARGS: list(args), FORWARD_KWARGS: dict(kwargs)},
                                rng_states(), autocast_now())
        output_hook = self._guard(lambda module, args, kwargs, output: self._on_output(evaluation, output))
        self._handle = module_hooks.register(self._model, "forward", output_hook, with_kwargs=True, always_call=True)

    def first_nonfinite(self) -> Evaluation | None:
        """The first evaluation whose output was not finite, once (read now: a wait on an accelerator)."""
        self._read()
        bad, self._bad = self._bad, None
        return bad

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _on_output(self, evaluation: Evaluation, output: Any) -> None:
        self.close()
        value = output_value(output)
        if value is None or torch.is_grad_enabled():
            return
        evaluation.value = value.item() if value.device.type == "cpu" else value
        self._unread.append(evaluation)
        if value.device.type == "cpu" or len(self._unread) >= UNREAD_LIMIT:
            self._read()

    def _read(self) -> None:
        for evaluation in self._unread:
            if self._bad is None and not evaluation.finite():
                self._bad = evaluation
        self._unread.clear()


def output_value(output: Any) -> torch.Tensor | None:
    """One float32 value of a model's output, non-finite when the output is: the sum of its one-element tensors
    (a loss), or of all its floating tensors when it has none (logits). None for an output without any."""
    terms = _loss_terms(output)
    if len(terms) == 1:  # most outputs: one loss, or one logits tensor
        return terms[0].detach().float().sum()
    return torch.stack([term.detach().float().sum() for term in terms]).sum() if terms else None


def evaluation_loss(model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """The forensic re-run's (and the replay's) loss for an evaluation: the value output_value reads, kept
    differentiable."""
    terms = _loss_terms(model(*batch[FORWARD_ARGS], **batch[FORWARD_KWARGS]))
    if not terms:
        raise ValueError("the model's evaluation output holds no floating tensor to re-run")
    return torch.stack([term.float().sum() for term in terms]).sum()


def _loss_terms(output: Any) -> list[torch.Tensor]:
    """The output's one-element floating tensors, or all its floating tensors when it has none; a Hugging Face
    ModelOutput by its loss when it has one (its logits and hidden states are no loss)."""
    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() else []
    loss = getattr(output, "loss", None)
    tensors = [t for t in tree_flatten(loss if isinstance(loss, torch.Tensor) else output)[0]
               if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return [t for t in tensors if t.numel() == 1] or tensors
