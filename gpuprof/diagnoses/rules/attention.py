"""Attention computed by the eager softmax(QK^T)V path instead of a fused SDPA kernel.

Read from the model capture saw: a transformers model names its attention implementation
(`attn_implementation`). A hand-written attention names none and gets no finding: softmax
ops in a trace also come from routers and distillation losses, so they prove nothing.
"""

from __future__ import annotations

from gpuprof.diagnoses.finding import Finding
from gpuprof.diagnoses.knob import knob
from gpuprof.diagnoses.recorded_loop import eager_attention
from gpuprof.diagnoses.registry import rule

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
            f"kernels on CUDA in fp16/bf16{ctx.workload_flags('--attention sdpa')}."
        ),
    )


@knob("sdpa-attention", rule="attention-not-fused", train_flags=("--attention", "sdpa"))
def sdpa_attention(patch):
    """A Hugging Face model that runs an unfused attention switches to attn_implementation="sdpa"
    (torch's scaled_dot_product_attention), through its own set_attn_implementation.

    Other models are left as they are: their attention is their own code."""

    def to_sdpa(model) -> str | None:
        from gpuprof.modules import eager_model

        inner = eager_model(model)
        config = getattr(inner, "config", None)
        if not hasattr(inner, "set_attn_implementation") or not eager_attention(
                {"attn_implementation": getattr(config, "_attn_implementation", None)}):
            return None
        inner.set_attn_implementation("sdpa")
        return '{model}.set_attn_implementation("sdpa")  # or from_pretrained(..., attn_implementation="sdpa")'

    patch.model(to_sdpa)
