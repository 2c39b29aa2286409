"""Slowdowns the phase tests of the corpus patch in at run time (script_corpus.py `patches`)."""

from __future__ import annotations

import functools
import os
import time


def slow_memmap(delay_s: float) -> None:
    """nanoGPT's get_batch opens its token file with np.memmap on every call: each call then takes `delay_s`
    longer, a batch function doing real work (decoding, augmenting) in the loop's own code."""
    import numpy as np

    memmap = np.memmap

    class SlowMemmap(memmap):
        def __new__(cls, *args, **kwargs):
            time.sleep(delay_s)
            return memmap.__new__(cls, *args, **kwargs)

    np.memmap = SlowMemmap


def slow_dataloader_fetch(delay_s: float, on_rank: int | None = None) -> None:
    """Every batch a torch DataLoader fetches (in the loop's process: no workers) takes `delay_s` longer; under
    torchrun only on rank `on_rank`, when given."""
    from torch.utils.data._utils import fetch

    if on_rank is not None and int(os.environ.get("RANK", 0)) != on_rank:
        return

    original = fetch._MapDatasetFetcher.fetch

    @functools.wraps(original)
    def slow_fetch(fetcher, indices):
        time.sleep(delay_s)
        return original(fetcher, indices)

    fetch._MapDatasetFetcher.fetch = slow_fetch


def validate_every(steps: int) -> None:
    """The Lightning Trainer validates every `steps` training batches instead of once an epoch."""
    import lightning

    trainer_init = lightning.Trainer.__init__

    @functools.wraps(trainer_init)
    def __init__(trainer, *args, **kwargs):
        trainer_init(trainer, *args, **{**kwargs, "val_check_interval": steps})

    lightning.Trainer.__init__ = __init__


def slow_evaluation_calls(model: str, delay_s: float) -> None:
    """Every call of the model class `model` names ("module:Class") with grad off takes `delay_s` longer: an
    evaluation costlier than the training steps (larger batches, generation)."""
    import torch

    from corpus_patches import after_import

    module_name, class_name = model.split(":")

    def patch(module):
        cls = getattr(module, class_name)
        forward = cls.forward

        @functools.wraps(forward)
        def slow_forward(*args, **kwargs):
            if not torch.is_grad_enabled():
                time.sleep(delay_s)
            return forward(*args, **kwargs)

        cls.forward = slow_forward

    after_import(module_name, patch)
