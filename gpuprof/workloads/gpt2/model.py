"""The model (Hugging Face GPT-2, random init), its loss, and the precision settings."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from gpuprof.hardware import native_bf16
from gpuprof.workloads.gpt2.config import SIZES, TrainConfig


def build_model(config: TrainConfig) -> torch.nn.Module:
    """GPT2LMHeadModel with GPT-2's own initialisation; no weights are downloaded."""
    from transformers import GPT2Config, GPT2LMHeadModel

    size = SIZES[config.model_size]
    model_config = GPT2Config(
        n_layer=config.n_layer,
        n_head=size.n_head,
        n_embd=size.d_model,
        n_positions=size.n_positions,
        vocab_size=config.vocab_size,
        resid_pdrop=config.dropout,
        embd_pdrop=config.dropout,
        attn_pdrop=config.dropout,
        use_cache=False,
        bos_token_id=None,  # GPT-2's 50256 is not in a smaller vocabulary; training needs neither
        eos_token_id=None,
        attn_implementation=config.attention,
    )
    model = GPT2LMHeadModel(model_config)
    if config.activation_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


def lm_loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over every position (targets are inputs shifted by one)."""
    logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def compute_dtype(config: TrainConfig, device: torch.device) -> torch.dtype:
    """fp32, or the autocast dtype: `auto` is bf16 where the device computes it natively, else fp16 on a GPU
    (with a GradScaler) and fp32 on a CPU, where emulated bf16 and fp16 are slower than fp32."""
    if config.precision == "auto":
        if native_bf16(device.type):
            return torch.bfloat16
        return torch.float16 if device.type == "cuda" else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[config.precision]


def autocast(dtype: torch.dtype, device: torch.device):
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(dtype: torch.dtype, device: torch.device) -> torch.amp.GradScaler:
    """A GradScaler that is active only for fp16 (a disabled one passes everything through)."""
    return torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)


def enable_tf32(device: torch.device) -> None:
    """TF32 tensor-core matmuls on Ampere and newer; CPU matmuls are untouched."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def build_optimizer(model: torch.nn.Module, config: TrainConfig):
    """AdamW with weight decay on matrices only (nanoGPT's grouping)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    # fused=None is torch's default choice (foreach on CUDA): the plain AdamW people start from.
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), fused=config.fused_adamw or None)
