"""Pieces every page uses: the verdict, findings cards, chart panels, the "pick a run" hint."""

from __future__ import annotations

import logging
import re
from contextlib import contextmanager

import pandas as pd
import streamlit as st

from gpuprof.report.format import SEVERITY_COLORS, code_parts, field_text, gain_text, present, value_text
from gpuprof.report.page_views import BLAME_EVIDENCE, evidence_rows
from gpuprof.report.verdict import HOW_TO_RECORD
from gpuprof.errors import GpuprofError

log = logging.getLogger(__name__)

# Material icons ship with Streamlit's frontend, so they render with no emoji font installed.
SEVERITY_ICONS = {"critical": ":material/error:", "warning": ":material/warning:", "info": ":material/info:"}
VERDICT_BOXES = {"critical": st.error, "warning": st.warning, "info": st.info}


def need_runs(selected: list, count: int, page: str) -> bool:
    """True when enough runs are selected; otherwise says what to pick."""
    if len(selected) >= count:
        return True
    what = "one run" if count == 1 else "two runs"
    st.info(f"Select {what} in the sidebar to see the {page} page.")
    return False


@contextmanager
def section(title: str):
    """A part of a page that fails alone: bad input gets its message, a bug gets one line, the page goes on."""
    try:
        yield
    except GpuprofError as error:
        st.error(f"{title}: {error}")
    except Exception as error:  # noqa: BLE001 - one broken panel must not take the page down
        log.exception("dashboard section %r failed", title)
        st.error(f"{title}: could not be shown ({type(error).__name__}: {error})")


# How a grid shows a figure of each unit (gpuprof.report.frames.FrameView.units); labels carry the unit.
NUMBER_FORMATS = {"ms": "%.2f", "µs": "%.1f", "%": "%.1f"}


def show_frame(view, key: str, helps: dict[str, str] | None = None) -> None:
    """A FrameView (gpuprof.report.frames) as a sortable grid with its readable headers."""
    helps = helps or {}
    st.dataframe(view.frame, hide_index=True, key=key, column_config={
        column: _column(view.frame[column], label, view.units[column], helps.get(column))
        for column, label in view.labels.items()})


def _column(values: pd.Series, label: str, unit: str, help_text: str | None):
    if pd.api.types.is_float_dtype(values):
        return st.column_config.NumberColumn(label, format=NUMBER_FORMATS.get(unit, "localized"), help=help_text)
    return st.column_config.Column(label, help=help_text)


def show_panel(panel, key: str = "") -> None:
    """`key` tells apart panels of one title on a page (two runs' side by side)."""
    st.subheader(panel.title)
    if panel.figure is None:
        st.info(panel.note)
        return
    st.plotly_chart(panel.figure, key=f"chart-{panel.title}{key}", theme=None)  # the colours of the HTML report
    if panel.note:
        st.caption(panel.note)


MARKDOWN_SPECIALS = re.compile(r"([\\`*_\[\]$~|<>#])")


def escape_markdown(text: str) -> str:
    """`text` shown literally where Streamlit renders markdown (a `$` would start LaTeX)."""
    return MARKDOWN_SPECIALS.sub(r"\\\1", text)


def markdown_text(text: str) -> str:
    """`text` shown literally, except that its `code spans` show as code (fixes and verdicts name code so)."""
    return "".join(f"`{part}`" if code else escape_markdown(part) for part, code in code_parts(text))


def show_values(values: dict) -> None:
    """Evidence as a table of its values, each as people read it."""
    show_rows([(field_text(name), value_text(value)) for name, value in values.items()])


def show_rows(rows: list[tuple[str, str]]) -> None:
    """(field, value) rows, already in words, as a table."""
    st.table(pd.DataFrame({"value": [value for _, value in rows]}, index=[field for field, _ in rows]))


def show_verdict(verdict) -> None:
    """What bounds the step, why, and what to do next; a warning when a signal to tell is missing, an error
    when the run stopped (a hang, a dead rank)."""
    VERDICT_BOXES[verdict.severity](f"**{escape_markdown(verdict.headline)}.** {markdown_text(verdict.why)}\n\n"
                                    f"**Next:** {markdown_text(verdict.next_step)}", icon=":material/gavel:")


def show_findings(findings: list, empty: str = "No problems found by the diagnosis rules.",
                  blame_shown: bool = False) -> None:
    """Diagnoses, worth the most first: title always visible; evidence and fix one click away. `empty`: what
    to say when there are none; `blame_shown`: the page shows the NaN blame itself, so findings leave it out."""
    if not findings:
        st.success(empty)
        return
    for finding in findings:
        gain = gain_text(finding.est_gain_pct)
        color = SEVERITY_COLORS.get(finding.severity, ("gray",))[0]
        label = f":{color}[**{finding.severity}**] {escape_markdown(finding.title)}" + (f" · {gain}" if gain else "")
        with st.expander(label, expanded=finding.severity == "critical", icon=SEVERITY_ICONS.get(finding.severity)):
            st.caption(f"rule `{finding.rule}` · {finding.category}")
            if finding.fix:
                st.markdown(f"**Fix:** {markdown_text(finding.fix)}")
            flat = {key: value for key, value in finding.evidence.items() if not isinstance(value, dict)}
            if flat:
                show_values(flat)
            for key, value in finding.evidence.items():
                if isinstance(value, dict) and present(value) and not (blame_shown and key == BLAME_EVIDENCE):
                    st.caption(field_text(key))
                    show_rows(evidence_rows(key, value))


def show_not_in_a_trace(what: str, signals: tuple[str, ...]) -> None:
    """On a plain trace's page: `what` needs signals only a gpuprof run records, and how to record them."""
    how = "; ".join(HOW_TO_RECORD[signal] for signal in signals)
    st.info(f"This is a plain torch.profiler trace: {what} needs what only a gpuprof run records. "
            f"Record the loop under gpuprof.profile(...) (or `gpuprof run script.py`) for {how}.",
            icon=":material/info:")
