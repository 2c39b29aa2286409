"""A Hugging Face `transformers` Trainer callback recording what `gpuprof.profile` records.

    from gpuprof.integrations.transformers import GpuprofCallback
    trainer = Trainer(..., callbacks=[GpuprofCallback("runs/hf-exp1")])

One optimizer step of the Trainer is one gpuprof step. Phases: `data` from the Trainer's
hooks (from the end of the previous step, or of the logging, saving or evaluation that
followed it, to `on_step_begin`: the Trainer fetches all of a step's micro-batches there);
`forward` and `backward` are the Profiler's automatic phases (gpuprof.capture.phases);
`optimizer` runs from `on_pre_optimizer_step` to `on_optimizer_step` (the GradScaler's
step included, clipping not). The loss recorded is what the Trainer calls backward() on, summed
over the step's micro-batches (gpuprof.capture.losses), and tokens are the `input_ids` elements
processed, both kept on the device. The GradScaler
(fp16), the LR scheduler and the train DataLoader are the Trainer's own.
"""

from __future__ import annotations

import os
from typing import Any

from transformers import TrainerCallback

from gpuprof.capture.profiler import Profiler
from gpuprof.integrations.batches import ForwardInputs


def _unwrap(obj: Any, attribute: str) -> Any:
    """Accelerate wraps the scheduler; gpuprof reads the torch object inside."""
    return getattr(obj, attribute, obj) if obj is not None else None


class GpuprofCallback(TrainerCallback):
    """Records a Trainer run into `run_dir` (default: `<output_dir>/gpuprof`); options as for gpuprof.profile."""

    def __init__(self, run_dir: str | os.PathLike | None = None, **options: Any):
        self.run_dir = run_dir
        self.options = options
        self.prof: Profiler | None = None
        self._inputs: ForwardInputs | None = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None,
                       train_dataloader=None, **kwargs):
        options = {"lr_scheduler": _unwrap(lr_scheduler, "scheduler"), "scaler": getattr(optimizer, "scaler", None),
                   "loader": train_dataloader, **self.options,
                   "config": {**args.to_dict(), **self.options.get("config", {})}}
        self.prof = Profiler(self.run_dir or os.path.join(args.output_dir, "gpuprof"),
                             model=model, optimizer=optimizer, **options)
        self._inputs = ForwardInputs(model)
        self.prof.add_collector(self._inputs)
        self.prof.start()
        self.prof.begin_phase("data")

    def on_step_begin(self, args, state, control, **kwargs):
        if self.prof is not None:
            self.prof.end_phase("data")

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.prof is not None:
            self.prof.begin_phase("optimizer")

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.prof is not None:
            self.prof.end_phase("optimizer")

    def on_step_end(self, args, state, control, **kwargs):
        if self.prof is not None:
            self.prof.step(tokens=self._inputs.tokens or None)
            self.prof.begin_phase("data")

    def _restart_data(self) -> None:
        """Logging, saving and evaluation (which logs its metrics) run between steps; the wait for data starts after."""
        if self.prof is not None:
            self.prof.begin_phase("data")  # begin on an open phase restarts it

    def on_log(self, args, state, control, **kwargs):
        self._restart_data()

    def on_save(self, args, state, control, **kwargs):
        self._restart_data()

    def on_train_end(self, args, state, control, **kwargs):
        self.close("finished")

    def close(self, status: str) -> None:
        """Ends the recording; `gpuprof run` calls it with "failed" when the script raised mid-training."""
        if self.prof is not None:
            self.prof.close(status=status)
            self.prof = None
