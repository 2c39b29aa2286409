"""A real browser for the dashboard tests: Debian's headless Chromium driven by Playwright, and what a page
shows once Streamlit has rendered it (imported by the browser tests)."""

from __future__ import annotations

import contextlib
import shutil
import time

import pytest

try:
    from playwright.sync_api import expect, sync_playwright
except ImportError:  # the `test` extra installs it
    expect = sync_playwright = None

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
RENDER_TIMEOUT_S = 240.0  # generous: the suite runs on a shared, loaded 2-core machine (-n 2)

needs_browser = pytest.mark.skipif(
    CHROMIUM is None or sync_playwright is None,
    reason="needs Debian's chromium (scripts/test.sh installs it where it can: apt-get install -y chromium) and "
           "playwright (pip install -e '.[test]')")


# A chart counts once Plotly has drawn its data: SVG traces (`.trace`) or a heatmap image (`.hm`).
PAGE_STATE = """() => ({
  charts: document.querySelectorAll('.js-plotly-plot').length,
  drawn: Array.from(document.querySelectorAll('.js-plotly-plot'))
    .filter(chart => chart.querySelector('.trace, .hm')).length,
  tables: document.querySelectorAll('[data-testid="stDataFrame"]').length,
  running: document.querySelectorAll('[data-testid="stStatusWidget"]').length,
  failures: document.querySelectorAll('[data-testid="stException"], [data-testid="stAlertContentError"]').length,
  text: document.body.innerText + ' | ' + Array.from(document.querySelectorAll('[role="gridcell"], [role="columnheader"]'))
    .map(cell => cell.textContent).join(' | ')})"""
# (Tables are drawn on a canvas: their cells' and headers' text is in the grid's accessible cells, not in innerText;
# a missing cell is drawn "None" there but left empty in its accessible cell: the AppTest page tests check the
# tables' data for it, dashboard_helpers.empty_cells.)


def rendered(page, charts: int, tables: int, texts: list[str], errors_shown: bool = False) -> dict:
    """The page's state once it shows `charts` drawn charts, `tables` tables and every text, with
    Streamlit idle; polls the DOM (no fixed sleep) for up to RENDER_TIMEOUT_S. At the first failure (an
    exception or an error box) it returns at once, unless the page shows `errors_shown` (a critical verdict's box)."""
    deadline = time.monotonic() + RENDER_TIMEOUT_S
    state = {}
    while time.monotonic() < deadline:
        state = page.evaluate(PAGE_STATE)
        if state["failures"] and not errors_shown:
            return state
        if (state["drawn"] >= charts and state["drawn"] == state["charts"] and state["tables"] >= tables
                and not state["running"] and all(text in state["text"] for text in texts)):
            return state
        page.wait_for_timeout(250)
    missing = [text for text in texts if text not in state.get("text", "")]
    raise AssertionError(f"page not rendered in {RENDER_TIMEOUT_S:.0f} s: {state.get('drawn')}/{state.get('charts')} "
                         f"charts, {state.get('tables')} tables, missing texts {missing}, "
                         f"text starts {state.get('text', '')[:300]!r}")


@contextlib.contextmanager
def chromium_page():
    """A page of Debian's headless Chromium (Playwright's own browser download is not needed)."""
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1400, "height": 2400})
        page.set_default_timeout(RENDER_TIMEOUT_S * 1000)
        yield page
        browser.close()
