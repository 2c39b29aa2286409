"""Timeline page: one profiler step of a run's trace window, its ops per host thread and its
kernels per device stream, thinned to what a browser draws fluidly. The Trace page links each
step here (`?page=Timeline&run=R&window=steps-A-B&rank=0&step=N`)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlencode

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from gpuprof.dashboard import data
from gpuprof.dashboard.charts import CHART_TEMPLATE, LEGEND_ABOVE, PHASE_COLORS
from gpuprof.dashboard.views.common import need_runs, section, show_frame
from gpuprof.report.frames import units_view
from gpuprof.report.timeline import StepTimeline, WindowTimelines
from gpuprof.report.verdict import HOW_TO_RECORD

PAGE = "Timeline"
RECORD_HINT = f"This run has no trace window. Record {HOW_TO_RECORD['trace window']}."
ROW_HEIGHT_PX = 22
LONGEST_SHOWN = 20
PHASE_RANGE_PREFIX = "gpuprof."  # the record_function range gpuprof opens around each phase of a step


def timeline_url(run: str, window: str, rank: int, step: int) -> str:
    """The Timeline page of one step, as a link relative to the dashboard's own URL."""
    return "?" + urlencode({"page": PAGE, "run": run, "window": window, "rank": rank, "step": step})


def step_links(run: str, window: str, step_breakdown: pd.DataFrame) -> None:
    """Under the Trace page's step breakdown: a link to the timeline of each step of each rank."""
    several_ranks = step_breakdown["rank"].nunique() > 1
    links = [f"[step {step}{f' · rank {rank}' if several_ranks else ''}]({timeline_url(run, window, rank, step)})"
             for rank, step in step_breakdown[["rank", "step"]].drop_duplicates().itertuples(index=False)]
    st.markdown("**Timeline of a step** (ops and kernels per thread and stream): " + " · ".join(links))


@st.cache_resource(show_spinner="Reading the trace…", max_entries=2)
def _window(files: tuple[str, ...], file_signature: tuple) -> WindowTimelines:
    # One loaded trace serves every step and rank picked: not copied per rerun, as cache_data would.
    return WindowTimelines(list(files))


@st.cache_data(show_spinner="Drawing the step…", max_entries=32)
def _timeline(files: tuple[str, ...], file_signature: tuple, step: int, rank: int) -> StepTimeline:
    return _window(files, file_signature).step(step, rank)


def _url_choice(label: str, options: list, param: str, key: str):
    """A selectbox whose first value comes from the URL (when valid) and which writes it back there."""
    if key not in st.session_state or st.session_state[key] not in options:
        wanted = (st.session_state.get("page_params") or {}).get(param)
        st.session_state[key] = next((option for option in options if str(option) == wanted), options[0])
    choice = st.selectbox(label, options, key=key)
    st.query_params[param] = str(choice)
    return choice


def _series(intervals: pd.DataFrame) -> pd.Series:
    """What each bar's colour says: its event kind, or for gpuprof's own range of a step phase
    ("gpuprof.forward") that phase, in the colour the phase charts give it."""
    phase = intervals["name"].str.removeprefix(PHASE_RANGE_PREFIX)
    is_phase = intervals["kind"].eq("user_annotation") & intervals["name"].str.startswith(PHASE_RANGE_PREFIX) \
        & phase.isin(list(PHASE_COLORS))
    return intervals["kind"].where(~is_phase, "phase: " + phase)


def figure(timeline: StepTimeline) -> go.Figure:
    """Bars from start to end in ms, one row per thread depth or stream, one colour per event kind (per phase
    for gpuprof's phase ranges), each labelled with its name where the name fits inside it."""
    intervals = timeline.intervals
    chart = go.Figure()
    for series, part in intervals.groupby(_series(intervals), sort=True):
        phase = series.removeprefix("phase: ")
        chart.add_bar(
            name=series, orientation="h", marker_color=PHASE_COLORS.get(phase), y=part["row"],
            base=part["start_us"] / 1e3, x=part["dur_us"] / 1e3,
            text=part["name"], textposition="inside", insidetextanchor="start",
            customdata=part[["name", "dur_us", "busy_us", "events"]].assign(
                dur_us=part["dur_us"] / 1e3, busy_us=part["busy_us"] / 1e3).to_numpy(),
            hovertemplate="%{customdata[0]}<br>%{customdata[1]:,.3f} ms (busy %{customdata[2]:,.3f} ms, "
                          "%{customdata[3]} events)<br>%{y}<extra></extra>",
        )
    chart.update_layout(template=CHART_TEMPLATE, barmode="overlay",
                        height=80 + ROW_HEIGHT_PX * max(1, len(timeline.rows)), margin=dict(l=10, r=10, t=30, b=10),
                        legend=LEGEND_ABOVE,
                        uniformtext=dict(minsize=8, mode="hide"))  # a name too long for its bar is left out
    chart.update_yaxes(categoryorder="array", categoryarray=timeline.rows[::-1])
    chart.update_xaxes(title_text="ms since the step started", range=[0, timeline.step_time_us / 1e3],
                       tickformat=",~r")
    return chart


def show(timeline: StepTimeline) -> None:
    st.caption(f"Step {timeline.step} on rank {timeline.rank}: {timeline.step_time_us / 1e3:,.1f} ms. "
               f"Drew {len(timeline.intervals):,} intervals for {timeline.events:,} events: events shorter than a "
               "pixel are merged per row and pixel, then the longest are kept. Hover for name, duration and row.")
    st.plotly_chart(figure(timeline), key="timeline_chart", theme=None)
    st.subheader("Longest intervals drawn")
    longest = timeline.intervals.nlargest(LONGEST_SHOWN, "dur_us").rename(columns={"dur_us": "duration_us"})
    show_frame(units_view(longest), "timeline_longest")


def pick_window(entry) -> list[Path] | None:
    """The files of the trace window picked among the run's (a plain trace folder's spans); None, saying how
    to record one, when it has none."""
    windows = {window.name: window.files for window in entry.report.trace_windows}
    if not windows:
        st.info(RECORD_HINT)
        return None
    return windows[_url_choice("Trace window", list(windows), "window", "timeline_window")]


def render(root, entries, selected) -> None:
    if not need_runs(selected, 1, PAGE):
        return
    st.header(f"Timeline · `{selected[0].name}`")
    files = pick_window(selected[0])
    if files is not None:
        with section("Timeline"):
            names, signature = tuple(map(str, files)), data.file_signature(files)
            window = _window(names, signature)
            rank = _url_choice("Rank", window.ranks, "rank", "timeline_rank")
            step = _url_choice("Step", window.steps(rank), "step", "timeline_step")
            show(_timeline(names, signature, step, rank))
