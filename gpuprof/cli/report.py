"""`gpuprof report RUN -o report.html`: the Run page as one static HTML file, for sharing without a server."""

from __future__ import annotations

import argparse
import html
from pathlib import Path

from gpuprof.errors import GpuprofError

SEVERITY_COLORS = {"critical": "#c62828", "warning": "#ef6c00", "info": "#1565c0"}
STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
.finding { border-left: 4px solid; padding: 0.3em 1em; margin: 0.6em 0; background: #fafafa; }
.finding table { border-collapse: collapse; font-size: 90%; }
.finding td { padding: 0.1em 0.8em 0.1em 0; }
.note { color: #666; font-style: italic; }
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


def _finding_html(finding) -> str:
    rows = "".join(
        f"<tr><td>{html.escape(str(key))}</td><td>{html.escape(str(value))}</td></tr>"
        for key, value in finding.to_dict()["evidence"].items()
    )
    gain = f" · est. gain {finding.est_gain_pct:.0f} % of step time" if finding.est_gain_pct is not None else ""
    return (
        f'<div class="finding" style="border-color:{SEVERITY_COLORS.get(finding.severity, "#999")}">'
        f"<h3>{html.escape(finding.title)}</h3>"
        f"<p>{finding.severity} · rule <code>{html.escape(finding.rule)}</code>{gain}</p>"
        f"<p><b>Fix:</b> {html.escape(finding.fix)}</p><table>{rows}</table></div>"
    )


def _summary_html(summary) -> str:
    figures = {
        "steps": summary.n_steps, "step time p50 s": summary.step_time_p50_s, "tokens/s": summary.tokens_per_s,
        "MFU": summary.mfu, "peak memory allocated bytes": summary.peak_mem_allocated_bytes,
        "peak process RSS bytes": summary.peak_rss_bytes,
        "GPU utilization %": summary.gpu_util_mean_pct, "warm-up": summary.warmup.reason,
    }
    rows = "".join(
        f"<tr><td>{html.escape(name)}</td><td>{html.escape(f'{value:,.4g}' if isinstance(value, float) else str(value))}</td></tr>"
        for name, value in figures.items() if value is not None
    )
    return f'<table class="figures">{rows}</table>'


def render_html(run, rank: int) -> str:
    from gpuprof.dashboard.charts import run_panels
    from gpuprof.dashboard.format import device_label
    from gpuprof.diagnoses.context import RunContext
    from gpuprof.diagnoses.registry import diagnose_context

    context = RunContext.of(run)
    findings = diagnose_context(context)
    parts = [
        f"<h1>gpuprof report: {html.escape(run.name)}</h1>",
        f"<p>{html.escape(str(run.meta.get('status')))} · {html.escape(device_label(run.meta))} · rank {rank}</p>",
        _summary_html(context.summary), "<h2>Diagnoses</h2>",
        *(map(_finding_html, findings) if findings else ["<p>No problems found by the diagnosis rules.</p>"]),
    ]
    include_js = True
    for panel in run_panels(run, rank):
        parts.append(f"<h2>{html.escape(panel.title)}</h2>")
        if panel.figure is None:
            parts.append(f'<p class="note">{html.escape(panel.note)}</p>')
            continue
        parts.append(panel.figure.to_html(full_html=False, include_plotlyjs=include_js))
        include_js = False
        if panel.note:
            parts.append(f'<p class="note">{html.escape(panel.note)}</p>')
    body = "\n".join(parts)
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>gpuprof: {html.escape(run.name)}</title>"
            f"<style>{STYLE}</style></head><body>{body}</body></html>")


def run(args: argparse.Namespace) -> int:
    from gpuprof.run.reader import load_run

    run_data = load_run(args.run_dir)
    if args.rank not in (run_data.ranks or [0]):
        raise GpuprofError(f"--rank {args.rank}: this run has ranks {run_data.ranks}")
    try:
        args.output.write_text(render_html(run_data, args.rank), encoding="utf-8")
    except OSError as error:
        raise GpuprofError(f"cannot write {args.output}: {error.strerror}") from None
    print(f"wrote {args.output} ({args.output.stat().st_size / 1e6:.1f} MB)")
    return 0
