"""`gpuprof trace PATH [--json]`: the verdict, the findings and the tables of any torch.profiler Chrome
trace (a file, a folder of per-rank files, or a tensorboard_trace_handler folder); only renders the
trace's report (gpuprof.report.trace_report)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PIPED_WIDTH = 140


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "trace",
        help="analyze a torch.profiler trace (.json/.json.gz file or a directory of per-rank files)",
        description="What bounds the traced steps (input, host/launch, compute, communication or memory), "
        "the findings a trace shows (data loader, launch-bound, host syncs, pageable copies, fp32 matmuls, "
        "exposed communication, FSDP collectives, idle time by cause), then the temporal, step, kernel, idle, "
        "overlap, launch, sync, tensor-core and cross-rank tables of any PyTorch profiler Chrome trace. "
        "See docs/trace-analysis.md.",
    )
    parser.add_argument("path", type=Path, help="trace file, directory with one trace file per rank, or a "
                        "tensorboard_trace_handler folder (the latest span)")
    parser.add_argument("--json", action="store_true", help="print one JSON document (schema gpuprof.trace v1)")
    parser.add_argument("--diff", type=Path, metavar="OTHER",
                        help="also compare trace OTHER (B) against PATH (A) by kernel and op, as HTA's trace_diff")
    parser.add_argument("--include-last-step", action="store_true",
                        help="keep the last profiler step (left out by default, as HTA does)")
    parser.add_argument("--top", type=_positive_int, default=10,
                        help="rows in the top kernels / CPU ops tables (default 10)")
    parser.add_argument("--jobs", type=_positive_int, default=None,
                        help="ranks analysed at once, one process each (default: one per CPU core)")
    parser.add_argument("--scheduler", metavar="ADDRESS",
                        help="analyse the ranks on this Dask distributed cluster (tcp://host:8786); "
                        "its workers must see PATH (needs gpuprof[scale])")
    parser.set_defaults(func=run)


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def run(args: argparse.Namespace) -> int:
    from gpuprof.report.trace_report import build_trace_report, diff_of, diff_to_dict

    report = build_trace_report(args.path, include_last_step=args.include_last_step, top=args.top, jobs=args.jobs,
                                scheduler=args.scheduler)
    diff = diff_of(args.path, args.diff, include_last_step=args.include_last_step) if args.diff else None
    if args.json:
        document = report.to_dict()
        if diff is not None:
            document["diff"] = diff_to_dict(args.path, args.diff, diff)
        json.dump(document, sys.stdout, sort_keys=True, indent=1, allow_nan=False)
        sys.stdout.write("\n")
    else:
        _print_report(report, diff, args.top)
    return 0


def _rich_table(view):
    from rich.table import Table

    table = Table(title=view.title, title_justify="left", title_style="bold")
    for header, numeric in zip(view.headers, view.numeric):
        table.add_column(header, justify="right" if numeric else "left")
    for row in view.rows:
        table.add_row(*row)
    return table


def _print_report(report, diff, top: int) -> None:
    from rich.console import Console
    from rich.markup import escape

    from gpuprof.cli.run_report import finding_lines, verdict_lines
    from gpuprof.report.trace_views import diff_view, overview_lines, table_views

    # Piped or redirected output gets a width that fits the tables instead of rich's 80.
    console = Console() if sys.stdout.isatty() else Console(width=PIPED_WIDTH)
    console.print(f"[bold]gpuprof trace[/bold] {escape(report.path)}")
    for line in verdict_lines(report.verdict):
        console.print(escape(line), highlight=False)
    findings = report.findings
    console.print(f"Findings ({len(findings)}), worth the most first:" if findings else "No findings.")
    for line in finding_lines(findings):
        console.print(escape(line), highlight=False)
    console.print()
    for line in overview_lines(report.tables):
        console.print("  " + escape(line), highlight=False)
    for note in report.notes:
        console.print(f"[yellow]{escape(note)}[/yellow]")
    views = table_views(report.tables) + ([diff_view(diff, top)] if diff is not None else [])
    for view in views:
        console.print()
        console.print(_rich_table(view))
