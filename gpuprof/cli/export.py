"""`gpuprof export RUN --to tensorboard|otlp`: a recorded run in the tracker people already watch."""

from __future__ import annotations

import argparse
from pathlib import Path

from gpuprof.errors import GpuprofError

# Where an export goes by default: inside the run, so that it travels with it.
EXPORTS_FOLDER = "exports"


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "export", help="write a run's per-step figures, events and verdict for TensorBoard or an OTLP backend",
        description="tensorboard: every step's figures (step and phase times, tokens/s, MFU, loss, grad norm, "
        "GradScaler, LR, memory), the device and host samples, the events and the verdict as event files, one "
        "TensorBoard run per rank; exporting again replaces the earlier export. otlp: the same steps as "
        "OpenTelemetry spans (one per step, under one per rank, the events as span events, the verdict on the "
        "rank's span), sent to an OTLP/HTTP endpoint; the same run sends the same ids again.",
    )
    parser.add_argument("run_dir", metavar="RUN", type=Path, help="a run directory written by gpuprof")
    parser.add_argument("--to", choices=("tensorboard", "otlp"), default="tensorboard",
                        help="the tracker (default: tensorboard)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"tensorboard: the folder to write (default: RUN/{EXPORTS_FOLDER}/tensorboard)")
    parser.add_argument("--endpoint", default=None,
                        help="otlp: where to send the spans, e.g. http://localhost:4318/v1/traces (default: "
                        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT, else localhost)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.to == "otlp":
        if args.out is not None:
            raise GpuprofError("--out is where a tensorboard export goes; an otlp export goes to --endpoint")
        from gpuprof.export.otlp import export_otlp

        sent = export_otlp(args.run_dir, args.endpoint)
        print(f"sent {sent} spans to {args.endpoint or 'the OTLP endpoint of the environment'}")
        return 0
    if args.endpoint is not None:
        raise GpuprofError("--endpoint is where an otlp export goes; a tensorboard export goes to --out")
    from gpuprof.export.tensorboard import export_tensorboard

    out = export_tensorboard(args.run_dir, args.out or args.run_dir / EXPORTS_FOLDER / args.to)
    print(f"wrote {out}; open it with: tensorboard --logdir {out}")
    return 0
