"""`gpuprof analyze RUN [--json]`: the run's summary and its ranked diagnoses."""

from __future__ import annotations

import argparse

from gpuprof.cli.run_report import add_json_flag


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "analyze",
        help="summarize a run and diagnose what slows it down or breaks its numerics",
        description="Summarize a run directory (step time after warm-up, throughput, MFU, memory, "
        "phases, health) and list its diagnoses, most severe first, each with evidence and a fix.",
    )
    parser.add_argument("run_dir", metavar="RUN", help="a run directory written by gpuprof")
    add_json_flag(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gpuprof.cli import run_report
    from gpuprof.diagnoses.context import RunContext
    from gpuprof.diagnoses.registry import diagnose_context
    from gpuprof.run.reader import load_run

    ctx = RunContext.of(load_run(args.run_dir))
    findings = diagnose_context(ctx)
    if args.json:
        run_report.print_json(
            "analyze",
            {"summary": ctx.summary.to_dict(), "findings": [finding.to_dict() for finding in findings]},
        )
        return 0
    lines = run_report.summary_lines(ctx.summary) + run_report.per_rank_lines(ctx.summary)
    lines.append(f"Findings ({len(findings)}), most severe first:" if findings else "No findings.")
    print("\n".join(lines + run_report.finding_lines(findings)))
    return 0
