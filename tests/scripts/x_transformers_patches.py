"""What x-transformers' train_enwik8.py gets at run time, in its own process, before it starts
(corpus_x_transformers.py describes the whole): its sizes, a small Decoder, and a CPU for its `.cuda()` calls."""

from __future__ import annotations

import functools
import itertools
import operator
import time

from corpus_patches import after_binding

MODEL = dict(dim=32, depth=2, heads=2)  # Decoder's own arguments; the script's are 512, 6, 8


def shrink(names: dict) -> None:
    """The script's constants `names` rebound as it binds them, and every Decoder it makes MODEL's size."""
    for name, value in names.items():
        after_binding(name, lambda _, value=value: value)
    after_binding("Decoder", _made_small)


def _made_small(decoder_class):
    def small_decoder(**arguments):
        return decoder_class(**{**arguments, **MODEL})

    return small_decoder


def cuda_is_cpu() -> None:
    """The script moves its model and every sample to CUDA with `.cuda()`: here they stay on the CPU."""
    import torch

    torch.nn.Module.cuda = lambda module, device=None: module
    torch.Tensor.cuda = lambda tensor, *args, **kwargs: tensor


def slow_train_cycle(delay_s: float) -> None:
    """The script's first `cycle(loader)` (its train_loader) reads a loader that takes `delay_s` longer an item,
    outside the DataLoader: the time goes by inside the script's own generator, in its `for data in loader`, as a
    generator reading a slow stream would spend it. The delay is C iterators only (`map`, `zip`), so that no frame
    of this file stands between the sleep and the script's generator."""
    made = []

    def slow_cycle(cycle):
        @functools.wraps(cycle)
        def first_slow(loader):
            made.append(loader)
            return cycle(_delayed(loader, delay_s) if len(made) == 1 else loader)

        return first_slow

    after_binding("cycle", slow_cycle)


def _delayed(iterable, delay_s: float):
    """`iterable`'s items, each followed by a sleep of `delay_s` (the loaders here never run out: the script's
    own split holds far more batches than a test draws)."""
    return map(operator.itemgetter(0), zip(iterable, map(time.sleep, itertools.repeat(delay_s))))
