"""The never-in-the-way DDP tests' torchrun job: the same steps of the tiny GPT-2 under DistributedDataParallel,
bare and under gpuprof.profile, with and without a comm hook of the loop's own (torch's allreduce_hook,
registered before or after the Profiler starts), one run after the other in one process group.

    torchrun --nproc_per_node 3 ddp_hook_job.py OUT_DIR

Each run NAME leaves its final weights in OUT_DIR/NAME.rankR.pt, its run directory in OUT_DIR/NAME when profiled,
and what the loop saw in OUT_DIR/NAME.seen-rankR.json: its losses, the error registering its hook raised (if
any), when DDP handed the loop's hook its first bucket at each step, and every hook on the model, its parameters,
the optimizer and torch.distributed's collectives before the Profiler started and after it closed.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import gpuprof
from capture_loop import batch, tiny_model
from gpuprof.capture.ddp import LOOP_COLLECTIVES

STEPS = 5
RUNS = {  # name: (profiled, when the loop registers its comm hook: None, "before" or "after" the Profiler starts)
    "bare": (False, None), "profiled": (True, None),
    "bare_hook": (False, "before"), "hook_before": (True, "before"), "hook_after": (True, "after"),
}
MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
COLLECTIVES = {name: getattr(dist, name) for name in LOOP_COLLECTIVES if hasattr(dist, name)}


def hooks_on(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """How many hooks each module, parameter and the optimizer hold, and the collectives replaced on
    torch.distributed."""
    found = {f"{name}.{kind}": len(getattr(module, kind))
             for name, module in model.named_modules() for kind in MODULE_HOOKS}
    for name, param in model.named_parameters():
        found[f"{name}._post_accumulate_grad_hooks"] = len(param._post_accumulate_grad_hooks or {})
        found[f"{name}._backward_hooks"] = len(param._backward_hooks or {})
    found["optimizer"] = len(optimizer._optimizer_step_pre_hooks) + len(optimizer._optimizer_step_post_hooks)
    found["global module hooks"] = sum(map(len, (torch.nn.modules.module._global_forward_hooks,
                                                 torch.nn.modules.module._global_forward_pre_hooks,
                                                 torch.nn.modules.module._global_backward_hooks)))
    found["replaced collectives"] = [name for name, original in COLLECTIVES.items()
                                     if getattr(dist, name) is not original]
    return found


def register_hook(model, seen: dict) -> None:
    """torch's allreduce_hook, noting when DDP hands it the step's first bucket."""
    def timed_allreduce_hook(state, bucket):
        if bucket.index() == 0:
            seen["first_bucket_unix_s"].append(time.time())
        return allreduce_hook(state, bucket)

    try:
        model.register_comm_hook(None, timed_allreduce_hook)
    except RuntimeError as error:
        seen["hook_error"] = str(error)


def run(out_dir: Path, name: str, rank: int) -> None:
    profiled, hook_at = RUNS[name]
    model = torch.nn.parallel.DistributedDataParallel(tiny_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seen = {"losses": [], "hook_error": None, "first_bucket_unix_s": []}
    if hook_at == "before":
        register_hook(model, seen)
    seen["hooks_before"] = hooks_on(model, optimizer)
    prof = gpuprof.profile(out_dir / name, model=model, optimizer=optimizer).start() if profiled else None
    if hook_at == "after":
        register_hook(model, seen)
    for step in range(STEPS):
        inputs = batch(step, 0, rank)
        loss = model(input_ids=inputs, labels=inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seen["losses"].append(loss.item())
        if prof is not None:
            prof.step(loss=loss.detach(), tokens=inputs.numel())
    if prof is not None:
        prof.close()
    seen["hooks_after"] = hooks_on(model, optimizer)
    seen["comm_hooks"] = [hook.__name__ for hook, _ in model._comm_hooks]
    torch.save(model.module.state_dict(), out_dir / f"{name}.rank{rank}.pt")
    (out_dir / f"{name}.seen-rank{rank}.json").write_text(json.dumps(seen))


def main() -> None:
    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    for name in RUNS:
        run(out_dir, name, dist.get_rank())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
