"""`gpuprof report RUN -o report.html`: the run's report (verdict first) and its charts as one static
HTML file, for sharing without a server."""

from __future__ import annotations

import argparse
from pathlib import Path

from gpuprof.errors import GpuprofError


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "report", help="write a run's dashboard page as one static HTML file",
        description="Write the diagnoses and charts of one run to a self-contained HTML file "
        "(plotly.js embedded: it opens offline).",
    )
    parser.add_argument("run_dir", type=Path, help="the run directory")
    parser.add_argument("-o", "--output", type=Path, default=Path("report.html"), help="HTML file to write")
    parser.add_argument("--rank", type=int, default=0, help="rank whose timelines to show (default 0)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gpuprof.cli.pages import run_page
    from gpuprof.report import build_report

    report = build_report(args.run_dir)
    if args.rank not in (report.run.ranks or [0]):
        raise GpuprofError(f"--rank {args.rank}: this run has ranks {report.run.ranks}")
    try:
        args.output.write_text(run_page(report, args.rank), encoding="utf-8")
    except OSError as error:
        raise GpuprofError(f"cannot write {args.output}: {error.strerror}") from None
    print(f"wrote {args.output} ({args.output.stat().st_size / 1e6:.1f} MB)")
    return 0
