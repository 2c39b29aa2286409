"""The gpuprof dashboard, a Streamlit script: `gpuprof dashboard [RUNS_DIR]` runs it.

The sidebar holds the page and the selected runs (mirrored in the URL so a view can be
shared or reloaded); the page body reruns on its own while a selected run is still being
written, and widget state survives those reruns.
"""

from __future__ import annotations

import sys
from functools import partial

import streamlit as st

from gpuprof.dashboard import MAX_SELECTED_RUNS, MIN_REFRESH_S, data
from gpuprof.dashboard.views import compare, distributed, memory, numerics, run, runs, timeline, trace, tune
from gpuprof.errors import GpuprofError
from gpuprof.report.format import short_labels

# What a run chip in the sidebar shows before Streamlit cuts it short.
CHIP_CHARS = 18
PAGES = {
    "Runs": runs.render,
    "Run": run.render,
    "Numerics": numerics.render,
    "Trace": trace.render,
    "Timeline": timeline.render,
    "Memory": memory.render,
    "Distributed": distributed.render,
    "Compare": compare.render,
    "Tune": tune.render,
}


def _init_from_url(names: list[str]) -> None:
    """On a session's first run, take the page and runs from the URL (?page=Run&run=a&run=b), and keep
    the page's own parameters (?step=3) for it: the sidebar rewrites the URL before the page runs."""
    if "page" not in st.session_state:
        page = st.query_params.get("page", "Runs")
        st.session_state.page = page if page in PAGES else "Runs"
        st.session_state.page_params = {key: st.query_params.get(key) for key in st.query_params
                                        if key not in ("page", "run")}
    if "selected_runs" not in st.session_state:
        wanted = [name for name in st.query_params.get_all("run") if name in names]
        st.session_state.selected_runs = (wanted or names[:1])[:MAX_SELECTED_RUNS]
    # A run that vanished from the folder can no longer be selected.
    st.session_state.selected_runs = [name for name in st.session_state.selected_runs if name in names]


def _sidebar(entries: list[data.RunEntry]) -> tuple[str, list[str], float | None]:
    names = [entry.name for entry in entries if entry.ok]
    _init_from_url(names)
    with st.sidebar:
        st.title("gpuprof")
        page = st.radio("Page", list(PAGES), key="page")
        labels = short_labels(names, CHIP_CHARS)
        selected = st.multiselect(
            "Runs", names, key="selected_runs", max_selections=MAX_SELECTED_RUNS, format_func=labels.get,
            help="One run for the Run, Numerics, Trace, Timeline, Memory and Distributed pages (the first); "
            "two or more for Compare: B is the last, A the others (a baseline of several runs).",
        )
        auto = st.toggle("Auto-refresh live runs", value=True, key="auto_refresh")
        interval_s = st.number_input("Refresh every (s)", min_value=MIN_REFRESH_S, value=data.refresh_interval_s(),
                                     step=1.0, key="refresh_s", disabled=not auto)
    st.query_params.from_dict({"page": page, "run": selected})
    return page, selected, interval_s if auto else None


def _watched(page: str, entries: list[data.RunEntry], selected: list[str]) -> list[data.RunEntry]:
    """The runs whose growth the page shows: all of them on the Runs page, else the selected ones."""
    return entries if page == "Runs" else [entry for entry in entries if entry.name in selected]


def _page_body(root, page: str, selected: list[str], refreshing: bool,
               entries: list[data.RunEntry] | None = None) -> None:
    """The page itself. `entries`: the catalog this script run already read; a live fragment's
    periodic rerun passes none and reads the folder afresh."""
    if entries is None:
        entries = data.catalog(root)
    by_name = {entry.name: entry for entry in entries}
    PAGES[page](root=root, entries=entries, selected=[by_name[name] for name in selected if name in by_name])
    if refreshing and not any(entry.live for entry in _watched(page, entries, selected)):
        st.rerun(scope="app")  # the run finished: a full rerun stops the periodic refresh


# Streamlit's wide layout keeps 5rem on either side of a page: at 1440 px, with the sidebar open, the Runs table
# and the per-rank tables would not fit their columns.
NARROW_MARGINS = "<style>[data-testid='stMainBlockContainer'] {padding-left: 2rem; padding-right: 2rem;}</style>"


def main() -> None:
    st.set_page_config(page_title="gpuprof", layout="wide")
    st.markdown(NARROW_MARGINS, unsafe_allow_html=True)
    try:
        root = data.runs_root(sys.argv)
    except GpuprofError as error:
        st.error(str(error))
        return
    entries = data.catalog(root)
    page, selected, interval_s = _sidebar(entries)
    refreshing = bool(interval_s) and any(entry.live for entry in _watched(page, entries, selected))
    if refreshing:
        st.caption(f"Live: refreshing every {interval_s:g} s.")
        st.fragment(partial(_page_body, root, page, selected, refreshing), run_every=interval_s)()
    else:
        _page_body(root, page, selected, refreshing, entries)


main()
