"""What the loop runs with, read from the objects it hands over: meta.json's "loop".

Model (class, attention implementation, compiled, module types), optimizer (fused/foreach,
param groups, whether a fused kernel exists; of several, each one's in "members"; the model's
trainable parameters none of them updates), DataLoader settings, torch's global matmul and
cuDNN switches, all read once at start; the autocast dtype of the first training forward, and
whether it ran inside torch.compile'd code (a loop may hand over the plain model and run a
compiled wrapper), come from ModelInfo. The diagnoses read these instead of the workload's config.
"""

from __future__ import annotations

import inspect
from collections import Counter
from typing import Any

import torch

from gpuprof.capture import environment
from gpuprof.modules import eager_model
from gpuprof.optimizers import OptimizerChain, params_without_optimizer
from gpuprof.torch_compat import private

NAMES_KEPT = 5  # of the parameters no optimizer updates, the names meta.json lists

# a torch without the helper: fused kernels were CUDA-only then
fused_devices = private("torch.optim.optimizer._get_fused_kernels_supported_devices", lambda: ["cuda"])

MODULE_TYPES = 20  # the most frequent module classes kept


def model_facts(model: torch.nn.Module) -> dict[str, Any]:
    inner = eager_model(model)
    config = getattr(inner, "config", None)
    attention = getattr(config, "_attn_implementation", None) or getattr(config, "attn_implementation", None)
    types = Counter(type(module).__name__ for module in inner.modules())
    return {
        "class": type(inner).__name__,
        "attn_implementation": attention if isinstance(attention, str) else None,
        "compiled": _compiled(model),
        "module_types": dict(types.most_common(MODULE_TYPES)),
    }


def _compiled(model: Any) -> bool:
    """torch.compile(model) wraps it (`_orig_mod`); model.compile() compiles it in place."""
    while isinstance(model, torch.nn.Module):
        if getattr(model, "_compiled_call_impl", None) is not None or hasattr(model, "_orig_mod"):
            return True
        model = getattr(model, "module", None)  # DistributedDataParallel around a compiled model
    return False


def optimizer_facts(optimizer: Any) -> dict[str, Any]:
    if isinstance(optimizer, OptimizerChain):
        parts = [optimizer_facts(member) for member in optimizer.members]
        return {"class": optimizer.name, "param_groups": sum(part["param_groups"] for part in parts), "members": parts}
    defaults = getattr(optimizer, "defaults", None) or {}
    groups = getattr(optimizer, "param_groups", None) or []
    return {
        "class": type(optimizer).__name__,
        "fused": defaults.get("fused"),
        "foreach": defaults.get("foreach"),
        "param_groups": len(groups),
        "fused_supported": _fused_supported(optimizer, groups),
    }


def _optimizer_and_coverage(optimizer: Any, model: torch.nn.Module | None) -> dict[str, Any]:
    """The optimizer's facts, and the model's trainable parameters none of the optimizers given updates."""
    facts = optimizer_facts(optimizer)
    if model is not None:
        outside = params_without_optimizer(eager_model(model), optimizer)
        facts.update(params_without_optimizer=len(outside), params_without_optimizer_names=outside[:NAMES_KEPT])
    return facts


def _fused_supported(optimizer: Any, groups: list) -> bool:
    """Whether this optimizer class takes fused=True in this torch, for the device of its parameters."""
    try:
        accepts = "fused" in inspect.signature(type(optimizer).__init__).parameters
    except (TypeError, ValueError):
        return False
    device = next((param.device for group in groups for param in group.get("params", ())), None)
    return accepts and device is not None and device.type in fused_devices()


def loader_facts(loader: Any) -> dict[str, Any]:
    return {
        "class": type(loader).__name__,
        "num_workers": int(getattr(loader, "num_workers", 0) or 0),
        "pin_memory": bool(getattr(loader, "pin_memory", False)),
        "prefetch_factor": getattr(loader, "prefetch_factor", None),
        "persistent_workers": bool(getattr(loader, "persistent_workers", False)),
        "batch_size": getattr(loader, "batch_size", None),
    }


class LoopFacts:
    name = "loop_facts"

    def __init__(self, model: torch.nn.Module | None, optimizer: Any, loader: Any):
        self._objects = (model, optimizer, loader)
        self._facts: dict[str, Any] = {}

    def on_start(self, prof) -> None:
        model, optimizer, loader = self._objects
        self._facts = {
            "model": model_facts(model) if model is not None else None,
            "optimizer": _optimizer_and_coverage(optimizer, model) if optimizer is not None else None,
            "loader": loader_facts(loader) if loader is not None else None,
            "torch": environment.torch_settings(),
        }

    def meta(self, prof) -> dict[str, Any]:
        if not self._facts:
            return {}
        facts = dict(self._facts)
        if facts["model"] is not None and prof.model_info.called_compiled:  # a compiled wrapper runs it
            facts["model"] = {**facts["model"], "compiled": True}
        return {"loop": {**facts, "autocast_dtype": prof.model_info.autocast_dtype}}
