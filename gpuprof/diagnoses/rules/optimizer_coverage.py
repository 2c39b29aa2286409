"""Trainable parameters that none of the optimizers gpuprof was given updates.

Read from the loop's facts (meta["loop"]["optimizer"], gpuprof.capture.loopfacts). Most often the
loop steps a second optimizer gpuprof was not given (Muon for the matrices, AdamW for the rest):
NaN forensics then keeps the state after that optimizer's update, not before it, and the
optimizer phase and the learning rate leave it out. Else nothing updates them, and their gradients
cost backward time and memory for nothing.
"""

from __future__ import annotations

from gpuprof.diagnoses.finding import Finding
from gpuprof.diagnoses.registry import rule


@rule("params-without-optimizer", "numerics")
def params_without_optimizer(ctx):
    facts = ctx.loop("optimizer")
    count = facts.get("params_without_optimizer")
    if not count:
        return None
    names = facts.get("params_without_optimizer_names") or []
    return Finding(
        rule="params-without-optimizer",
        severity="warning",
        title=f"{count} trainable parameters are in none of the optimizers gpuprof was given"
              + (f" (first: {names[0]})" if names else ""),
        evidence={"params_without_optimizer": count, "first_names": names,
                  "optimizers": facts.get("class")},
        fix=("If the loop steps another optimizer, give gpuprof all of them: gpuprof.profile(..., "
             "optimizer=[muon, adamw]), so that NaN forensics keeps the state from before every update and "
             "the optimizer phase covers them. If nothing updates these parameters, requires_grad_(False) "
             "saves their gradients."),
    )
