"""`gpuprof report RUN -o report.html`: the run's report (verdict first) and its charts as one static
HTML file, for sharing without a server."""

from __future__ import annotations

import argparse
import html
from pathlib import Path

from gpuprof.errors import GpuprofError
from gpuprof.report.format import (
    MISSING, SEVERITY_COLORS, code_parts, device_label, field_text, gain_text, headline_figures, present,
    value_text,
)

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
.finding { border-left: 4px solid; padding: 0.3em 1em; margin: 0.6em 0; background: #fafafa; }
.finding table { border-collapse: collapse; font-size: 90%; }
.finding td { padding: 0.1em 0.8em 0.1em 0; }
.note { color: #666; font-style: italic; }
.verdict { border: 2px solid #1565c0; padding: 0.3em 1em; margin: 1em 0; }
table.figures td { padding: 0.2em 1.2em 0.2em 0; }
"""


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


def _text_html(text: str) -> str:
    """A fix's or verdict's text, its code spans as code."""
    return "".join(f"<code>{html.escape(part)}</code>" if code else html.escape(part) for part, code in code_parts(text))


def _verdict_html(verdict) -> str:
    return (f'<div class="verdict" style="border-color:{SEVERITY_COLORS[verdict.severity][1]}">'
            f'<h2>{html.escape(verdict.headline)}</h2><p>{_text_html(verdict.why)}</p>'
            f"<p><b>Next:</b> {_text_html(verdict.next_step)}</p></div>")


def _value_html(value) -> str:
    """An evidence value; a dict of them (a NaN's origin) as a table of its fields that hold something."""
    if isinstance(value, dict):
        return "<table>" + "".join(f"<tr><td>{html.escape(field_text(key))}</td><td>{_value_html(item)}</td></tr>"
                                   for key, item in present(value).items()) + "</table>"
    return html.escape(value_text(value))


def _finding_html(finding) -> str:
    rows = "".join(
        f"<tr><td>{html.escape(field_text(key))}</td><td>{_value_html(value)}</td></tr>"
        for key, value in finding.to_dict()["evidence"].items()
    )
    gain = gain_text(finding.est_gain_pct)
    return (
        f'<div class="finding" style="border-color:{SEVERITY_COLORS.get(finding.severity, (None, "#999"))[1]}">'
        f"<h3>{html.escape(finding.title)}</h3>"
        f"<p>{finding.severity} · {finding.category} · rule <code>{html.escape(finding.rule)}</code>"
        f"{' · ' + gain if gain else ''}</p>"
        f"<p><b>Fix:</b> {_text_html(finding.fix)}</p><table>{rows}</table></div>"
    )


def _summary_html(summary) -> str:
    figures = {"Steps": str(summary.n_steps), **headline_figures(summary), "Warm-up": summary.warmup.reason}
    rows = "".join(f"<tr><td>{html.escape(name)}</td><td>{html.escape(value)}</td></tr>"
                   for name, value in figures.items() if value != MISSING)
    return f'<table class="figures">{rows}</table>'


def render_html(report, rank: int) -> str:
    """The Run page of `report` as one HTML document: verdict, figures, diagnoses, then the charts of `rank`."""
    from gpuprof.dashboard.charts import run_panels

    parts = [
        f"<h1>gpuprof report: {html.escape(report.name)}</h1>",
        f"<p>{html.escape(str(report.meta.get('status')))} · {html.escape(device_label(report.meta))}"
        f" · rank {rank}</p>",
        _verdict_html(report.verdict), _summary_html(report.summary), "<h2>Diagnoses</h2>",
        *(map(_finding_html, report.findings) if report.findings
          else ["<p>No problems found by the diagnosis rules.</p>"]),
    ]
    include_js = True
    for panel in run_panels(report.run, rank):
        parts.append(f"<h2>{html.escape(panel.title)}</h2>")
        if panel.figure is None:
            parts.append(f'<p class="note">{html.escape(panel.note)}</p>')
            continue
        parts.append(panel.figure.to_html(full_html=False, include_plotlyjs=include_js))
        include_js = False
        if panel.note:
            parts.append(f'<p class="note">{html.escape(panel.note)}</p>')
    body = "\n".join(parts)
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>gpuprof: {html.escape(report.name)}</title>"
            f"<style>{STYLE}</style></head><body>{body}</body></html>")


def _table_html(rows: list[dict[str, str]]) -> str:
    header = "".join(f"<th>{html.escape(name)}</th>" for name in rows[0]) if rows else ""
    body = "".join("<tr>" + "".join(f"<td>{html.escape(value)}</td>" for value in row.values()) + "</tr>"
                   for row in rows)
    return f'<table class="figures"><tr>{header}</tr>{body}</table>'


def render_comparison_html(comparison, gate=None) -> str:
    """`gpuprof compare --html`: the conclusion, every figure with its interval, the contract's
    differences and both runs' step-time distributions, as one HTML document."""
    from gpuprof.dashboard.charts import step_time_distribution_panel
    from gpuprof.report.comparison import contract_lines, distribution_rows, figure_rows, figures_caption

    times = {f"{label}: {side.label}": side.steps["step_time_s"].dropna().to_numpy()
             for label, side in (("A", comparison.a_side), ("B", comparison.b_side))}
    panel = step_time_distribution_panel(times)
    parts = [
        f"<h1>gpuprof compare: {html.escape(comparison.a_side.label)} vs {html.escape(comparison.b_side.label)}</h1>",
        f'<div class="verdict"><h2>{html.escape(comparison.conclusion)}</h2>'
        + (f"<p><b>Gate: {html.escape(gate.outcome)}</b> (exit {gate.exit_code}): {html.escape(gate.reason)}</p>"
           if gate is not None else "") + "</div>",
        f"<p>{html.escape(figures_caption(comparison))}</p>", _table_html(figure_rows(comparison)),
        "<h2>Comparability contract</h2>",
        "<ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in contract_lines(comparison)) + "</ul>",
        "<h2>Measured step times</h2>", _table_html(distribution_rows(comparison)),
        panel.figure.to_html(full_html=False, include_plotlyjs=True) if panel.figure is not None
        else f'<p class="note">{html.escape(panel.note)}</p>',
    ]
    for title, findings in (("Findings that appeared in B", comparison.appeared),
                            ("Findings that disappeared from A", comparison.disappeared)):
        parts += [f"<h2>{title}</h2>", *(map(_finding_html, findings) if findings else ["<p>No findings.</p>"])]
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>gpuprof compare</title>"
            f"<style>{STYLE}</style></head><body>{chr(10).join(parts)}</body></html>")


def run(args: argparse.Namespace) -> int:
    from gpuprof.report import build_report

    report = build_report(args.run_dir)
    if args.rank not in (report.run.ranks or [0]):
        raise GpuprofError(f"--rank {args.rank}: this run has ranks {report.run.ranks}")
    try:
        args.output.write_text(render_html(report, args.rank), encoding="utf-8")
    except OSError as error:
        raise GpuprofError(f"cannot write {args.output}: {error.strerror}") from None
    print(f"wrote {args.output} ({args.output.stat().st_size / 1e6:.1f} MB)")
    return 0
