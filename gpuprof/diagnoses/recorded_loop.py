"""What the loop runs with, read from the `loop` facts capture recorded in meta.json
(gpuprof/capture/loopfacts.py): the questions the rules and the report's verdict ask alike.
"""

from __future__ import annotations

UNFUSED_ATTENTION = {"eager", "math", "manual"}
FP32_NAMES = {"fp32", "float32"}


def eager_attention(model_facts: dict) -> bool:
    """Whether the model's recorded attention implementation (meta["loop"]["model"]) is an unfused one."""
    return str(model_facts.get("attn_implementation") or "").lower() in UNFUSED_ATTENTION


def fused_kernel_unused(facts: dict) -> bool:
    """Whether torch has a fused kernel for the recorded optimizer (meta["loop"]["optimizer"]) that it
    was not built to use."""
    return bool(facts.get("fused_supported")) and not facts.get("fused")


def unfused_optimizers(facts: dict) -> list[dict]:
    """The recorded optimizers with an unused fused kernel: of several (a "members" list), each one's facts."""
    return [member for member in facts.get("members", [facts]) if fused_kernel_unused(member)]


def recorded_dtype(meta: dict) -> str | None:
    """The dtype the loop computes in: the autocast dtype capture saw in the forward, else the compute
    dtype it recorded."""
    recorded = (meta.get("loop") or {}).get("autocast_dtype") or meta.get("compute_dtype")
    return None if recorded is None else str(recorded).lower()
