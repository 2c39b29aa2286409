"""`gpuprof run SCRIPT [ARGS...]`: record an unmodified training script (gpuprof.integrations.script)."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

SAMPLE_INTERVAL_HELP = ("sample the device and the host every S seconds (0: not at all; default: every 0.1 s where a "
                        "GPU is sampled, else every 1 s)")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "run", help="run a training script unchanged and record it (also: torchrun ... -m gpuprof run SCRIPT)",
        description="Run SCRIPT as `python SCRIPT ARGS...` would, and record it: gpuprof finds the model and the "
        "optimizer through torch's global hooks and records one step per optimizer step, or attaches its "
        "callback to a Hugging Face or Lightning Trainer. Exits with the script's own exit code.",
    )
    parser.add_argument("--run-dir", default=None,
                        help="record the run here (default: runs/<script name>-<timestamp>; under torchrun the "
                        "timestamp is the launcher's, so every rank of a node writes the same run)")
    parser.add_argument("--knob", action="append", default=[], metavar="NAME",
                        help="apply a rule's fix from outside the script (repeatable; the names: docs/tune.md); "
                        "what it changed is in the run's meta.json, config.knobs")
    parser.add_argument("--max-steps", type=int, default=None, metavar="N",
                        help="stop the script, as finished, once N steps are recorded")
    parser.add_argument("--sample-interval", type=seconds, default=None, metavar="S", help=SAMPLE_INTERVAL_HELP)
    parser.add_argument("--hang-timeout-s", type=seconds, default=None, metavar="S",
                        help="write a `hang` event when a rank's step has not advanced for S seconds (0: no hang "
                        "watchdog; default: max(120 s, 20 x the median step))")
    parser.add_argument("--live-export", default=None, metavar="DIR",
                        help="stream each step's figures to DIR for TensorBoard as the script trains "
                        "(`tensorboard --logdir DIR`; needs the tensorboard package)")
    parser.add_argument("script", help="the training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="passed to the script")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gpuprof.integrations.script import run_script
    from gpuprof.run.schema import RUN_META

    given = {"sample_interval_s": args.sample_interval, "hang_timeout_s": args.hang_timeout_s,
             "live_export": args.live_export}
    options = {name: value for name, value in given.items() if value is not None}
    run_dir = args.run_dir or default_run_dir(args.script)
    code = run_script(args.script, args.script_args, run_dir, knobs=args.knob, max_steps=args.max_steps, **options)
    # not after a failure: the script's traceback stays the last thing printed, as Python leaves it
    if code == 0 and os.environ.get("RANK", "0") == "0" and (Path(run_dir) / RUN_META).is_file():
        print(f"gpuprof run: recorded in {run_dir}; next: gpuprof analyze {run_dir}", file=sys.stderr)
    return code


def seconds(text: str) -> float:
    """A duration given on the command line: a finite number of seconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, 0 or more, got {text!r}")
    return value


def default_run_dir(script: str) -> str:
    return f"runs/{Path(script).stem}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(_start_time_s()))}"


def _start_time_s() -> float:
    """Now; under torchrun, when its launcher started (the parent of every rank on this node)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        import psutil

        return psutil.Process(os.getppid()).create_time()
    return time.time()
