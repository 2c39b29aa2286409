"""Seeing through what a training loop wraps its model in (compile, DDP, FSDP2 shards): a neutral
home for what capture and numerics both need."""

from __future__ import annotations

import functools
import os
import sys

import torch

from gpuprof.torch_compat import private


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
    eval_frame = private("torch._dynamo.eval_frame")
    contexts = tuple(kind for kind in (getattr(eval_frame, "OptimizeContext", None),
                                       getattr(eval_frame, "OptimizedModule", None)) if isinstance(kind, type))
    frame = sys._getframe(1)
    while frame is not None and contexts:
        if frame.f_code.co_filename.endswith(_EVAL_FRAME_FILE) and isinstance(frame.f_locals.get("self"), contexts):
            return True
        frame = frame.f_back
    return False


def materialized(params) -> list[torch.nn.Parameter] | None:
    """The parameters as a list, or None while one is a lazy module's, not yet materialized by its first
    forward (`nn.LazyLinear`): such a parameter has no shape, and any use of it raises."""
    params = list(params)
    return None if any(torch.nn.parameter.is_lazy(param) for param in params) else params


def initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def distributed_facts() -> dict:
    if not initialized():
        return {}
    return {"backend": str(torch.distributed.get_backend()), "world_size": torch.distributed.get_world_size()}


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


def named_parameters(model: torch.nn.Module):
    """model.named_parameters(), with each FSDP2 parameter as its sharded DTensor: between its all-gather and
    its reshard (the root's from its forward to the end of its backward) FSDP2 registers the gathered, unsharded
    tensor on the module instead, whose memory it frees at the reshard."""
    sharded = _sharded_of_unsharded(model)
    for name, param in model.named_parameters():
        yield name, sharded.get(id(param), param)


def _sharded_of_unsharded(model: torch.nn.Module) -> dict[int, torch.nn.Parameter]:
    """id of each FSDP2 unsharded parameter of the model's units -> its sharded parameter."""
    found = {}
    for module in model.modules():
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        group = getattr(state, "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", ()):
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                found[id(unsharded)] = fsdp_param.sharded_param
    return found
