"""Always-on capture overhead: the same training loop bare and under gpuprof.profile, interleaved.

Each repetition runs `--steps` timed steps bare and `--steps` with capture (which goes first
alternates), on the same model and optimizer in one process, after one untimed warm-up step
per block. The overhead is the median over repetitions of (capture / bare - 1), per step,
and the ratio of the fastest blocks (steadier on a busy machine);
opening and closing the run (thread start, Parquet compaction) is outside the timed steps.

    .venv/bin/python benchmarks/overhead.py --model tiny --reps 7 --steps 20
    .venv/bin/python benchmarks/overhead.py --model tiny --threads 1 --clock cpu   # on a busy shared machine
    .venv/bin/python benchmarks/overhead.py --model 124m --reps 4 --steps 3 --batch 1 --seq 256
    .venv/bin/python benchmarks/overhead.py --model 124m --device cuda --dtype bf16 --batch 16 --seq 1024
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

import gpuprof

MODELS = {
    "tiny": dict(n_layer=2, n_embd=128, n_head=4, vocab_size=256, n_positions=1024),
    "124m": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024),
}


class Bare:
    """The loop's view of a profiler, doing nothing."""

    def phase(self, name):
        return contextlib.nullcontext()

    def step(self, **kwargs):
        pass


def train_steps(prof, model, optimizer, tokens, steps: int, dtype, device) -> None:
    for _ in range(steps):
        with prof.phase("data"):
            batch = tokens.to(device, non_blocking=True)
        with prof.phase("forward"), torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = model(input_ids=batch, labels=batch).loss
        with prof.phase("backward"):
            loss.backward()
        with prof.phase("optimizer"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        prof.step(loss=loss, tokens=batch.numel())


def interleaved_blocks(reps: int, block, open_run):
    """Per repetition, one bare and one captured block, which goes first alternating:
    yields (rep, bare seconds, capture seconds). `block(prof)` times one block;
    `open_run(rep)` opens the capture run of repetition `rep`."""
    for rep in range(reps):
        times = {}
        for mode in (("bare", "capture") if rep % 2 == 0 else ("capture", "bare")):
            if mode == "bare":
                times[mode] = block(Bare())
            else:
                with open_run(rep) as prof:
                    times[mode] = block(prof)
        yield rep, times["bare"], times["capture"]


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def timed_block(prof, args, model, optimizer, tokens, device, dtype) -> float:
    """Seconds per step over `args.steps` steps, after one warm-up step."""
    clock = CLOCKS[args.clock]
    train_steps(prof, model, optimizer, tokens, 1, dtype, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = clock()
    train_steps(prof, model, optimizer, tokens, args.steps, dtype, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (clock() - start) / args.steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per block")
    parser.add_argument("--reps", type=int, default=7, help="bare/capture block pairs")
    parser.add_argument("--no-numerics", action="store_true", help="capture without the NaN-forensics collector")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--clock", choices=CLOCKS, default="wall",
                        help="cpu: process CPU time, steadier than wall time on a shared machine (use with --threads 1)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    device, dtype = torch.device(args.device), {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = GPT2LMHeadModel(GPT2Config(**MODELS[args.model], bos_token_id=0, eos_token_id=0)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, model.config.vocab_size, (args.batch, args.seq))
    if device.type == "cuda":
        tokens = tokens.pin_memory()
    options = {"numerics": False} if args.no_numerics else {}

    ratios, bare_s, capture_s = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        blocks = interleaved_blocks(
            args.reps, lambda prof: timed_block(prof, args, model, optimizer, tokens, device, dtype),
            lambda rep: gpuprof.profile(Path(tmp) / f"run-{rep}", model=model, optimizer=optimizer, **options))
        for rep, bare, capture in blocks:
            bare_s.append(bare)
            capture_s.append(capture)
            ratios.append(capture / bare)
            print(f"rep {rep}: bare {bare * 1e3:.2f} ms/step, capture {capture * 1e3:.2f} ms/step, "
                  f"ratio {ratios[-1]:.4f}", flush=True)
    median_pct = (statistics.median(ratios) - 1) * 100
    best_pct = (min(capture_s) / min(bare_s) - 1) * 100  # fastest block of each: least disturbed by neighbours
    print(f"{args.model} on {device.type} ({args.dtype}, batch {args.batch}x{args.seq}, "
          f"{torch.get_num_threads()} threads, {args.clock} clock{', numerics off' if args.no_numerics else ''}): "
          f"bare {statistics.median(bare_s) * 1e3:.2f} ms/step, capture {statistics.median(capture_s) * 1e3:.2f} ms/step; "
          f"overhead {median_pct:+.2f}% (median of {args.reps} interleaved pairs of {args.steps} steps), "
          f"{best_pct:+.2f}% (fastest block of each)")


if __name__ == "__main__":
    main()
