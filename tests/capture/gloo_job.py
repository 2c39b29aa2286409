"""The distributed capture tests' torchrun job: runs of the DDP capture loop and of a plain FSDP2 loop
(fully_shard per GPT-2 block and on the root) under gpuprof.profile, one after the other.

    torchrun --nproc_per_node 2 gloo_job.py OUT_DIR RUNS_JSON
    RUNS_JSON: [{"name": "nan", "loop": "fsdp", "steps": 4, "nan_step": 3, "nan_rank": 1},
                {"name": "collector", "loop": "fsdp", "steps": 5, "fail_step": 2, "fail_rank": 1,
                 "fail_in": "collector"}, ...,
                {"name": "ddp", "loop": "ddp", "steps": 4, "trace_steps": [1, 3]}]

One job, one process group, each run a fresh model and a fresh gpuprof.profile in OUT_DIR/NAME
(a job of its own costs two processes importing torch and transformers).

ddp: capture_loop.train under DistributedDataParallel, with the trace window [start, stop).
fsdp: at nan_step, rank nan_rank writes a NaN into its own shard of NAN_PARAM's gradient (right
after the reduce-scatter, through the hook FSDP2 calls on sharded parameters). At fail_step,
gpuprof's own code fails on rank fail_rank (fail_in: the gradient collector's norms, the Profiler
before or after the step's all-reduce, or the gradient collector after it); the function made to
fail is put back when its run ends.

What the loop itself saw (losses, clip_grad_norm_ and, for fsdp, per-block norms) goes to
OUT_DIR/NAME.seen-rankN.json.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
from pathlib import Path

import torch
from torch.distributed.fsdp import fully_shard

import gpuprof
import capture_loop
from capture_loop import batch, tiny_model

NAN_PARAM = "transformer.h.1.mlp.c_fc.weight"
# fail_in: where gpuprof's own code raises; (module, name) of the function made to raise
FAILURES = {
    "collector": ("gpuprof.capture.gradients", "tensor_norms"),  # inside the collector's own hook
    "profiler-before": ("gpuprof.capture.profiler", "_timing"),  # the Profiler, before the all-reduce
    "profiler-after": ("gpuprof.capture.profiler", "all_finite"),  # the Profiler, after it
    "collector-after": ("gpuprof.capture.gradients", "all_finite"),  # the collector switched off after it
}


@contextlib.contextmanager
def failing_at(step_now: dict, step: int, where: str):
    module, name = FAILURES[where]
    module = importlib.import_module(module)
    original = getattr(module, name)

    def failing(*args, **kwargs):
        if step_now["step"] == step:
            raise RuntimeError(f"injected failure in {name}")
        return original(*args, **kwargs)

    setattr(module, name, failing)
    try:
        yield
    finally:
        setattr(module, name, original)


def sharded_model():
    model = tiny_model()
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    return model


def fsdp(run_dir: str, rank: int, *, steps: int, nan_step=None, nan_rank=None, fail_step=None,
               fail_rank=None, fail_in="collector") -> dict:
    model = sharded_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step_now = {"step": 0}
    if rank == nan_rank:
        param = dict(model.named_parameters())[NAN_PARAM]
        param.register_post_accumulate_grad_hook(
            lambda p: p.grad.to_local().view(-1)[0].fill_(float("nan")) if step_now["step"] == nan_step else None)
    fault = failing_at(step_now, fail_step, fail_in) if rank == fail_rank else contextlib.nullcontext()
    seen = {"losses": [], "clip_norms": [], "block_norms": []}
    with fault, gpuprof.profile(run_dir, model=model, optimizer=optimizer, layer_interval=1) as prof:
        for step in range(steps):
            step_now["step"] = step
            inputs = batch(step, 0, rank)
            with prof.phase("forward"):
                loss = model(input_ids=inputs, labels=inputs).loss
            with prof.phase("backward"):
                loss.backward()
            with prof.phase("optimizer"):
                # a huge max_norm: the norms without clipping, the same functions a user calls
                seen["block_norms"].append({f"transformer.h.{i}": float(torch.nn.utils.clip_grad_norm_(
                    block.parameters(), 1e9).full_tensor()) for i, block in enumerate(model.transformer.h)})
                seen["clip_norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor()))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            seen["losses"].append(float(loss))
            prof.step(loss=loss.detach(), tokens=inputs.numel())
    return seen


def ddp(run_dir: str, rank: int, *, steps: int, trace_steps: list[int]) -> dict:
    return capture_loop.train(run_dir, steps=steps, ddp=True, trace_steps=range(*trace_steps))


LOOPS = {"ddp": ddp, "fsdp": fsdp}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("runs", type=json.loads, help="a JSON list of runs: name, loop and its options")
    args = parser.parse_args()
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    for run in args.runs:
        options = {key: value for key, value in run.items() if key not in ("name", "loop")}
        run_dir = f"{args.out_dir}/{run['name']}"
        seen = LOOPS[run["loop"]](run_dir, rank, **options)
        Path(f"{run_dir}.seen-rank{rank}.json").write_text(json.dumps(seen))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
