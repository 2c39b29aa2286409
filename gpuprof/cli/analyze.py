"""`gpuprof analyze RUN [--json]`: the run's verdict, its summary and its ranked diagnoses."""

from __future__ import annotations

import argparse

from gpuprof.cli.run_report import add_json_flag


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "analyze",
        help="summarize a run and diagnose what slows it down or breaks its numerics",
        description="Say what bounds a run's step (input, host/launch, compute, communication, memory or "
        "numerics) and why, summarize it (step time after warm-up, throughput, MFU, memory, phases, "
        "health) and list its diagnoses, worth the most first, each with evidence and a fix.",
    )
    parser.add_argument("run_dir", metavar="RUN", help="a run directory written by gpuprof")
    add_json_flag(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gpuprof.cli import run_report
    from gpuprof.report import build_report

    report = build_report(args.run_dir)
    run_report.print_notes(report)
    if args.json:
        run_report.print_json("analyze", report.to_dict())
        return 0
    summary, findings = report.summary, report.findings
    lines = [*run_report.verdict_lines(report.verdict), *run_report.stopped_lines(report), *run_report.summary_lines(summary),
             *run_report.hotspot_lines(report), *run_report.per_rank_lines(report)]
    lines.append(f"Findings ({len(findings)}), worth the most first:" if findings else "No findings.")
    print("\n".join(lines + run_report.finding_lines(findings)))
    return 0
