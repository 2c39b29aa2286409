"""The static HTML pages (`gpuprof report`, `compare --html`, `tune --html`), rendered from the Jinja2
templates in `templates/`. Only rendering: every figure and text comes from the report, the comparison or the
tune result."""

from __future__ import annotations

from functools import lru_cache

import jinja2

from gpuprof.report.format import (
    MISSING, SEVERITY_COLORS, code_parts, device_label, field_text, gain_text, headline_figures, present,
    value_text,
)

# A severity the palette does not name (none today) still gets a border.
NEUTRAL_COLOR = "#999"


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.PackageLoader("gpuprof.cli", "templates"),
                             autoescape=True, trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    env.filters.update(code_parts=code_parts, field_text=field_text, value_text=value_text, gain_text=gain_text,
                       present=lambda mapping: present(mapping).items())
    env.globals["severity_color"] = lambda severity: SEVERITY_COLORS.get(severity, (None, NEUTRAL_COLOR))[1]
    return env


def run_page(report, rank: int) -> str:
    """The Run page of `report` as one HTML document: verdict, figures, diagnoses, then the charts of `rank`."""
    from gpuprof.dashboard.charts import run_panels

    summary = report.summary
    figures = {"Steps": str(summary.n_steps), **headline_figures(summary), "Warm-up": summary.warmup.reason}
    return environment().get_template("run.html.j2").render(
        report=report, rank=rank, device=device_label(report.meta),
        figures={name: value for name, value in figures.items() if value != MISSING},
        panels=with_plotly_js_once(run_panels(report.run, rank)))


def with_plotly_js_once(panels) -> list[tuple]:
    """Each panel with whether its chart carries plotly.js: the first chart only, so the file opens offline once."""
    first_chart = next((index for index, panel in enumerate(panels) if panel.figure is not None), None)
    return [(panel, index == first_chart) for index, panel in enumerate(panels)]


def comparison_page(comparison, gate=None) -> str:
    """`gpuprof compare --html`: the conclusion, every figure with its interval, the contract's
    differences and both runs' step-time distributions, as one HTML document."""
    from gpuprof.dashboard.charts import step_time_distribution_panel
    from gpuprof.report.comparison import contract_lines, distribution_rows, figure_rows, figures_caption

    times = {f"{label}: {side.label}": side.steps["step_time_s"].dropna().to_numpy()
             for label, side in (("A", comparison.a_side), ("B", comparison.b_side))}
    return environment().get_template("compare.html.j2").render(
        comparison=comparison, gate=gate, caption=figures_caption(comparison), figure_rows=figure_rows(comparison),
        contract=contract_lines(comparison), distribution_rows=distribution_rows(comparison),
        distribution=step_time_distribution_panel(times),
        changed_findings=[("Findings that appeared in B", comparison.appeared),
                          ("Findings that disappeared from A", comparison.disappeared)])


def tune_page(result: dict) -> str:
    """`gpuprof tune --html`: what the terminal shows, as one HTML document."""
    from gpuprof.report.tuning import TRIAL_HEADERS, diff_title, text_lines, trial_rows

    return environment().get_template("tune.html.j2").render(
        result=result, lines=text_lines(result), headers=TRIAL_HEADERS, rows=trial_rows(result),
        diff_title=diff_title(result) if result["diff"] else "")
