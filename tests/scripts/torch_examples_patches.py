"""What pytorch/examples' distributed examples need to run on this machine's CPUs under torchrun over gloo, patched
in at run time (script_corpus.py `patches`): each rank's process gets them before the script starts. The scripts
ask for GPUs (FSDP2's example: two accelerators, or it exits; the DDP tutorial: `torch.cuda.set_device`, NCCL,
`.to(local_rank)`, `device_ids=[local_rank]`); here each rank is a CPU process, as a user without GPUs would run
them."""

from __future__ import annotations

import functools
import json
import os
import threading
from pathlib import Path


def cpu_accelerators() -> None:
    """torch.accelerator reports one CPU "accelerator" per rank, so FSDP2's example, which exits without two, puts
    each rank on `cpu:RANK`, whose default backend is gloo (the CPU has no device index to switch to)."""
    import torch

    world_size = int(os.environ.get("WORLD_SIZE", 1))
    torch.accelerator.is_available = lambda *args, **kwargs: True
    torch.accelerator.device_count = lambda *args, **kwargs: world_size
    torch.accelerator.current_accelerator = lambda *args, **kwargs: torch.device("cpu")
    _process_group_on_gloo()


def cuda_to_cpu() -> None:
    """The DDP tutorial's CUDA and NCCL as a CPU rank's: `torch.cuda.set_device` does nothing, `nccl` is `gloo`,
    a module or tensor moved to a device index (`.to(local_rank)`) stays on the CPU, and DDP gets no `device_ids`."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    torch.cuda.set_device = lambda device: None
    _process_group_on_gloo()
    torch.nn.Module.to = _index_is_cpu(torch.nn.Module.to)
    torch.Tensor.to = _index_is_cpu(torch.Tensor.to)
    ddp_init = DistributedDataParallel.__init__

    @functools.wraps(ddp_init)
    def without_device_ids(ddp, module, *args, **kwargs):
        kwargs.pop("device_ids", None)
        ddp_init(ddp, module, *args, **kwargs)

    DistributedDataParallel.__init__ = without_device_ids


def _process_group_on_gloo() -> None:
    """init_process_group on gloo for `nccl`, and with no `device_id` for a CPU (gloo binds no device)."""
    import torch.distributed

    init_process_group = torch.distributed.init_process_group

    @functools.wraps(init_process_group)
    def on_gloo(*args, **kwargs):
        if kwargs.get("backend") == "nccl":
            kwargs["backend"] = "gloo"
        device = kwargs.get("device_id")
        if device is not None and torch.device(device).type == "cpu":
            del kwargs["device_id"]
        return init_process_group(*args, **kwargs)

    torch.distributed.init_process_group = on_gloo


def _index_is_cpu(to):
    """`to` with a bare device index (a GPU's, in torch's reading) taken as the CPU."""
    @functools.wraps(to)
    def to_cpu_for_an_index(self, *args, **kwargs):
        if args and isinstance(args[0], int) and not isinstance(args[0], bool):
            args = ("cpu", *args[1:])
        return to(self, *args, **kwargs)

    return to_cpu_for_an_index


def record_losses(folder: str) -> None:
    """Every value `backward()` is called on, as the script computed it, appended to FOLDER/rank-R.jsonl: the
    script's own loss, read beside gpuprof (which records what backward() is called on too, its own way)."""
    import torch

    path = Path(folder) / f"rank-{os.environ.get('RANK', 0)}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    backward, inside = torch.Tensor.backward, threading.local()

    @functools.wraps(backward)
    def recording_backward(tensor, *args, **kwargs):
        if getattr(inside, "call", False):  # a TorchFunctionMode (gpuprof's tape) dispatches the same call again
            return backward(tensor, *args, **kwargs)
        with path.open("a") as log:
            log.write(json.dumps(tensor.detach().float().sum().item()) + "\n")
        inside.call = True
        try:
            return backward(tensor, *args, **kwargs)
        finally:
            inside.call = False

    torch.Tensor.backward = recording_backward


def stuck_in_data(on_rank: int, at_fetch: int) -> None:
    """On rank `on_rank`, the DataLoader's `at_fetch`-th batch (from 0) never comes: a read that blocks forever."""
    if int(os.environ.get("RANK", 0)) != on_rank:
        return
    from torch.utils.data._utils import fetch

    original, fetches = fetch._MapDatasetFetcher.fetch, iter(range(1 << 62))

    @functools.wraps(original)
    def blocking_fetch(fetcher, indices):
        if next(fetches) == at_fetch:
            threading.Event().wait()
        return original(fetcher, indices)

    fetch._MapDatasetFetcher.fetch = blocking_fetch


def reset_every_layer() -> None:
    """FSDP2's example builds its Transformer on the meta device, then `to_empty()` and `reset_parameters()`: the
    Transformer's resets its embeddings, norm and output only, so its layers keep the memory `to_empty()` handed
    them, uninitialized (on this machine's CPU: NaN at every step). Here the Transformer's also resets each
    layer (TransformerBlock.reset_parameters, which the example has and never calls)."""
    from corpus_patches import after_import

    def patch(module):
        reset = module.Transformer.reset_parameters

        @functools.wraps(reset)
        def reset_with_layers(model):
            reset(model)
            for layer in model.layers:
                layer.reset_parameters()

        module.Transformer.reset_parameters = reset_with_layers

    after_import("model", patch)


def record_clip_norms(folder: str) -> None:
    """The total gradient norm each `clip_grad_norm_` call returns, appended to FOLDER/clip-rank-R.jsonl."""
    import torch

    path = Path(folder) / f"clip-rank-{os.environ.get('RANK', 0)}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    clip = torch.nn.utils.clip_grad_norm_

    @functools.wraps(clip)
    def recording_clip(*args, **kwargs):
        total = clip(*args, **kwargs)
        with path.open("a") as log:
            log.write(json.dumps(float(total.full_tensor() if hasattr(total, "full_tensor") else total)) + "\n")
        return total

    torch.nn.utils.clip_grad_norm_ = recording_clip


def slow_random_batch(delay_s: float, on_rank: int) -> None:
    """FSDP2's example draws each batch with torch.randint: on rank `on_rank` each draw takes `delay_s` longer."""
    import time

    import torch

    if int(os.environ.get("RANK", 0)) != on_rank:
        return
    randint = torch.randint

    @functools.wraps(randint)
    def slow_randint(*args, **kwargs):
        time.sleep(delay_s)
        return randint(*args, **kwargs)

    torch.randint = slow_randint


def random_batch_never_comes(on_rank: int, at_call: int) -> None:
    """FSDP2's example draws each batch with torch.randint: on rank `on_rank` its `at_call`-th draw (from 0) blocks
    forever."""
    import torch

    if int(os.environ.get("RANK", 0)) != on_rank:
        return
    randint, calls = torch.randint, iter(range(1 << 62))

    @functools.wraps(randint)
    def blocking_randint(*args, **kwargs):
        if next(calls) == at_call:
            threading.Event().wait()
        return randint(*args, **kwargs)

    torch.randint = blocking_randint


def nan_in_batch(at_fetch: int, on_rank: int) -> None:
    """On rank `on_rank`, the DataLoader's `at_fetch`-th batch (from 0) comes with a NaN in its first input: a bad
    record read from disk."""
    import torch
    from torch.utils.data._utils import fetch

    if int(os.environ.get("RANK", 0)) != on_rank:
        return
    original, fetches = fetch._MapDatasetFetcher.fetch, iter(range(1 << 62))

    @functools.wraps(original)
    def bad_fetch(fetcher, indices):
        batch = original(fetcher, indices)
        if next(fetches) == at_fetch:
            inputs = batch[0]
            inputs[0, 0] = torch.nan
        return batch

    fetch._MapDatasetFetcher.fetch = bad_fetch
