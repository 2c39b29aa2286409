"""Training FLOPs per token: the one formula throughput and MFU are computed with.

    flops_per_token = 6 * N + 12 * L * H * Q * T

the convention of nanoGPT's `estimate_mfu` and the PaLM paper (appendix B): N is the
number of parameters excluding position embeddings (nanoGPT counts the tied token
embedding once; it does take part in the lm_head matmul), L layers, H heads, Q head
dimension, T sequence length. 6N counts the forward (2N) and backward (4N) matmul FLOPs
of the weights; 12·L·H·Q·T the attention score and value matmuls, forward and backward.
It ignores non-matmul work and activation recomputation (so MFU, not HFU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gpuprof.modules import materialized


@dataclass(frozen=True)
class TransformerShape:
    n_params: int
    n_layers: int
    n_heads: int
    d_model: int
    seq_len: int | None


def flops_per_token(n_params: int, n_layers: int, n_heads: int, head_dim: int, seq_len: int) -> float:
    return 6.0 * n_params + 12.0 * n_layers * n_heads * head_dim * seq_len


def _config_value(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if value is None and isinstance(config, dict):
            value = config.get(name)
        if isinstance(value, int):
            return value
    return None


def _position_embedding_params(model: torch.nn.Module) -> int:
    return sum(
        param.numel()
        for name, param in model.named_parameters()
        if name.endswith(("wpe.weight", "position_embeddings.weight", "embed_positions.weight"))
    )


def transformer_shape(model: torch.nn.Module, seq_len: int | None = None) -> TransformerShape | None:
    """The shape of a Hugging Face style transformer (GPT2LMHeadModel or any model with a config), else None."""
    model = getattr(model, "module", model)  # DistributedDataParallel wraps the model
    config = getattr(model, "config", None)
    if config is None:
        return None
    n_layers = _config_value(config, "n_layer", "num_hidden_layers", "num_layers")
    n_heads = _config_value(config, "n_head", "num_attention_heads")
    d_model = _config_value(config, "n_embd", "hidden_size", "d_model")
    params = materialized(model.parameters())
    if not (n_layers and n_heads and d_model) or params is None:
        return None
    n_params = sum(p.numel() for p in params) - _position_embedding_params(model)
    return TransformerShape(n_params, n_layers, n_heads, d_model, seq_len)


def model_flops_per_token(model: torch.nn.Module, seq_len: int) -> float | None:
    """Training FLOPs per token of `model` at sequence length `seq_len`, or None for a model without a config."""
    shape = transformer_shape(model, seq_len)
    if shape is None:
        return None
    return flops_per_token(shape.n_params, shape.n_layers, shape.n_heads, shape.d_model // shape.n_heads, seq_len)
