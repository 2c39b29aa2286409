"""A Hugging Face `transformers` Trainer callback recording what `gpuprof.profile` records.

    from gpuprof.integrations.transformers import GpuprofCallback
    trainer = Trainer(..., callbacks=[GpuprofCallback("runs/hf-exp1")])

One optimizer step of the Trainer is one gpuprof step. Phases: `forward` (model forward
hooks, training passes only), `backward` (to the end of the autograd pass), `optimizer`
(`on_pre_optimizer_step` to `on_optimizer_step`); clipping, logging, evaluation and the
data loading the Trainer does ahead of each step count as `other`. The loss recorded is
the step's loss as the Trainer logs it and tokens are the `input_ids` elements processed,
both kept on the device. The GradScaler (fp16) and LR scheduler are picked up from the
Trainer's optimizer and scheduler.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import TrainerCallback

from gpuprof.capture.profiler import Profiler


def _unwrap(obj: Any, attribute: str) -> Any:
    """Accelerate wraps the optimizer and the scheduler; gpuprof hooks the torch objects inside."""
    return getattr(obj, attribute, obj) if obj is not None else None


class _BatchWatcher:
    """A collector plus model hooks: forward/backward phases, loss and token counts per step."""

    name = "transformers_batches"

    def __init__(self, prof: Profiler, model: torch.nn.Module):
        self._prof = prof
        self._model = model
        self._handles: list = []
        self.loss_sum: torch.Tensor | None = None
        self.losses = 0
        self.tokens = 0
        self.losses_are_partial = False

    def on_start(self, prof) -> None:
        guard, eager = prof.collectors.guard, torch._dynamo.disable
        self._handles = [
            self._model.register_forward_pre_hook(eager(guard(self, "forward_pre_hook", self._before_forward)),
                                                  with_kwargs=True),
            self._model.register_forward_hook(eager(guard(self, "forward_hook", self._after_forward))),
        ]

    def on_close(self, prof) -> None:
        for handle in self._handles:
            handle.remove()

    def on_step_start(self, prof, step: int) -> None:
        self.loss_sum, self.losses, self.tokens = None, 0, 0

    def step_loss(self) -> torch.Tensor | None:
        """The step's loss as the Trainer logs it: given num_items_in_batch, each micro-batch loss is
        already divided by the step's token count, so they add up; otherwise they are averaged."""
        if not self.losses:
            return None
        return self.loss_sum if self.losses_are_partial else self.loss_sum / self.losses

    def on_after_backward(self, prof, step: int) -> None:
        prof.end_phase("backward")

    def _training(self) -> bool:
        return self._model.training and torch.is_grad_enabled()

    def _before_forward(self, module, args, kwargs) -> None:
        if self._training():
            inputs = kwargs.get("input_ids", args[0] if args else None)
            if isinstance(inputs, torch.Tensor):
                self.tokens += inputs.numel()
            self.losses_are_partial = "num_items_in_batch" in kwargs
            self._prof.begin_phase("forward")

    def _after_forward(self, module, args, output) -> None:
        if not self._training():
            return
        self._prof.end_phase("forward")
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor):
            loss = loss.detach().float()
            self.loss_sum = loss if self.loss_sum is None else self.loss_sum + loss
            self.losses += 1
        self._prof.begin_phase("backward")


class GpuprofCallback(TrainerCallback):
    """Records a Trainer run into `run_dir` (default: `<output_dir>/gpuprof`); options as for gpuprof.profile."""

    def __init__(self, run_dir: str | os.PathLike | None = None, **options: Any):
        self.run_dir = run_dir
        self.options = options
        self.prof: Profiler | None = None
        self._batches: _BatchWatcher | None = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        optimizer_inner = _unwrap(optimizer, "optimizer")
        options = {"config": args.to_dict(), "lr_scheduler": _unwrap(lr_scheduler, "scheduler"), **self.options}
        self.prof = Profiler(
            self.run_dir or os.path.join(args.output_dir, "gpuprof"),
            model=model, optimizer=optimizer_inner, scaler=getattr(optimizer, "scaler", None), **options,
        )
        self._batches = _BatchWatcher(self.prof, model)
        self.prof.add_collector(self._batches)
        self.prof.start()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.prof is not None:
            self.prof.begin_phase("optimizer")

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.prof is not None:
            self.prof.end_phase("optimizer")

    def on_step_end(self, args, state, control, **kwargs):
        if self.prof is not None:
            self.prof.step(loss=self._batches.step_loss(), tokens=self._batches.tokens or None)

    def on_train_end(self, args, state, control, **kwargs):
        if self.prof is not None:
            self.prof.close()
            self.prof = None
