"""A real tiny GPT-2 training loop for the capture tests; also a script for subprocess runs.

    python capture_loop.py RUN_DIR --steps 50 --sleep-s 0.1 [--runs N] [--nan-at STEP]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

import gpuprof

transformers.logging.set_verbosity_error()
VOCAB, SEQ, BATCH = 256, 32, 4
POISONED = "transformer.wte.weight"  # see train(nan_at=...)


def tiny_model(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=VOCAB, n_positions=64,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def batch(step: int, micro: int = 0, rank: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(10_000 * rank + 100 * step + micro)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)


def optimizer_step(model, optimizer, step: int) -> None:
    """One plain fp32 training step on step `step`'s batch."""
    inputs = batch(step)
    model(input_ids=inputs, labels=inputs).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def train(run_dir=None, *, steps=6, precision="fp32", accumulation=1, overflow_at=None, scheduler=False,
          sleep_s=0.0, ddp=False, clip="all", nan_at=None, on_start=None, **profile_options) -> dict:
    """Trains `steps` optimizer steps; profiled into `run_dir` when given, bare otherwise.

    overflow_at: a step whose loss is multiplied by 1e9 before backward, so fp16 activation
    gradients really overflow and the GradScaler skips that optimizer step.
    clip: what clip_grad_norm_ is given: "all" parameters, the "first_block"'s, or "none" (no clipping);
    "split": all parameters, clipped as Accelerate >= 1.16 does (get_total_norm, then clip_grads_with_norm_).
    nan_at: a step before whose forward the POISONED row of its first token goes NaN (NaN forensics on then).
    on_start: called with the started Profiler (e.g. to break a part of capture).
    Returns what the loop itself saw: losses, clip_grad_norm_ results, learning rates used, and the
    global gradient norms before clipping (by hand: not through the functions gpuprof watches).
    """
    rank = int(os.environ.get("RANK", 0))
    model = tiny_model()
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5) if scheduler else None
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if precision == "fp16" else None
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    seen = {"losses": [], "clip_norms": [], "lrs": [], "grad_norms": []}
    clipped = {"all": list(model.parameters()), "first_block": list(getattr(model, "module", model).transformer.h[0].parameters()),
               "none": [], "split": list(model.parameters())}[clip]
    prof = None
    profile_options.setdefault("numerics", nan_at is not None)  # NaN forensics has its own tests (tests/numerics)
    if run_dir is not None:
        prof = gpuprof.profile(run_dir, model=model, optimizer=optimizer, scaler=scaler, lr_scheduler=lr_scheduler,
                               config={"precision": precision}, **profile_options).start()
        if on_start is not None:
            on_start(prof)
    phase = prof.phase if prof is not None else (lambda name: contextlib.nullcontext())
    try:
        for step in range(steps):
            step_loss = 0.0
            for micro in range(accumulation):
                with phase("data"):
                    inputs = batch(step, micro, rank)
                if step == nan_at and micro == 0:
                    with torch.no_grad():
                        getattr(model, "module", model).get_parameter(POISONED)[inputs[0, 0]] = float("nan")
                with phase("forward"), torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16,
                                                      enabled=autocast_dtype is not None):
                    loss = model(input_ids=inputs, labels=inputs).loss / accumulation
                with phase("backward"):
                    scaled = loss * 1e9 if step == overflow_at else loss
                    (scaler.scale(scaled) if scaler else scaled).backward()
                step_loss += loss.item()
            with phase("optimizer"):
                if scaler:
                    scaler.unscale_(optimizer)
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                seen["grad_norms"].append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())
                if clip == "split":
                    total_norm = torch.nn.utils.get_total_norm(grads)
                    seen["clip_norms"].append(total_norm.item())
                    torch.nn.utils.clip_grads_with_norm_(clipped, 1.0, total_norm)
                elif clipped:
                    seen["clip_norms"].append(torch.nn.utils.clip_grad_norm_(clipped, 1.0).item())
                seen["lrs"].append(optimizer.param_groups[0]["lr"])
                if scaler:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                if lr_scheduler is not None:
                    lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            seen["losses"].append(step_loss)
            if prof is not None:
                prof.step(loss=torch.tensor(step_loss), tokens=BATCH * SEQ * accumulation)
            time.sleep(sleep_s)
    finally:
        if prof is not None:
            prof.close()
    return seen


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--sleep-s", type=float, default=0.0)
    parser.add_argument("--runs", type=int, default=1, help="profiled runs in this one process")
    parser.add_argument("--nan-at", type=int, default=None, help="the step whose POISONED row goes NaN")
    args = parser.parse_args()
    for index in range(args.runs):
        run_dir = args.run_dir if args.runs == 1 else f"{args.run_dir}-{index}"
        train(run_dir, steps=args.steps, sleep_s=args.sleep_s, nan_at=args.nan_at)


if __name__ == "__main__":
    main()
