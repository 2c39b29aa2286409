"""A Lightning callback recording what `gpuprof.profile` records.

    from gpuprof.integrations.lightning import GpuprofCallback
    trainer = lightning.Trainer(..., callbacks=[GpuprofCallback("runs/pl-exp1")])

One optimizer step is one gpuprof step, so under `accumulate_grad_batches=N` a row covers N
batches. Phases, from Lightning's own hooks: `data` (from the end of one batch to the start of
the next, which is where Lightning fetches it and moves it to the device; validation runs are
left out), `eval` (`on_validation_start` to `on_validation_end`: a validation run inside the fit,
in the step that follows it), `forward` (`on_train_batch_start` to `on_before_backward`: the training step),
`backward` (to `on_after_backward`), `optimizer` (`on_before_optimizer_step` to the end of the
torch optimizer's step, so Lightning's gradient clipping counts here). Gradient norms are taken
at the end of each backward pass, before Lightning unscales or clips. The loss is what Lightning
calls backward() on (gpuprof.capture.losses), summed over the step's batches: the mean of their
training-step losses, which Lightning divides by accumulate_grad_batches (under manual
optimization, what `manual_backward` is given); tokens are the elements of each batch's
`input_ids` (or of its first tensor). The optimizer, the GradScaler of `precision="16-mixed"`, the first LR scheduler
and the train DataLoader are Lightning's own (all of its optimizers). NaN forensics re-runs a bad step's batches through
`training_step` on a copy of the module (Lightning calls it, not the module's forward), so blames
name modules as the LightningModule holds them (`model.transformer.h.1.mlp`). Under manual
optimization (`automatic_optimization = False`, the only way Lightning steps several optimizers,
e.g. Muon beside AdamW) every optimizer is recorded, and the re-run takes the loss the training
step hands to its first `manual_backward`. Under the DDP strategy (torchrun, `devices=N`), the DDP
module the strategy wraps gets gpuprof's DDP collector, as a DDP model given to `gpuprof.profile` does:
its timing, and each step's arrivals at its collectives, which name a straggler.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import lightning.pytorch as pl
import torch

from gpuprof.capture.ddp import DdpCollector
from gpuprof.capture.profiler import Profiler
from gpuprof.integrations.batches import batch_tokens


def compute_precision(lightning_precision: str) -> str | None:
    """gpuprof's name for the dtype a Lightning precision setting computes in ("16-mixed" -> "fp16")."""
    prefix = str(lightning_precision).split("-")[0]
    return {"bf16": "bf16", "16": "fp16", "32": "fp32", "transformer": None}.get(prefix)


class _StepSums:
    """A collector holding the step's token sum and batches, and ending the optimizer phase."""

    name = "lightning_steps"

    def __init__(self, optimizer: torch.optim.Optimizer | None):
        self._optimizer = optimizer
        self._handle = None
        self.tokens = 0
        self.batches: list[Any] = []  # by reference, for NaN forensics
        self.optimizer_stepped = False

    def on_start(self, prof) -> None:
        if self._optimizer is not None:
            end = prof.collectors.guard(self, "optimizer_post_hook", lambda *_: prof.end_phase("optimizer"))
            self._handle = self._optimizer.register_step_post_hook(end)

    def on_close(self, prof) -> None:
        if self._handle is not None:
            self._handle.remove()

    def on_step_start(self, prof, step: int) -> None:
        self.tokens, self.batches, self.optimizer_stepped = 0, [], False

    def add_batch(self, batch: Any) -> None:
        self.tokens += batch_tokens(batch)
        self.batches.append(batch)


class GpuprofCallback(pl.Callback):
    """Records a Lightning fit into `run_dir` (default `<default_root_dir>/gpuprof`); options as for gpuprof.profile."""

    def __init__(self, run_dir: str | os.PathLike | None = None, **options: Any):
        self.run_dir = run_dir
        self.options = options
        self.prof: Profiler | None = None
        self._sums: _StepSums | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        schedulers = trainer.lr_scheduler_configs
        options = {
            "scaler": getattr(trainer.precision_plugin, "scaler", None),
            "lr_scheduler": schedulers[0].scheduler if schedulers else None,
            "loader": trainer.train_dataloader,
            "loss_fn": functools.partial(training_step_loss, trainer.precision_plugin, len(trainer.optimizers)),
            **self.options,
            "config": {**_config(trainer, pl_module), **self.options.get("config", {})},
        }
        self.prof = Profiler(self.run_dir or os.path.join(trainer.default_root_dir, "gpuprof"),
                             model=pl_module, optimizer=list(trainer.optimizers), **options)
        self._sums = _StepSums(self.prof.optimizer)
        self.prof.add_collector(self._sums)
        wrapped = getattr(trainer.strategy, "model", None)
        if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):  # the DDP strategy's: arrivals, DDP timing
            self.prof.add_collector(DdpCollector(wrapped))
        self.prof.start()
        self.prof.begin_phase("data")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.prof is not None:
            self.prof.end_phase("data")
            self._call("add_batch", batch)
            self.prof.begin_phase("forward")

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self.prof is not None:
            self.prof.end_phase("forward")
            self.prof.begin_phase("backward")

    def on_after_backward(self, trainer, pl_module) -> None:
        if self.prof is not None:
            self.prof.end_phase("backward")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.prof is not None:
            self._sums.optimizer_stepped = True
            self.prof.begin_phase("optimizer")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.prof is None:
            return
        if self._sums.optimizer_stepped:
            self.prof.end_phase("optimizer")  # the GradScaler may have skipped the torch step and its hook
            self.prof.step(tokens=self._sums.tokens or None, batch=self._sums.batches)
        self.prof.begin_phase("data")

    def on_validation_start(self, trainer, pl_module) -> None:
        if self.prof is not None and not trainer.sanity_checking:
            self.prof.begin_phase("eval")

    def on_validation_end(self, trainer, pl_module) -> None:
        if self.prof is not None:
            self.prof.end_phase("eval")
            self.prof.begin_phase("data")  # begin on an open phase restarts it: validation is not data

    def on_train_end(self, trainer, pl_module) -> None:
        self.close("finished")

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if self.prof is not None:
            self.prof.handle_exception(exception)
        self.close("failed")

    def _call(self, method: str, *args) -> None:
        self.prof.collectors.call_one(self._sums, method, *args)

    def close(self, status: str) -> None:
        """Ends the recording; `gpuprof run` calls it with "failed" when the script raised mid-training."""
        if self.prof is not None:
            self.prof.close(status=status)
            self.prof = None


def training_step_loss(precision, n_optimizers: int, module: pl.LightningModule, batch: Any) -> torch.Tensor:
    """The loss of one batch as Lightning computes it: `training_step` under the precision plugin's
    autocast, its tensor or its dict's "loss". Under manual optimization the step runs its own
    backward and updates: on gpuprof's private copy of the module (which no Trainer holds), the loss is
    the one the step hands to its first `manual_backward`, where it is stopped, and `optimizers()`
    returns stand-ins; the forensic re-run then runs the backward and the updates itself."""
    with precision.forward_context():
        if module.automatic_optimization:
            output = module.training_step(batch, 0)
        else:
            return _loss_at_manual_backward(module, batch, n_optimizers)
    return output["loss"] if isinstance(output, dict) else output


class _LossReached(Exception):
    def __init__(self, loss: torch.Tensor):
        super().__init__("the training step reached manual_backward")
        self.loss = loss


class _OptimizerStandIn:
    """What `optimizers()` returns on the copy: a step runs its closure (which reaches manual_backward)."""

    def step(self, closure=None, **kwargs) -> None:
        if closure is not None:
            closure()

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def _loss_at_manual_backward(module: pl.LightningModule, batch: Any, n_optimizers: int) -> torch.Tensor:
    def reached(loss, *args, **kwargs):
        raise _LossReached(loss)

    stand_ins = [_OptimizerStandIn() for _ in range(n_optimizers)]
    module.manual_backward = reached
    module.optimizers = lambda use_pl_optimizer=True: stand_ins[0] if len(stand_ins) == 1 else stand_ins
    module.toggle_optimizer = module.untoggle_optimizer = lambda *args, **kwargs: None
    try:
        module.training_step(batch, 0)
    except _LossReached as reached_at:
        return reached_at.loss
    raise RuntimeError("the manual-optimization training_step never called manual_backward")


def _config(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
    """The module's hyperparameters and the Trainer settings that shape a step."""
    return {
        **dict(pl_module.hparams),
        "precision": compute_precision(trainer.precision),
        "lightning_precision": str(trainer.precision),
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "gradient_clip_val": trainer.gradient_clip_val,
        "max_steps": trainer.max_steps,
        "world_size": trainer.world_size,
    }
