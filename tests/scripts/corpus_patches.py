"""Patches the corpus runs apply at run time (script_corpus.py): the offline stand-ins for what
the scripts would download, and the limits that keep them short."""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

from gpuprof.integrations.script import _PatchOnImport


def after_import(name: str, patch: Callable) -> None:
    """Calls patch(module) right after module `name` is imported (now, if it already is)."""
    _PatchOnImport({name: patch}).install()


_SCRIPT_BINDINGS: dict[str, list[Callable[[Any], Any]]] = {}  # name -> patches not yet applied, in order


def after_binding(name: str, patch: Callable[[Any], Any]) -> None:
    """Binds patch(value) in place of `value` right after the script's own top-level code binds `name` (a constant,
    a class, an imported function): what a script whose set-up is not in functions (B = 64, a class defined in
    `__main__`) is changed by from outside. A line tracer on the script's module frame alone, every other frame
    untraced, taken off once every name patched is bound: before the loop, for the names its set-up binds."""
    if not _SCRIPT_BINDINGS:
        sys.settrace(_trace_the_script)
    _SCRIPT_BINDINGS.setdefault(name, []).append(patch)


def _trace_the_script(frame, event, arg):
    """The script's module frame: the only `__main__` module code that starts after the patches."""
    if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__":
        return _rebind
    return None


def _rebind(frame, event, arg):
    """Before each line of the script's top level: the names the line before bound, patched."""
    scope = frame.f_globals  # a module frame's locals
    for name in [name for name in _SCRIPT_BINDINGS if name in scope]:
        for patch in _SCRIPT_BINDINGS.pop(name):
            scope[name] = patch(scope[name])
    if _SCRIPT_BINDINGS:
        return _rebind
    sys.settrace(None)
    frame.f_trace = None
    return None


def offline_hub(data_files: dict[str, str], tokenizer: str, model: str) -> None:
    """The Hub's dataset, tokenizer and weights the Accelerate example names, made locally: its
    `load_dataset` reads local text files, its tokenizer is a local one, its model a fresh one
    built from a local config (random init, nothing downloaded)."""
    import datasets
    import transformers

    load_dataset = datasets.load_dataset
    datasets.load_dataset = lambda *args, **kwargs: load_dataset("text", data_files=data_files)
    tokenizer_from = transformers.AutoTokenizer.from_pretrained
    transformers.AutoTokenizer.from_pretrained = lambda name, *args, **kwargs: tokenizer_from(tokenizer)
    config = transformers.AutoConfig.from_pretrained(model)
    transformers.AutoModelForCausalLM.from_pretrained = (
        lambda name, *args, **kwargs: transformers.AutoModelForCausalLM.from_config(config))


def offline_accuracy() -> None:
    """`evaluate.load("accuracy")` downloads the metric's script from the Hub: here a local metric computing the
    same, the share of predictions equal to their references."""
    import numpy as np

    class Accuracy:
        @staticmethod
        def compute(predictions, references):
            return {"accuracy": float(np.mean(np.asarray(predictions) == np.asarray(references)))}

    def local_load(evaluate):
        def load(path, *args, **kwargs):
            if path != "accuracy":
                raise ValueError(f"only the accuracy metric is available offline, not {path!r}")
            return Accuracy()

        evaluate.load = load

    after_import("evaluate", local_load)


def limit_lightning_trainer(max_steps: int, devices: int | None = None) -> None:
    """The Lightning example trains 20 epochs of WikiText2: stop after `max_steps` optimizer steps,
    validate and test on 2 batches, write no checkpoint, log or progress bar; with `devices`, its DDP strategy
    on that many processes (what a user launching it under torchrun sets)."""
    import lightning

    trainer_init = lightning.Trainer.__init__

    @functools.wraps(trainer_init)
    def __init__(trainer, *args, **kwargs):
        kwargs.update(max_steps=max_steps, limit_val_batches=2, limit_test_batches=2, num_sanity_val_steps=0,
                      enable_checkpointing=False, logger=False, enable_progress_bar=False, accelerator="cpu")
        if devices is not None:
            kwargs.update(devices=devices, strategy="ddp")
        trainer_init(trainer, *args, **kwargs)

    lightning.Trainer.__init__ = __init__


# ---------------------------------------------------------------------------------------------- faults
# Each breaks a training script from outside it, as its own bug would: through torch's global hooks
# or a wrapper around the forward of the script's model class, never by editing the script. `model`
# names that class as "module:Class" (nanoGPT's "model:GPT"; "__main__:GPT" for a class the script
# defines itself); `weight` a parameter of it by its name in the class's own module ("transformer.wte.weight").
def lr_spike(model: str, at_call: int, lr: float) -> None:
    """Every optimizer's lr set to `lr` before training call `at_call` of `model` (after the loop set that
    iteration's lr from its schedule, if it does): that iteration's update is made with it."""
    import torch

    optimizers = []
    init = torch.optim.Optimizer.__init__

    @functools.wraps(init)
    def remembering_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        optimizers.append(self)

    torch.optim.Optimizer.__init__ = remembering_init

    def spike(module, inputs):
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr

    _before_training_forward(model, at_call, spike)


def bad_embedding_row(model: str, weight: str, at_call: int) -> None:
    """A NaN written into the row of embedding `weight` of the first token `model` is called with, before its
    training call `at_call`: a bad row the batch uses."""
    def fault(module, inputs):
        module.get_parameter(weight)[inputs.flatten()[0]].fill_(float("nan"))

    _before_training_forward(model, at_call, fault)


def attention_overflow(model: str, weight: str, at_call: int, scale: float = 1e25) -> None:
    """The query/key/value projection `weight` scaled by `scale` before training call `at_call`: finite
    weights whose attention scores overflow."""
    _before_training_forward(model, at_call, lambda module, inputs: module.get_parameter(weight).mul_(scale))


def _before_training_forward(model: str, at_call: int, fault: Callable) -> None:
    """fault(model, its first tensor argument) runs before the `at_call`-th training call (grad enabled,
    from 0) of the class `model` names."""
    import torch

    module_name, class_name = model.split(":")

    def patch(cls):
        forward, calls = cls.forward, iter(range(1 << 62))

        @functools.wraps(forward)
        def faulty_forward(self, *args, **kwargs):
            if torch.is_grad_enabled() and next(calls) == at_call:
                inputs = next(value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor))
                with torch.no_grad():
                    fault(self, inputs)
            return forward(self, *args, **kwargs)

        cls.forward = faulty_forward
        return cls

    if module_name == "__main__":  # a class the script itself defines
        after_binding(class_name, patch)
    else:
        after_import(module_name, lambda module: patch(getattr(module, class_name)))


def first_nonfinite(model: str, path: str) -> None:
    """Writes to `path` (JSON), seen from outside gpuprof, where training `model` first made a non-finite value:
    `update`, [optimizer step from 0, parameter] after the first update that left a parameter non-finite;
    `forward`, [training call from 0, module] of the first module whose output was non-finite from finite inputs.
    A witness for the blame: plain hooks, checked after every update and every module's training forward."""
    import json
    from pathlib import Path

    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.utils._pytree import tree_flatten

    seen: dict[str, Any] = {"update": None, "forward": None}
    updates, calls = iter(range(1 << 62)), iter(range(1, 1 << 62))
    call = [0]  # the training call running now (None in an evaluation): installed inside call 0, after its pre-hooks

    def finite(value) -> bool:
        return all(bool(torch.isfinite(t).all()) for t in tree_flatten(value)[0]
                   if isinstance(t, torch.Tensor) and t.is_floating_point())

    def note(key: str, where: list) -> None:
        if seen[key] is None:
            seen[key] = where
            Path(path).write_text(json.dumps(seen))

    def watch(root, inputs):
        parameters = list(root.named_parameters())  # in the model's order, as a blame names the first
        root.register_forward_pre_hook(lambda module, args: call.__setitem__(
            0, next(calls) if torch.is_grad_enabled() else None))
        for name, module in root.named_modules():
            module.register_forward_hook(lambda module, args, output, name=name: note("forward", [call[0], name])
                                         if call[0] is not None and finite(args) and not finite(output) else None)

        def after_update(optimizer, args, kwargs):
            step = next(updates)
            bad = [name for name, parameter in parameters if not finite(parameter)]
            if bad:
                note("update", [step, bad[0]])

        register_optimizer_step_post_hook(after_update)

    _before_training_forward(model, 0, watch)


def loader_batch_size(batch_size: int) -> None:
    """Every torch DataLoader the script makes batches `batch_size` items, whatever the script says."""
    from torch.utils.data import DataLoader

    init = DataLoader.__init__

    @functools.wraps(init)
    def resized_init(loader, dataset, *args, **kwargs):
        if args:
            args = (batch_size, *args[1:])
        else:
            kwargs["batch_size"] = batch_size
        init(loader, dataset, *args, **kwargs)

    DataLoader.__init__ = resized_init
