"""An optimizer that updates parameters tensor by tensor where one fused kernel exists.

Read from the optimizer capture saw (its class, `fused`/`foreach` defaults and whether torch
has a fused kernel for it on the run's device) and the measured optimizer phase.
"""

from __future__ import annotations

import inspect

from gpuprof.diagnoses.finding import Finding
from gpuprof.diagnoses.knob import knob
from gpuprof.diagnoses.recorded_loop import unfused_optimizers
from gpuprof.diagnoses.registry import rule

UNFUSED_OPTIMIZER = "unfused-optimizer"

# Below this share of step time the optimizer step is not worth a warning.
OPTIMIZER_SHARE_WARNING_PCT = 5.0


def implementation(facts: dict, on_gpu: bool) -> str:
    """What torch runs: foreach (multi-tensor) is its default on CUDA, a per-tensor loop elsewhere."""
    if facts.get("fused"):
        return "fused"
    foreach = facts.get("foreach")
    return "foreach" if foreach or (foreach is None and on_gpu) else "for-loop"


@rule(UNFUSED_OPTIMIZER, "compute")
def unfused_optimizer(ctx):
    unfused = unfused_optimizers(ctx.loop("optimizer"))
    if not unfused:
        return None
    facts = unfused[0]
    optimizer_share_pct = ctx.summary.phase_split_pct.get("optimizer")
    name = facts.get("class")
    runs = implementation(facts, ctx.on_gpu)
    return Finding(
        rule=UNFUSED_OPTIMIZER,
        severity="warning" if (optimizer_share_pct or 0) >= OPTIMIZER_SHARE_WARNING_PCT else "info",
        title=f"{name} updates parameters with its {runs} implementation, not the fused kernel",
        evidence={
            "class": name,
            "implementation": runs,
            "fused": facts.get("fused"),
            "foreach": facts.get("foreach"),
            "param_groups": facts.get("param_groups"),
            "optimizer_share_pct": optimizer_share_pct,
            "threshold_pct": OPTIMIZER_SHARE_WARNING_PCT,
        },
        fix=(
            f"torch.optim.{name}(params, ..., fused=True): one kernel for all parameters instead of "
            f"several per tensor{ctx.workload_flags('--fused-adamw')}."
        ),
    )


@knob("fused-optimizer", rule=UNFUSED_OPTIMIZER, train_flags=("--fused-adamw",))
def fused_optimizer(patch):
    """torch.optim optimizers that have a fused kernel (Adam, AdamW, SGD, Adagrad) are built with
    fused=True, unless the script chose fused or foreach itself.

    torch refuses fused=True for parameters on a device without the kernel, as it would in the script."""
    import torch

    def choose(bound) -> dict:
        given = bound.arguments
        return {} if given.get("fused") is not None or given.get("foreach") is not None else {"fused": True}

    for name in dir(torch.optim):
        cls = getattr(torch.optim, name)
        if (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and "__init__" in cls.__dict__
                and "fused" in inspect.signature(cls.__init__).parameters):
            patch.keywords(cls, choose)
