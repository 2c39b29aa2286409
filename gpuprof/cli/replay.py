"""`gpuprof replay BUNDLE`: re-run a NaN/Inf step from its replay bundle and print the blame."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "replay", help="re-run a non-finite step from its replay bundle (RUN/numerics/*.pt) and print the blame",
        description="Load a replay bundle safely (tensors and plain values only), re-run the step in forensic "
        "mode on this machine and print where the first Inf/NaN appeared. Exit 0 when the blame matches the "
        "one recorded in training, 1 when it differs, 2 for a bad bundle.",
    )
    parser.add_argument("bundle", type=Path, help="a replay bundle, e.g. RUN/numerics/step-12-rank-0.pt")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where to re-run (default: the bundle's device type when available, else cpu)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gpuprof.numerics.blame import format_blame
    from gpuprof.numerics.replay import replay, same_blame
    from gpuprof.workloads.gpt2.faults import replay_model

    blame, recorded = replay(args.bundle, device=None if args.device == "auto" else args.device,
                             builders={"gpt2": replay_model})  # the reference workload's own bundles
    print(format_blame(blame))
    if same_blame(blame, recorded):
        print("same blame as recorded during training")
        return 0
    print(f"differs from the blame recorded during training: {recorded.message()}")
    return 1
