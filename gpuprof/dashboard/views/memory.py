"""Memory page: a run's CUDA memory snapshots (the one written on out-of-memory, and those the loop
took with `prof.memory_snapshot()`): the allocation timeline and the largest live allocations; for a folder of
plain traces, the trace's memory view (profile_memory=True)."""

from __future__ import annotations

from pathlib import Path

import plotly.graph_objects as go
import streamlit as st

from gpuprof.dashboard import data
from gpuprof.dashboard.charts import CHART_TEMPLATE, LEGEND_ABOVE, NUMBER_FORMAT, trace_memory_panel
from gpuprof.dashboard.downsample import lttb
from gpuprof.dashboard.views.common import need_runs, section, show_frame, show_not_in_a_trace, show_panel
from gpuprof.report import format as formatting
from gpuprof.report.format import GIB
from gpuprof.report.frames import units_view
from gpuprof.report.page_views import snapshot_hint
from gpuprof.report.memory import MemorySnapshot
from gpuprof.report.trace_views import TABLE_TITLES, frame_view, missing_note, missing_views

PAGE = "Memory"
HISTORY_HINT = ("This snapshot holds no allocation history, only what was live when it was taken: pass "
                "`memory_history=True` to `gpuprof.profile(...)` to record the allocator's actions and stacks.")


def timeline_figure(snapshot: MemorySnapshot) -> go.Figure:
    """Allocated and reserved GiB after each allocator action, per device (downsampled with LTTB)."""
    timeline = snapshot.timeline
    x = "time_us" if timeline["time_us"].notna().all() else "entry"
    chart = go.Figure()
    for device, actions in timeline.groupby("device"):
        for column in ("allocated_bytes", "reserved_bytes"):
            points = lttb(actions, x, column)
            chart.add_scatter(x=points[x], y=points[column] / GIB, mode="lines",
                              name=f"{column.removesuffix('_bytes')} · device {device}")
    chart.update_layout(template=CHART_TEMPLATE, height=360, margin=dict(l=10, r=10, t=30, b=10),
                        hovermode="x unified", legend=LEGEND_ABOVE)
    chart.update_xaxes(title_text="time (µs)" if x == "time_us" else "allocator action (oldest kept first)")
    chart.update_yaxes(title_text="GiB", tickformat=NUMBER_FORMAT, hoverformat=NUMBER_FORMAT)
    return chart


def show(snapshot: MemorySnapshot) -> None:
    columns = st.columns(3)
    columns[0].metric("Allocated", formatting.figure(snapshot.allocated_bytes, "bytes"))
    columns[1].metric("Reserved", formatting.figure(snapshot.reserved_bytes, "bytes"))
    columns[2].metric("Segments", f"{snapshot.segments:,}")
    if snapshot.failed_request_bytes is not None:
        st.error(f"Out of memory: the last failing request asked for {formatting.figure(snapshot.failed_request_bytes, 'bytes')}.")
    st.subheader("Allocation timeline")
    if snapshot.has_history:
        st.plotly_chart(timeline_figure(snapshot), key="memory_timeline", theme=None)
    else:
        st.info(HISTORY_HINT)
    st.subheader("Largest live allocations")
    show_frame(units_view(snapshot.top_allocations), "memory_top")


def show_trace_memory(tables: dict) -> None:
    """A plain trace's memory view (its latest span): memory over time, per device and by operator, or
    how to record it."""
    if "Memory" in missing_views(tables):
        st.info(missing_note("Memory"))
        return
    with section("Trace memory"):
        st.subheader(TABLE_TITLES["memory_summary"])
        show_frame(frame_view("memory_summary", tables["memory_summary"]), "trace_memory_summary")
        show_panel(trace_memory_panel(tables["memory_timeline"]))
        st.subheader(TABLE_TITLES["memory_by_op"])
        show_frame(frame_view("memory_by_op", tables["memory_by_op"]), "trace_memory_by_op")


def pick_snapshot(entry) -> Path | None:
    """The snapshot to show, picked among the run's (the out-of-memory one labelled); None, saying how
    to take one, when the run has none."""
    if entry.bare_trace:
        show_trace_memory(entry.report.tables)
        show_not_in_a_trace("a CUDA memory snapshot", ("memory snapshots",))
        return None
    on_oom = data.memory_snapshots(str(entry.path), entry.signature)
    if not on_oom:
        st.info(snapshot_hint(entry.meta), icon=":material/info:")
        return None
    return st.selectbox("Snapshot", list(on_oom), key="memory_snapshot",
                        format_func=lambda file: f"{file.name} · {'out of memory' if on_oom[file] else 'on demand'}")


def render(root, entries, selected) -> None:
    if not need_runs(selected, 1, PAGE):
        return
    st.header(f"Memory · `{selected[0].name}`")
    choice = pick_snapshot(selected[0])
    if choice is not None:
        with section("Memory snapshot"):
            show(data.memory_snapshot(str(choice), data.file_signature([choice])))
