"""A per-parameter (for-loop) optimizer step on CUDA where a fused kernel exists."""

from __future__ import annotations

from gpuprof.diagnoses.finding import Finding
from gpuprof.diagnoses.registry import rule

FUSABLE = {"adam", "adamw", "sgd", "adagrad"}
# Below this share of step time the optimizer step is not worth a warning.
OPTIMIZER_SHARE_WARNING_PCT = 5.0


def optimizer_facts(ctx) -> dict:
    """What the run recorded about its optimizer: meta['optimizer'] from capture, else config knobs."""
    facts = dict(ctx.meta.get("optimizer") or {})
    if "fused" not in facts and ctx.config_value("fused_adamw", "fused_optimizer") is not None:
        facts.setdefault("class", "AdamW")
        facts["fused"] = bool(ctx.config_value("fused_adamw", "fused_optimizer"))
    return facts


@rule("unfused-optimizer", gpu_only=True)
def unfused_optimizer(ctx):
    facts = optimizer_facts(ctx)
    name = str(facts.get("class", "")).lower()
    if name not in FUSABLE or facts.get("fused") is not False:
        return None
    optimizer_share_pct = ctx.summary.phase_split_pct.get("optimizer")
    return Finding(
        rule="unfused-optimizer",
        severity="warning" if (optimizer_share_pct or 0) >= OPTIMIZER_SHARE_WARNING_PCT else "info",
        title=f"{facts.get('class')} updates parameters without the fused CUDA kernel",
        evidence={**facts, "optimizer_share_pct": optimizer_share_pct},
        fix=(
            f"torch.optim.{facts.get('class')}(params, ..., fused=True): one kernel for all parameters "
            "instead of several per tensor (gpuprof train: --fused-adamw)."
        ),
    )
