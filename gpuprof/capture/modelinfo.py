"""Run-level model facts: shape, FLOPs per token, compute dtype, and the device's peak FLOP/s.

The sequence length and the compute dtype are read from the model's first training forward
call (input shape; autocast state), with a one-shot hook, unless given up front.
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping

import torch

from gpuprof import flops, hardware
from gpuprof.capture.phases import is_training_call
from gpuprof.modules import called_under_compile, eager_model, materialized

_PRECISION_NAMES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16",
                    "fp32": "fp32", "float32": "fp32", "tf32": "tf32", "fp8": "fp8"}


def param_shapes_digest(model: torch.nn.Module) -> str | None:
    """A digest of every parameter's name and (global, unsharded) shape: two runs train the same
    architecture exactly when theirs agree (`gpuprof compare`'s contract); None before a lazy module's first
    forward gave its parameters their shapes."""
    if materialized(model.parameters()) is None:
        return None
    shapes = "\n".join(f"{name}:{tuple(param.shape)}" for name, param in model.named_parameters())
    return hashlib.sha256(shapes.encode()).hexdigest()[:16]


class ModelInfo:
    name = "model_info"

    def __init__(self, model: torch.nn.Module | None, flops_per_token: float | None, config: Mapping[str, Any]):
        self.model = model
        self.flops_per_token = flops_per_token
        self._explicit_flops = flops_per_token is not None
        self.seq_len = next((config[k] for k in ("seq_len", "block_size", "max_seq_len") if isinstance(config.get(k), int)), None)
        configured = str(config.get("precision") or config.get("dtype") or "").lower()
        self.dtype = _PRECISION_NAMES.get(configured)
        self.autocast_dtype: str | None = None  # as seen in the first training forward
        self.called_compiled = False  # the first training forward ran inside torch.compile'd code
        self.peak_flops_per_s = None
        self._device = None
        self._hook = None
        self._prof = None

    def on_start(self, prof) -> None:
        self._prof, self._device = prof, prof.device
        if self.model is not None:
            self._hook = prof.collectors.hook(self, self.model, "forward_pre", self._first_forward)  # one call
        self._update()

    def on_close(self, prof) -> None:
        self._remove_hook()

    def facts(self) -> dict[str, Any] | None:
        if self.model is None:
            return None
        inner = eager_model(self.model)
        shape = flops.transformer_shape(self.model, self.seq_len)
        params = materialized(self.model.parameters())  # a lazy module's, counted once its forward made them
        return {
            "class": type(inner).__name__,
            # DataParallel / DistributedDataParallel / torch.compile, when the user profiles the wrapped model
            "wrapper": type(self.model).__name__ if inner is not self.model else None,
            "n_params": sum(p.numel() for p in params) if params is not None else None,
            "param_shapes_digest": param_shapes_digest(inner),
            "n_layers": shape.n_layers if shape else None,
            "n_heads": shape.n_heads if shape else None,
            "d_model": shape.d_model if shape else None,
            "seq_len": self.seq_len,
            "flops_per_token": self.flops_per_token,
        }

    def _first_forward(self, module, args, kwargs) -> None:
        if not is_training_call(module):
            return
        self._remove_hook()
        self.called_compiled = called_under_compile()
        inputs = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(inputs, torch.Tensor) and inputs.dim() >= 1:
            self.seq_len = int(inputs.shape[-1])
        device_type = self._device.type
        if torch.is_autocast_enabled(device_type):
            self.dtype = self.autocast_dtype = hardware.dtype_name(torch.get_autocast_dtype(device_type))
        elif self.dtype is None:
            self.dtype = hardware.dtype_name(next(module.parameters()).dtype)
        self._update()
        self._prof.rewrite_meta()

    def _update(self) -> None:
        if not self._explicit_flops and self.model is not None and self.seq_len:
            self.flops_per_token = flops.model_flops_per_token(self.model, self.seq_len)
        if self._device is not None and self._device.type == "cuda" and self.dtype:
            name = torch.cuda.get_device_name(self._device)
            compute = hardware.dtype_name(self.dtype, allow_tf32=torch.backends.cuda.matmul.allow_tf32)
            self.peak_flops_per_s = hardware.peak_flops_per_s(name, compute)

    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
