"""`gpuprof demo`: the README's main job. Record the GPT-2 reference workload (baseline and
optimized) on the best device present, print what gpuprof found, and open the dashboard.

Each step is another subcommand, so the demo shows exactly what a user would type.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from pathlib import Path

from gpuprof.errors import GpuprofError

VARIANTS = ("baseline", "optimized")
# (model size, steps, trace window) per device: sized so a 2-core CPU finishes in a few minutes.
PLANS = {"cuda": ("gpt2", 60, "20:23"), "cpu": ("tiny", 30, "10:12")}


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="record GPT-2 baseline and optimized, print the diagnoses, open the dashboard",
        description="Train the GPT-2 reference workload twice (baseline, optimized) on the best device "
        "present (GPT-2 124M on CUDA, the tiny model on CPU), record both runs with a trace window, "
        "print `gpuprof analyze` and `gpuprof compare`, then open the dashboard on them.",
    )
    parser.add_argument("--runs-dir", type=Path, default=Path("runs"), help="where the runs go (default: ./runs)")
    parser.add_argument("--model", default=None, help="model size (default: gpt2 on CUDA, tiny on CPU)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default: 60 on CUDA, 30 on CPU)")
    parser.add_argument("--no-dashboard", action="store_true", help="stop after printing the diagnoses")
    parser.add_argument("--port", type=int, default=0, help="dashboard port (default: a free one)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from gpuprof.cli import main

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, steps, trace_steps = PLANS[device]
    model, steps = args.model or model, args.steps or steps
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dirs = [args.runs_dir / f"{stamp}-{model}-{variant}" for variant in VARIANTS]
    for variant, run_dir in zip(VARIANTS, run_dirs):
        train = ["train", "--model", model, "--variant", variant, "--steps", str(steps),
                 "--device", device, "--trace-steps", trace_steps, "--run-dir", str(run_dir)]
        _gpuprof_subprocess(train)
    for run_dir in run_dirs:
        _announce(["analyze", str(run_dir)])
        main(["analyze", str(run_dir)])
    _announce(["compare", *map(str, run_dirs)])
    main(["compare", *map(str, run_dirs)])
    if args.no_dashboard:
        return 0
    dashboard = ["dashboard", str(args.runs_dir)] + (["--port", str(args.port)] if args.port else [])
    _announce(dashboard)
    return main(dashboard)


def _gpuprof_subprocess(argv: list[str]) -> None:
    """Each training run gets its own process, so its peak memory is its own."""
    _announce(argv)
    returncode = subprocess.call([sys.executable, "-m", "gpuprof", *argv])
    if returncode:
        raise GpuprofError(f"`gpuprof {shlex.join(argv)}` exited with code {returncode}")


def _announce(argv: list[str]) -> None:
    print(f"\n$ gpuprof {shlex.join(argv)}", flush=True)
