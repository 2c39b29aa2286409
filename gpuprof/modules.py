"""Seeing through what a training loop wraps its model in (compile, DDP, FSDP2 shards): a neutral
home for what capture and numerics both need."""

from __future__ import annotations

import functools
import os
import sys

import torch


def eager_model(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module under torch.compile and DistributedDataParallel wrappers."""
    while True:
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


_EVAL_FRAME_FILE = os.path.join("_dynamo", "eval_frame.py")  # by its end: a moved install keeps older paths


def called_under_compile() -> bool:
    """Whether the caller runs inside torch.compile'd code (a compiled module or function), seen from an
    eager hook of the plain module it calls: a frame of dynamo's eval_frame.py on the stack belongs to
    its compile context. A loop may hand gpuprof the plain model and run a compiled wrapper of it.
    Walks the stack (reading locals of dynamo's frames only): call it once."""
    eval_frame = getattr(torch._dynamo, "eval_frame", None)
    contexts = tuple(kind for kind in (getattr(eval_frame, "OptimizeContext", None),
                                       getattr(eval_frame, "OptimizedModule", None)) if isinstance(kind, type))
    frame = sys._getframe(1)
    while frame is not None and contexts:
        if frame.f_code.co_filename.endswith(_EVAL_FRAME_FILE) and isinstance(frame.f_locals.get("self"), contexts):
            return True
        frame = frame.f_back
    return False


def initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


@functools.cache
def _dtensor_class() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor  # imported once: this runs for every gradient, every step

    return DTensor


def is_dtensor(tensor) -> bool:
    dtensor = _dtensor_class()
    return dtensor is not None and isinstance(tensor, dtensor)


def local_tensor(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's part of a DTensor (an FSDP2 shard, possibly empty); any other tensor as it is."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def is_sharded(model: torch.nn.Module | None) -> bool:
    """Whether the model's parameters are DTensors (FSDP2, tensor parallelism) on an initialized group."""
    return model is not None and initialized() and any(is_dtensor(p) for p in model.parameters())
