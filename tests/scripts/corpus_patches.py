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
