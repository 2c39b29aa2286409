"""`gpuprof tune SCRIPT [ARGS...]`: measure each recommended fix in a trial of its own (gpuprof.tune)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from gpuprof.cli.run import default_run_dir
from gpuprof.cli.run_report import add_json_flag, print_json


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "tune", help="try each recommended fix in a measured trial and report the measured gain beside the estimate",
        description="Run SCRIPT unchanged under `gpuprof run` for N steps (a baseline), diagnose it, then give "
        "each finding whose fix can be applied from outside the script a trial of its own (a child process, "
        "that knob alone), and one trial combining the knobs that helped. Each trial reports its speedup "
        "with a 95% interval, the finding's estimate, numerics parity and the verdict; the report ends with "
        "the diff to apply for the winning set. Nothing is written into the script.",
    )
    parser.add_argument("--steps", type=int, default=None, metavar="N",
                        help="measured steps per trial (default: enough for a ±5%% interval on the baseline's "
                        "mean step time, from a pilot of 20)")
    parser.add_argument("--only", action="append", default=None, metavar="KNOB[,KNOB...]",
                        help="try these knobs only, recommended or not (repeatable; names in docs/tune.md)")
    add_json_flag(parser)
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="where the trials' runs go (default: runs/tune-<script name>-<timestamp>)")
    parser.add_argument("--html", type=Path, default=None, metavar="FILE",
                        help="also write the result as one static HTML page")
    parser.add_argument("--budget-s", type=float, default=None, metavar="S",
                        help="stop a trial after S seconds (default: 4x the baseline's wall time, at least 120)")
    parser.add_argument("--train", nargs=argparse.REMAINDER, default=None, metavar="TRAIN_FLAGS",
                        help="tune the GPT-2 reference workload instead: the rest are `gpuprof train` flags; "
                        "knobs are its own flags, and its optimized variant gets a trial too")
    parser.add_argument("script", nargs="?", help="the training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="passed to the script")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gpuprof.run.jsonable import json_safe
    from gpuprof.errors import GpuprofError
    from gpuprof.tune.trials import ScriptTarget, WorkloadTarget
    from gpuprof.tune.tuning import tune

    if args.train is not None:
        target = WorkloadTarget(tuple(args.train))
        name = "train"
    elif args.script:
        if not Path(args.script).is_file():
            raise GpuprofError(f"no such script: {args.script}")
        target = ScriptTarget(str(Path(args.script).resolve()), tuple(args.script_args))
        name = Path(args.script).stem
    else:
        raise GpuprofError("give a SCRIPT to tune, or --train with gpuprof train's flags")
    if args.steps is not None and args.steps < 3:
        raise GpuprofError(f"--steps must be at least 3 (an interval needs them), got {args.steps}")
    only = [name for part in args.only for name in part.split(",") if name] if args.only else None
    out = args.out or default_run_dir(f"tune-{name}")  # under torchrun: the same folder on every rank
    talks = os.environ.get("RANK", "0") == "0"
    result = tune(target, out, steps=args.steps, only=only, budget_s=args.budget_s,
                  progress=lambda line: talks and print(f"gpuprof tune: {line}", file=sys.stderr, flush=True))
    if not talks:
        return 0
    plain = json_safe(result.to_dict())
    if args.html is not None:
        from gpuprof.cli.pages import tune_page

        args.html.write_text(tune_page(plain), encoding="utf-8")
    if args.json:
        print_json("tune", plain)
    else:
        render(plain)
    return 0


def render(result: dict) -> None:
    """`result`: the tune result's plain form (TuneResult.to_dict())."""
    from rich.console import Console
    from rich.table import Table

    from gpuprof.cli.trace import PIPED_WIDTH
    from gpuprof.report.tuning import TRIAL_HEADERS, diff_title, text_lines, trial_rows

    console = Console(highlight=False) if sys.stdout.isatty() else Console(width=PIPED_WIDTH, highlight=False)
    lines = text_lines(result)
    console.print(f"gpuprof tune {result['target']}", markup=False)
    for line in lines["above"]:
        console.print(line, markup=False)
    table = Table(title="trials (speedup over the baseline, above 1 is faster)")
    for header in TRIAL_HEADERS:
        table.add_column(header)
    for row in trial_rows(result):
        table.add_row(*row)
    console.print(table)
    for line in lines["below"]:
        console.print(line, markup=False)
    if result["diff"]:
        console.print(diff_title(result))
        console.print(result["diff"], markup=False)
    for line in lines["after_diff"]:
        console.print(line, markup=False)
