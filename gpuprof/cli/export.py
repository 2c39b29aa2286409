"""`gpuprof export RUN --to tensorboard [--out DIR]`: a recorded run in the tracker people already watch."""

from __future__ import annotations

import argparse
from pathlib import Path

# Where an export goes by default: inside the run, so that it travels with it.
EXPORTS_FOLDER = "exports"


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "export", help="write a run's per-step figures, samples, events and verdict for TensorBoard",
        description="Write a recorded run as TensorBoard event files: every step's figures (step and phase "
        "times, tokens/s, MFU, loss, grad norm, GradScaler, LR, memory), the device and host samples, the events "
        "and the verdict, one TensorBoard run per rank. Exporting again replaces the earlier export.",
    )
    parser.add_argument("run_dir", metavar="RUN", type=Path, help="a run directory written by gpuprof")
    parser.add_argument("--to", choices=("tensorboard",), default="tensorboard", help="the tracker (default: tensorboard)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"the folder to write (default: RUN/{EXPORTS_FOLDER}/tensorboard)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gpuprof.export.tensorboard import export_tensorboard

    out = export_tensorboard(args.run_dir, args.out or args.run_dir / EXPORTS_FOLDER / args.to)
    print(f"wrote {out}; open it with: tensorboard --logdir {out}")
    return 0
