"""Attention computed by the eager softmax(QK^T)V path instead of a fused SDPA kernel.

Read from the model capture saw: a transformers model names its attention implementation
(`attn_implementation`). A hand-written attention names none and gets no finding: softmax
ops in a trace also come from routers and distillation losses, so they prove nothing.
"""

from __future__ import annotations

from gpuprof.diagnoses.finding import Finding
from gpuprof.diagnoses.registry import rule

UNFUSED_ATTENTION = {"eager", "math", "manual"}


def eager_attention(model_facts: dict) -> bool:
    """Whether the model's recorded attention implementation (meta["loop"]["model"]) is an unfused one."""
    return str(model_facts.get("attn_implementation") or "").lower() in UNFUSED_ATTENTION


@rule("attention-not-fused", "compute")
def attention_not_fused(ctx):
    model = ctx.loop("model")
    if not eager_attention(model):
        return None
    implementation = model.get("attn_implementation")
    return Finding(
        rule="attention-not-fused",
        severity=ctx.gpu_warning,
        title="Attention runs the eager path, materialising the full attention matrix",
        evidence={
            "attention": implementation,
            "model_class": model.get("class"),
            "compiled": model.get("compiled"),
            "device_kind": ctx.summary.device_kind,
        },
        fix=(
            "Use torch.nn.functional.scaled_dot_product_attention (Hugging Face: "
            "attn_implementation='sdpa'), which dispatches to FlashAttention or memory-efficient "
            "kernels on CUDA in fp16/bf16 (gpuprof train: --attention sdpa)."
        ),
    )
