"""`gpuprof compare RUN_A RUN_B [--json]`: two runs side by side, and how their diagnoses changed."""

from __future__ import annotations

import argparse

from gpuprof.cli.run_report import add_json_flag
from gpuprof.report.format import MISSING, figure, fmt_ratio


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "compare",
        help="compare two runs (e.g. baseline vs optimized)",
        description="Headline figures of two runs side by side with the B/A ratio, and the "
        "diagnoses that appeared in B or disappeared from A.",
    )
    parser.add_argument("run_a", metavar="RUN_A", help="the reference run (e.g. baseline)")
    parser.add_argument("run_b", metavar="RUN_B", help="the run compared with it (e.g. optimized)")
    add_json_flag(parser)
    parser.set_defaults(func=run)


def metric_lines(comparison) -> list[str]:
    unit_of = {"_per_s": "/s", "_s": "s", "_bytes": "bytes", "_pct": "%"}
    lines = [f"  {'metric':26} {'A':>14} {'B':>14} {'B/A':>8}  better"]
    for row in comparison.metrics.to_dict(orient="records"):
        unit = next((unit for suffix, unit in unit_of.items() if row["metric"].endswith(suffix)), "")
        lines.append(
            f"  {row['metric']:26} {figure(row['a'], unit):>14} {figure(row['b'], unit):>14}"
            f" {fmt_ratio(row['ratio_b_over_a']):>8}  {row['better'] or MISSING}"
        )
    return lines


def run(args: argparse.Namespace) -> int:
    from gpuprof.cli import run_report
    from gpuprof.report import build_report, compare

    comparison = compare(build_report(args.run_a), build_report(args.run_b))
    for report in (comparison.a, comparison.b):
        run_report.print_notes(report)
    if args.json:
        run_report.print_json("compare", comparison.to_dict())
        return 0
    lines = []
    for label, report in (("A", comparison.a), ("B", comparison.b)):
        lines += [f"{label}: {report.summary.name} ({report.summary.path})", f"   {report.verdict.headline}"]
    lines += metric_lines(comparison)
    lines.append(f"Findings that appeared in B ({len(comparison.appeared)}):")
    lines += run_report.finding_lines(comparison.appeared, marker="+")
    lines.append(f"Findings that disappeared from A ({len(comparison.disappeared)}):")
    lines += run_report.finding_lines(comparison.disappeared, marker="-")
    lines.append(f"In both: {', '.join(comparison.persisted) or 'none'}")
    print("\n".join(lines))
    return 0
