"""Attention computed by the eager softmax(QK^T)V path instead of a fused SDPA kernel."""

from __future__ import annotations

from gpuprof.diagnoses.finding import Finding
from gpuprof.diagnoses.registry import rule

UNFUSED_ATTENTION = {"eager", "math", "manual"}


@rule("attention-not-fused")
def attention_not_fused(ctx):
    attention = ctx.config_value("attention", "attn_implementation", "sdpa")
    if attention is False:
        attention = "eager"
    if str(attention).lower() not in UNFUSED_ATTENTION:
        return None
    return Finding(
        rule="attention-not-fused",
        severity=ctx.gpu_warning,
        title="Attention runs the eager path, materialising the full attention matrix",
        evidence={"attention": attention, "device_kind": ctx.summary.device_kind},
        fix=(
            "Use torch.nn.functional.scaled_dot_product_attention (Hugging Face: "
            "attn_implementation='sdpa'), which dispatches to FlashAttention or memory-efficient "
            "kernels on CUDA in fp16/bf16 (gpuprof train: --attention sdpa)."
        ),
    )
