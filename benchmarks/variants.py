"""Baseline vs optimized GPT-2 training on this machine's best device (not a timed test).

    python benchmarks/variants.py                          # 124M model, 4 x 256 tokens, 3 repetitions
    python benchmarks/variants.py --model tiny --repeats 2 --steps 10 --arms baseline optimized
    python benchmarks/variants.py --batch-size 8 --seq-len 1024 --steps 20   # on a GPU
    python benchmarks/variants.py --parallel 2 --model tiny --steps 10       # DDP vs FSDP2 over 2 processes

What it measures: the training loop of `gpuprof train` without recording (no gpuprof
capture), each run in a fresh process so peak memory is that run's own. Three arms:
`baseline`, `optimized`, and `bf16` (baseline with bf16 autocast as its only change). Arms
run interleaved, in rotated order each repetition, so drift in machine load hits all alike. Step time is the mean over the steps after the first (warm-up), tokens/s
counts the tokens of one optimizer step, CPU time per step is the training process's CPU
time over all steps (steadier than wall time when other work shares the machine), and the
figures are medians over repetitions.
All arms train on the same tokens per step (optimized splits them into micro-batches).

With `--parallel N` the arms are `ddp` and `fsdp` (FSDP2, `gpuprof train --parallel fsdp`) of
one variant (`--variant`, default optimized), each under torchrun with N processes (gloo on CPU,
NCCL on GPUs); peak memory is the largest of the ranks' peaks, and tokens/s counts all ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

_RESULT_PREFIX = "BENCH_RESULT "
# arm -> TrainConfig knobs; "bf16" isolates what autocast alone gives.
ARMS = {"baseline": {"variant": "baseline"}, "optimized": {"variant": "optimized"},
        "bf16": {"variant": "baseline", "precision": "bf16"}}
PARALLEL_ARMS = {"ddp": {"parallel": "ddp"}, "fsdp": {"parallel": "fsdp"}}


def main() -> int:
    args = parse_args()
    if args.worker:
        return run_one(args)
    runs = {arm: [] for arm in args.arms}
    for repeat in range(args.repeats):
        shift = repeat % len(args.arms)
        for arm in args.arms[shift:] + args.arms[:shift]:
            result = run_in_subprocess(arm, args)
            runs[arm].append(result)
            print(f"  repeat {repeat + 1}/{args.repeats} {arm:9s} "
                  f"step {result['step_time_s']:.3f} s (CPU {result['cpu_time_per_step_s']:.3f} s), "
                  f"{result['tokens_per_s']:,.0f} tokens/s, "
                  f"peak {result['peak_memory_bytes'] / 2**20:,.0f} MiB", flush=True)
    report(runs, args)
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2", help="model size (default: gpt2, 124M)")
    parser.add_argument("--steps", type=int, default=5, help="steps per run; the first is warm-up")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per optimizer step")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each variant")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--threads", type=int, default=0,
                        help="CPU threads per run (default: torch's choice); 1 keeps figures steady "
                        "on a machine other work shares, and CPU time free of idle-thread spinning")
    parser.add_argument("--arms", nargs="+", choices=tuple(ARMS), default=None,
                        help="what to compare (default: all); needs baseline and optimized")
    parser.add_argument("--parallel", type=int, default=0, metavar="N",
                        help="compare ddp and fsdp, each under torchrun with N processes")
    parser.add_argument("--variant", default="optimized", choices=("baseline", "optimized"),
                        help="with --parallel: the variant both arms train (default: optimized)")
    parser.add_argument("--worker", choices=tuple(ARMS) + tuple(PARALLEL_ARMS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.parallel:
        if args.parallel < 2 or args.arms:
            parser.error("--parallel needs N >= 2 and compares ddp with fsdp (no --arms)")
        args.arms, args.reference = list(PARALLEL_ARMS), "ddp"
    else:
        args.arms, args.reference = args.arms or list(ARMS), "baseline"
        if not {"baseline", "optimized"} <= set(args.arms):
            parser.error("--arms needs baseline and optimized")
    return args


def run_in_subprocess(arm: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--worker", arm, "--model", args.model,
               "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--variant", args.variant,
               "--seq-len", str(args.seq_len), "--device", args.device, "--threads", str(args.threads)]
    if args.parallel:
        command[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.parallel}"]
        command += ["--parallel", str(args.parallel)]
    done = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(_RESULT_PREFIX)]
    if done.returncode or not lines:
        sys.exit(f"{arm} run failed:\n{done.stderr[-2000:]}")
    return json.loads(lines[-1][len(_RESULT_PREFIX):])


def run_one(args: argparse.Namespace) -> int:
    """One arm, one process: print its figures as a JSON line."""
    import time

    import torch

    from gpuprof.workloads.gpt2 import TrainConfig, distributed, prepare, run

    if args.threads:
        torch.set_num_threads(args.threads)
    knobs = {"variant": args.variant, **PARALLEL_ARMS[args.worker]} if args.parallel else ARMS[args.worker]
    config = TrainConfig(model_size=args.model, steps=args.steps, batch_size=args.batch_size,
                         seq_len=args.seq_len, device=args.device, log_every=args.steps, **knobs)
    session = prepare(config)
    cpu_started = time.process_time()
    result = run(session)
    peaks = distributed.all_gather(session.placement, result.peak_memory_bytes)
    distributed.teardown(session.placement)
    if not session.placement.is_main:
        return 0
    figures = {
        "step_time_s": result.mean_step_time_s,
        "cpu_time_per_step_s": (time.process_time() - cpu_started) / args.steps,
        "tokens_per_s": result.tokens_per_s,
        "peak_memory_bytes": max(peaks),
        "peak_memory_bytes_by_rank": peaks,
        "peak_memory_kind": result.peak_memory_kind,
        "device_type": session.placement.device.type,
        "config": {key: value for key, value in config.as_dict().items() if value is not None},
        "num_threads": torch.get_num_threads(),
    }
    print(_RESULT_PREFIX + json.dumps(figures), flush=True)
    return 0


def report(runs: dict, args: argparse.Namespace) -> None:
    median = {arm: {key: statistics.median(r[key] for r in results)
                    for key in ("step_time_s", "cpu_time_per_step_s", "peak_memory_bytes")}
              for arm, results in runs.items()}
    ranks = max(1, args.parallel)
    for figures in median.values():
        figures["tokens_per_s"] = ranks * args.batch_size * args.seq_len / figures["step_time_s"]
    first = runs[args.arms[-1]][0]
    setting = f"{args.variant}, {ranks} processes, per rank: " if args.parallel else ""
    print(f"\n{args.model}, {setting}batch {args.batch_size} x {args.seq_len} tokens per step, "
          f"{args.steps} steps (first excluded), median of {args.repeats}, device {first['device_type']} "
          f"({first['num_threads']} threads); peak memory = {first['peak_memory_kind']}"
          f"{' (largest rank)' if args.parallel else ''}")
    print(f"{'arm':10s} {'step time':>11s} {'CPU time/step':>14s} {'tokens/s':>10s} {'peak memory':>12s}")
    for arm, figures in median.items():
        print(f"{arm:10s} {figures['step_time_s']:9.3f} s {figures['cpu_time_per_step_s']:12.3f} s "
              f"{figures['tokens_per_s']:10,.0f} {figures['peak_memory_bytes'] / 2**20:8,.0f} MiB")
    base = median[args.reference]
    for arm, figures in median.items():
        if arm != args.reference:
            print(f"{arm} vs {args.reference}: {base['step_time_s'] / figures['step_time_s']:.2f}x the throughput "
                  f"(by CPU time per step: {base['cpu_time_per_step_s'] / figures['cpu_time_per_step_s']:.2f}x), "
                  f"{figures['peak_memory_bytes'] / base['peak_memory_bytes']:.2f}x the peak memory")
    if not args.parallel and median["optimized"]["step_time_s"] >= base["step_time_s"]:
        print("optimized is not faster here, because:")
        for reason in slowdown_reasons(first):
            print(f"  - {reason}")


def slowdown_reasons(optimized: dict) -> list[str]:
    """Why the optimized knobs may not pay off on this device and size."""
    config, reasons = optimized["config"], []
    if optimized["device_type"] == "cpu":
        reasons.append("TF32 and pinned memory act only on CUDA; sdpa has no flash kernel on CPU")
        if not _cpu_has_bf16():
            reasons.append("this CPU has no native bf16 (no AVX512-BF16/AMX): autocast emulates it")
        cores = os.cpu_count() or 1
        if config["num_workers"] >= cores:
            reasons.append(f"{config['num_workers']} DataLoader workers compete with compute for {cores} cores")
    if config["precision"] == "fp16" or (config["precision"] == "auto" and optimized["device_type"] == "cpu"
                                         and not _cpu_has_bf16()):
        reasons.append("fp16 autocast is slow on CPU")
    if config["grad_accum"] > 1:
        micro = config["batch_size"] // config["grad_accum"]
        reasons.append(f"gradient accumulation runs micro-batches of {micro}: smaller matmuls, same work")
    if config["activation_checkpointing"]:
        reasons.append("activation checkpointing recomputes the forward pass (memory for time)")
    reasons.append("the timings are noisy when other processes share the machine; rerun with --repeats 5")
    return reasons


def _cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = cpuinfo.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


if __name__ == "__main__":
    sys.exit(main())
