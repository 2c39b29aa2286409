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


def limit_lightning_trainer(max_steps: int) -> None:
    """The Lightning example trains 20 epochs of WikiText2: stop after `max_steps` optimizer steps,
    validate and test on 2 batches, write no checkpoint, log or progress bar."""
    import lightning

    trainer_init = lightning.Trainer.__init__

    @functools.wraps(trainer_init)
    def __init__(trainer, *args, **kwargs):
        kwargs.update(max_steps=max_steps, limit_val_batches=2, limit_test_batches=2, num_sanity_val_steps=0,
                      enable_checkpointing=False, logger=False, enable_progress_bar=False, accelerator="cpu")
        trainer_init(trainer, *args, **kwargs)

    lightning.Trainer.__init__ = __init__


# ---------------------------------------------------------------------------------------------- faults
# Each breaks a training script from outside it, as its own bug would: through torch's global hooks
# or a wrapper around a class of the script's own module, never by editing the script.
def nanogpt_lr_spike(at_call: int, lr: float) -> None:
    """Every optimizer's lr set to `lr` before nanoGPT's training call `at_call` (after the loop set
    that iteration's lr from its schedule): that iteration's update is made with it."""
    import torch

    optimizers = []
    init = torch.optim.Optimizer.__init__

    @functools.wraps(init)
    def remembering_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        optimizers.append(self)

    torch.optim.Optimizer.__init__ = remembering_init

    def spike(gpt):
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr

    _before_training_forward("model", "GPT", at_call, spike)


def _before_training_forward(module_name: str, class_name: str, at_call: int, fault: Callable) -> None:
    """fault(model) runs before the `at_call`-th training call (grad enabled, from 0) of `class_name`."""
    import torch

    def patch(module):
        cls = getattr(module, class_name)
        forward, calls = cls.forward, iter(range(1 << 62))

        @functools.wraps(forward)
        def faulty_forward(self, *args, **kwargs):
            if torch.is_grad_enabled() and next(calls) == at_call:
                with torch.no_grad():
                    fault(self)
            return forward(self, *args, **kwargs)

        cls.forward = faulty_forward

    after_import(module_name, patch)


def nanogpt_bad_embedding_row(at_call: int, row: int = 0) -> None:
    """A NaN written into row `row` of nanoGPT's token embedding before training call `at_call`."""
    _before_training_forward("model", "GPT", at_call, lambda gpt: gpt.transformer.wte.weight[row].fill_(float("nan")))


def nanogpt_attention_overflow(at_call: int, scale: float = 1e25) -> None:
    """The first block's query/key/value weights scaled by `scale` before training call `at_call`:
    finite weights whose attention scores overflow."""
    _before_training_forward("model", "GPT", at_call, lambda gpt: gpt.transformer.h[0].attn.c_attn.weight.mul_(scale))
