"""Patches the corpus runs apply at run time (script_corpus.py): the offline stand-ins for what
the scripts would download, and the limits that keep them short."""

from __future__ import annotations

import functools
from typing import Callable

from gpuprof.integrations.script import _PatchOnImport


def after_import(name: str, patch: Callable) -> None:
    """Calls patch(module) right after module `name` is imported (now, if it already is)."""
    _PatchOnImport({name: patch}).install()


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
# names that class as "module:Class" (nanoGPT's "model:GPT"); `weight` a parameter of it by its
# name in the class's own module ("transformer.wte.weight").
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

    def patch(module):
        cls = getattr(module, class_name)
        forward, calls = cls.forward, iter(range(1 << 62))

        @functools.wraps(forward)
        def faulty_forward(self, *args, **kwargs):
            if torch.is_grad_enabled() and next(calls) == at_call:
                inputs = next(value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor))
                with torch.no_grad():
                    fault(self, inputs)
            return forward(self, *args, **kwargs)

        cls.forward = faulty_forward

    after_import(module_name, patch)


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
