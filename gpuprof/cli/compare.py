"""`gpuprof compare RUN_A RUN_B [--gate] [--json] [--markdown FILE] [--html FILE]`: run B against
run A (or a folder of baseline runs) with the noise measured, the comparability contract
checked, and for CI an exit code that says whether B regressed (docs/compare.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

from gpuprof.cli.run_report import add_json_flag
from gpuprof.errors import GpuprofError
from gpuprof.report.gate import DEFAULT_MAX_REGRESSION_PCT, POOLINGS

# version 2: `figures` with intervals replaced version 1's `metrics` (docs/json-output.md)
JSON_SCHEMA_VERSION = 2
HISTOGRAM_BINS = 24
BARS = " ▁▂▃▄▅▆▇█"


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "compare",
        help="compare two runs, with the noise measured; --gate for CI",
        description="Run B against run A: one conclusion line, every figure with its confidence interval "
        "(a block bootstrap over the measured steps), the comparability contract gpuprof checks from what the "
        "runs recorded, numerics parity, step-time distributions and the diagnoses that changed. With --gate the "
        "exit code says: 0 B is not slower beyond the threshold, 3 regression, 4 not comparable, 5 too noisy "
        "to tell, 2 bad input.",
    )
    parser.add_argument("run_a", metavar="RUN_A", type=Path,
                        help="the reference run, or a folder of several baseline runs")
    parser.add_argument("run_b", metavar="RUN_B", type=Path, help="the run compared with it")
    parser.add_argument("--gate", action="store_true", help="exit 0/3/4/5 by the CI gate's decision")
    parser.add_argument("--max-regression-pct", type=float, default=DEFAULT_MAX_REGRESSION_PCT, metavar="PCT",
                        help=f"how much slower B may be before the gate fails (default {DEFAULT_MAX_REGRESSION_PCT:g})")
    parser.add_argument("--baseline", choices=POOLINGS, default="pooled",
                        help="a folder RUN_A: pool its runs' steps (default) or take its median run")
    parser.add_argument("--markdown", type=Path, metavar="FILE", help="also write the comparison as Markdown (a CI comment)")
    parser.add_argument("--html", type=Path, metavar="FILE", help="also write the comparison as one static HTML page")
    add_json_flag(parser)
    parser.set_defaults(func=run)


def baseline_reports(path: Path) -> list:
    """The run at `path`, or every run in the folder `path` (a baseline of several runs)."""
    from gpuprof.errors import NotARunError
    from gpuprof.report import build_report
    from gpuprof.run.reader import find_run_dirs

    try:
        return [build_report(path)]
    except NotARunError:
        if not path.is_dir():
            raise
    runs = find_run_dirs(path)
    if not runs:
        raise NotARunError(f"{path} is neither a run nor a folder of runs")
    return [build_report(run) for run in runs]


def histogram_lines(comparison) -> list[str]:
    """Both runs' step times on one scale, as a row of bars each."""
    import numpy as np

    times = [side.steps["step_time_s"].dropna().to_numpy() for side in (comparison.a_side, comparison.b_side)]
    if not all(len(values) for values in times):
        return []
    edges = np.histogram_bin_edges(np.concatenate(times), bins=HISTOGRAM_BINS)
    lines = []
    for label, values in zip("AB", times):
        counts, _ = np.histogram(values, bins=edges)
        heights = np.ceil(counts / counts.max() * (len(BARS) - 1)).astype(int)
        lines.append(f"  {label} |{''.join(BARS[height] for height in heights)}|")
    from gpuprof.report.format import figure

    lines.append(f"     {figure(edges[0], 's')} ... {figure(edges[-1], 's')}")
    return lines


def text_lines(comparison, gate) -> list[str]:
    from gpuprof.cli import run_report
    from gpuprof.report.comparison import contract_lines, distribution_rows, figure_rows, figures_caption

    lines = [comparison.conclusion]
    if gate is not None:
        lines.append(f"Gate: {gate.outcome} (exit {gate.exit_code}): {gate.reason}")
    for label, side in (("A", comparison.a_side), ("B", comparison.b_side)):
        lines += [f"{label}: {side.label} ({side.report.summary.path})", f"   {side.report.verdict.headline}"]
    lines += ["", figures_caption(comparison)]
    lines += table_lines(figure_rows(comparison))
    lines += ["", "Comparability contract (checked from what the runs recorded):"]
    lines += [f"  {line}" for line in contract_lines(comparison)]
    lines += ["", "Measured step times:"] + table_lines(distribution_rows(comparison)) + histogram_lines(comparison)
    lines += ["", f"Findings that appeared in B ({len(comparison.appeared)}):"]
    lines += run_report.finding_lines(comparison.appeared, marker="+")
    lines.append(f"Findings that disappeared from A ({len(comparison.disappeared)}):")
    lines += run_report.finding_lines(comparison.disappeared, marker="-")
    lines.append(f"In both: {', '.join(comparison.persisted) or 'none'}")
    return lines


def table_lines(rows: list[dict]) -> list[str]:
    """Rows of strings as aligned columns under their headers."""
    if not rows:
        return []
    widths = {name: max(len(name), *(len(row[name]) for row in rows)) for name in rows[0]}
    render = lambda cells: "  " + "  ".join(f"{cells[name]:<{width}}" for name, width in widths.items())  # noqa: E731
    return [render({name: name for name in widths})] + [render(row) for row in rows]


def markdown(comparison, gate) -> str:
    from gpuprof.report.comparison import contract_lines, distribution_rows, figure_rows, figures_caption

    def table(rows: list[dict]) -> list[str]:
        header = list(rows[0])
        return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                *("| " + " | ".join(row[name] for name in header) + " |" for row in rows)]

    parts = [f"### {comparison.conclusion}", ""]
    if gate is not None:
        parts += [f"**Gate: {gate.outcome}** (exit {gate.exit_code}): {gate.reason}", ""]
    parts += [f"A: `{comparison.a_side.label}` · B: `{comparison.b_side.label}`", "",
              figures_caption(comparison), "", *table(figure_rows(comparison)), "",
              "**Comparability contract**", "", *(f"- {line}" for line in contract_lines(comparison)), "",
              "**Measured step times**", "", *table(distribution_rows(comparison)), ""]
    for title, findings in (("Findings that appeared in B", comparison.appeared),
                            ("Findings that disappeared from A", comparison.disappeared)):
        parts += [f"**{title}**: " + (", ".join(f"`{f.rule}` {f.title}" for f in findings) or "none"), ""]
    return "\n".join(parts)


def write(path: Path, text: str) -> None:
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as error:
        raise GpuprofError(f"cannot write {path}: {error.strerror}") from None


def run(args: argparse.Namespace) -> int:
    from gpuprof.cli import run_report
    from gpuprof.cli.pages import comparison_page
    from gpuprof.report import build_report, compare

    comparison = compare(baseline_reports(args.run_a), build_report(args.run_b), pooling=args.baseline)
    gate = comparison.gate(args.max_regression_pct) if args.gate else None
    for report in (*comparison.a_side.reports, comparison.b):
        run_report.print_notes(report)
    if args.markdown:
        write(args.markdown, markdown(comparison, gate))
    if args.html:
        write(args.html, comparison_page(comparison, gate))
    if args.json:
        run_report.print_json("compare", comparison.to_dict(args.max_regression_pct if args.gate else None),
                              JSON_SCHEMA_VERSION)
    else:
        print("\n".join(text_lines(comparison, gate)))
    return gate.exit_code if gate is not None else 0
