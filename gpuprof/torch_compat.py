"""Every private torch name gpuprof uses, in one place, with what is lost on a torch without it.

No public API gives some of what gpuprof reads (the autograd engine's callbacks, the torch function mode stack,
a GradScaler's scale tensor, the Flight Recorder), and any torch release may move or drop these. So gpuprof
reaches a module-level one only through `private(name, fallback)`: on a torch that lacks it, the code gets the
fallback (that one signal is off, or computed another way), the log says once what is lost, and meta.json's
`versions` name what is missing (`torch_internals_missing`). The attributes of torch's objects are read with a
default where they are used. tests/capture/test_torch_compat.py fails loudly when the installed torch lacks any
name listed here, and when gpuprof's code uses a private torch name not listed here.

Tested floor: torch 2.13 (the pinned CPU build); newest tested: 2.14.1 (a second CI pass, scripts/test.sh).
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

logger = logging.getLogger("gpuprof")

# dotted name -> what gpuprof loses (or does instead) where torch lacks it
MODULE_NAMES: dict[str, str] = {
    "torch._foreach_norm": "gradient norms are taken one tensor at a time (slower)",
    "torch._foreach_copy_": "kept numerics state is copied one tensor at a time (slower)",
    "torch._foreach_mul": "update ratios copy the weights one tensor at a time (slower)",
    "torch._foreach_sub": "update ratios subtract the weights one tensor at a time (slower)",
    "torch._dynamo.disable": "gpuprof's hooks may be traced into compiled code (recompiles)",
    "torch._dynamo.eval_frame": "a plain model called from compiled code is taken to run eagerly",
    "torch._dynamo.eval_frame.skip_code": "the loss window's handler may be traced into compiled code (recompiles)",
    "torch._C._current_autograd_node": "the backward op of a NaN is not tied to its module; a loss inside a "
                                       "backward pass is not told apart",
    "torch._C._current_graph_task_id": "DDP's reduction is not told apart from the loop's own collectives",
    "torch._C._push_on_torch_function_stack": "the loss calls outside the model are not recorded for the re-run",
    "torch._C._pop_torch_function_stack": "the loss calls outside the model are not recorded for the re-run",
    "torch._C._len_torch_function_stack": "the loss calls outside the model are not recorded for the re-run",
    "torch._C._get_function_stack_at": "the loss calls outside the model are not recorded for the re-run",
    "torch._C._is_any_autocast_enabled": "autocast is asked per device type (slower)",
    "torch._C.TensorBase": "a loss reading a tensor attribute (logits.mT) cannot be replayed",
    "torch._C._nn": "a loss calling a native torch.nn.functional op cannot be replayed",
    "torch._C._distributed_c10d._dump_fr_trace_json": "no Flight Recorder in hang events",
    "torch.utils._pytree.tree_flatten": "NaN forensics looks into lists, tuples and dicts only",
    "torch.utils._pytree.tree_map": "NaN forensics looks into lists, tuples and dicts only",
    "torch.utils._python_dispatch.TorchDispatchMode": "NaN forensics blames no aten op (module and pass only)",
    "torch.nn.Module._wrapped_call_impl": "a module's call is not where the stack of a batch function ends",
    "torch.nn.Module._call_impl": "a module's call is not where the stack of a batch function ends",
    "torch.autograd.Variable._execution_engine": "the end of each backward pass is not seen (gradient capture off)",
    "torch.autograd._profiler_enabled": "gpuprof's own work is not labelled in profiler traces",
    "torch.cuda.memory._snapshot": "no CUDA memory snapshots",
    "torch.cuda.memory._record_memory_history": "CUDA memory snapshots without allocation history",
    "torch.distributed.distributed_c10d._get_default_store": "the hang watchdog needs the launcher's store",
    "torch.distributed.distributed_c10d._get_default_group": "the hang watchdog names no waiting collective",
    "torch.optim.optimizer._get_fused_kernels_supported_devices": "fused optimizers are taken to be CUDA-only",
    "torch.ops.mkldnn._is_mkldnn_bf16_supported": "bf16 on a CPU is taken to be emulated",
    "torch.nn.utils.clip_grad._get_total_norm": "the loop's clip_grad_norm_ is not read: gpuprof takes its own norm",
    "torch.nn.utils.clip_grad._clip_grads_with_norm_": "the loop's clipping (max_norm) is not seen",
}
# names only some builds have: (name, the build that has it)
BUILD_ONLY: dict[str, str] = {
    "torch._C._cuda_getCurrentRawStream": "cuda",  # else torch.cuda.current_stream() per call (slower)
    "torch._C._distributed_c10d._dump_nccl_trace_json": "cuda",  # else the gloo dump, without NCCL's entries
}
# attributes of torch's objects gpuprof reads: class -> {attribute: what is lost without it}
ATTRIBUTES: dict[str, dict[str, str]] = {
    "torch.amp.GradScaler": {
        "_scale": "no GradScaler scale in the step records", "_growth_tracker": "no GradScaler growth tracker",
        "_init_scale": "no skipped-step detection before the first scale", "_per_optimizer_states":
        "GradScaler skips and unscaling are not seen"},
    "torch.optim.Optimizer": {"_optimizer_step_pre_hooks": "NaN forensics' optimizer copy keeps the loop's hooks",
                              "_optimizer_step_post_hooks": "NaN forensics' optimizer copy keeps the loop's hooks"},
    "torch.nn.Module": {"_compiled_call_impl": "a model compiled in place (model.compile()) is not seen"},
    "torch._dynamo.eval_frame.OptimizedModule": {"_orig_mod": "a torch.compile'd model is not seen through"},
    "torch._ops.OpOverload": {"_schema": "NaN forensics blames no aten op"},
    "torch.nn.parallel.DistributedDataParallel": {"_has_rebuilt_buckets": "DDP's first-bucket arrivals stay on "
                                                                          "the first order"},
    "torch.distributed.fsdp.FSDPModule": {"_get_fsdp_state": "FSDP2's unsharded parameters and resharding unseen"},
    "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState": {"_fsdp_param_group": "FSDP2's groups unseen"},
    "torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam": {"_unsharded_param": "FSDP2's unsharded "
                                                                                     "parameters unseen"},
}

# names gpuprof takes to be missing, to see what it does on a torch without them: comma-separated, or "all"
HIDE_ENV = "GPUPROF_HIDE_TORCH_INTERNALS"
_hidden = os.environ.get(HIDE_ENV, "")
HIDDEN = set(MODULE_NAMES) if _hidden == "all" else set(filter(None, _hidden.split(",")))

_MISSING = object()
_found: dict[str, Any] = {}


def private(name: str, fallback: Any = None) -> Any:
    """torch's object at the dotted `name` (listed in MODULE_NAMES or BUILD_ONLY), or `fallback` where this torch
    has none; the first miss is logged with what is lost."""
    found = _found.get(name)
    if found is None:
        found = _found[name] = _MISSING if name in HIDDEN else resolve(name)
        if found is _MISSING and name in MODULE_NAMES:  # a build-only name is missing from other builds
            logger.warning("gpuprof: this torch has no %s: %s", name, MODULE_NAMES[name])
    return fallback if found is _MISSING else found


def resolve(name: str) -> Any:
    """The object at the dotted `name`, importing its modules as needed; `_MISSING` where there is none."""
    parts = name.split(".")
    try:
        found = importlib.import_module(parts[0])
        for depth, part in enumerate(parts[1:], start=2):
            if hasattr(found, part):
                found = getattr(found, part)
            else:  # a submodule not imported yet
                found = importlib.import_module(".".join(parts[:depth]))
        return found
    except Exception:  # noqa: BLE001 - ImportError, AttributeError, or a lazy namespace's RuntimeError
        return _MISSING


def missing() -> list[str]:
    """The listed names this torch lacks (build-only ones where this build should have them)."""
    import torch

    builds = {"cuda": torch.version.cuda is not None}
    wanted = [*MODULE_NAMES, *(name for name, build in BUILD_ONLY.items() if builds.get(build))]
    return [name for name in wanted if name in HIDDEN or resolve(name) is _MISSING]


def run_eagerly(function):
    """`function` kept out of torch.compile's tracing (torch._dynamo.disable), or as it is."""
    return private("torch._dynamo.disable", _unchanged)(function)


def foreach_norm(tensors: list, ord: float = 2.0) -> list:
    fused = private("torch._foreach_norm")
    if fused is not None:
        return fused(tensors, ord)
    import torch

    return [torch.linalg.vector_norm(tensor, ord) for tensor in tensors]


def foreach_copy_(targets: list, sources: list) -> None:
    fused = private("torch._foreach_copy_")
    if fused is not None:
        fused(targets, sources)
        return
    for target, source in zip(targets, sources):
        target.copy_(source)


def foreach_mul(tensors: list, factor: float) -> list:
    fused = private("torch._foreach_mul")
    return fused(tensors, factor) if fused is not None else [tensor * factor for tensor in tensors]


def foreach_sub(tensors: list, others: list) -> list:
    fused = private("torch._foreach_sub")
    return fused(tensors, others) if fused is not None else [a - b for a, b in zip(tensors, others)]


def tree_flatten(tree: Any) -> tuple[list, Any]:
    """torch.utils._pytree.tree_flatten, or the leaves of nested lists, tuples and dicts (no spec)."""
    flatten = private("torch.utils._pytree.tree_flatten")
    return flatten(tree) if flatten is not None else (_leaves(tree), None)


def tree_map(function, tree: Any) -> Any:
    """torch.utils._pytree.tree_map, or `function` mapped over the leaves of nested lists, tuples and dicts."""
    mapped = private("torch.utils._pytree.tree_map")
    if mapped is not None:
        return mapped(function, tree)
    if isinstance(tree, (list, tuple)):
        return type(tree)(tree_map(function, item) for item in tree)
    if isinstance(tree, dict):
        return {key: tree_map(function, item) for key, item in tree.items()}
    return function(tree)


def _leaves(tree: Any) -> list:
    if isinstance(tree, (list, tuple)):
        return [leaf for item in tree for leaf in _leaves(item)]
    if isinstance(tree, dict):
        return [leaf for item in tree.values() for leaf in _leaves(item)]
    return [tree]


def missing_base(name: str) -> type:
    """A stand-in base class for torch's `name` where this torch lacks it: entering the subclass raises, saying
    so (the caller's own error handling then says what is lost)."""

    class Missing:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            raise RuntimeError(f"this torch has no {name}")

        def __exit__(self, *exc) -> bool:
            return False

    return Missing


def _unchanged(function):
    return function
