"""Trace page: the trace analyzer's tables for a run's trace window, or for any trace file the
user uploads, with the raw trace to download for Perfetto."""

from __future__ import annotations

import tempfile
from functools import partial
from pathlib import Path

import streamlit as st

from gpuprof.dashboard import data
from gpuprof.dashboard.charts import kernel_types_panel, top_kernels_panel, trace_memory_panel, trace_steps_panel
from gpuprof.dashboard.views import timeline
from gpuprof.dashboard.views.common import section, show_findings, show_frame, show_panel, show_verdict
from gpuprof.errors import GpuprofError
from gpuprof.report import TraceWindow
from gpuprof.report.page_views import upload_error
from gpuprof.report.trace_views import (
    TABLE_TITLES, VIEW_NEEDS, empty_tables_note, frame_view, missing_note, missing_views, steps_note,
)
from gpuprof.report.verdict import HOW_TO_RECORD
from gpuprof.run.reader import file_bytes

UPLOAD = "A trace file I upload"
TRACE_FILE_HELP = "A torch.profiler Chrome trace (.json or .json.gz)."
# Tables drawn as charts (and the overview) at the top of the page; the others follow as tables.
SHOWN_FIRST = ("overview", "step_breakdown", "kernel_type_breakdown", "top_kernels")


def pick_window(selected) -> TraceWindow | str:
    """The trace to show: a window of the selected run (analysed in its report), or UPLOAD."""
    windows = {window.name: window for window in selected[0].report.trace_windows} if selected else {}
    choice = st.selectbox(
        "Trace", [*windows, UPLOAD], key="trace_choice",
        format_func=lambda option: option if option == UPLOAD else f"{option} ({len(windows[option].files)} file(s))",
        help="A trace window of the selected run (all its ranks), or any torch.profiler trace.",
    )
    return UPLOAD if choice == UPLOAD else windows[choice]


def saved_upload(upload) -> Path:
    """The uploaded file in a private temporary folder (the analyzer reads paths), written once per
    upload so reruns hit the analysis cache."""
    folder = Path(st.session_state.setdefault("upload_dir", tempfile.mkdtemp(prefix="gpuprof-upload-")))
    path = folder / upload.file_id / Path(upload.name).name
    if not path.exists():
        path.parent.mkdir(parents=True)
        path.write_bytes(upload.getvalue())
    return path


def show_upload(title) -> None:
    """An uploaded trace as `gpuprof trace` reports it: `title` (the page's header) names the file, the verdict
    and findings come first, then its tables; a file that is not a trace gets one line in its own name."""
    upload = st.file_uploader("Trace file", type=["json", "gz"], key="trace_upload", help=TRACE_FILE_HELP)
    if upload is None:
        title.header("Trace · an uploaded file")
        st.info("Upload a torch.profiler Chrome trace (.json or .json.gz) to analyse it.")
        return
    title.header(f"Trace · uploaded `{Path(upload.name).name}`")
    path = saved_upload(upload)
    try:
        report = data.uploaded_trace_report(str(path), data.file_signature([path]))
    except GpuprofError as error:
        st.error(upload_error(error, path, Path(upload.name).name))
        return
    show_verdict(report.verdict)
    st.subheader("Diagnoses")
    show_findings(report.findings)
    with section("Trace analysis"):
        show_tables(report.tables)
    download(path)


def show_tables(tables: dict, step_links=None) -> None:
    """`step_links(step_breakdown)`: draws links to each step's timeline (for a run's trace window).
    Only tables with rows are drawn; one line names the empty ones."""
    overview = tables["overview"]
    show_frame(frame_view("overview", overview), "trace_overview",
               {"file": "Full path: " + "; ".join(map(str, overview["file"]))})
    st.caption(steps_note(overview))
    empty = empty_tables_note(tables, bool(overview["has_device_activity"].any()))
    if empty:
        st.info(empty)
    show_panel(trace_steps_panel(tables["step_breakdown"]))
    if step_links is not None:
        step_links(tables["step_breakdown"])
    if not tables["kernel_type_breakdown"].empty:
        show_panel(kernel_types_panel(tables["kernel_type_breakdown"]))
    if not tables["top_kernels"].empty:
        show_panel(top_kernels_panel(tables["top_kernels"]))
        show_frame(frame_view("top_kernels", tables["top_kernels"]), "top_kernels_table")
    missing = missing_views(tables)
    shown_apart = [name for view in missing for name in VIEW_NEEDS[view][0]]
    for name in TABLE_TITLES:
        if name in SHOWN_FIRST or name in shown_apart or tables[name].empty:
            continue
        if name == "memory_timeline":
            show_panel(trace_memory_panel(tables[name]))
            continue
        view = frame_view(name, tables[name])
        st.subheader(view.title)
        show_frame(view, f"trace_{name}")
    for view in missing:
        st.info(missing_note(view))


def render(root, entries, selected) -> None:
    title = st.empty()  # the header names the trace shown, known once picked below it
    window = pick_window(selected)
    if window == UPLOAD:
        show_upload(title)
        if selected and not selected[0].report.trace_windows:
            st.caption(f"`{selected[0].name}` has no trace window. Record {HOW_TO_RECORD['trace window']}.")
        return
    title.header(f"Trace · `{selected[0].name}`")
    links = partial(timeline.step_links, selected[0].name, window.name) \
        if window.files[0].is_relative_to(selected[0].path) else None
    if window.error is not None:
        st.error(f"Trace analysis: {window.error}")
    else:
        with section("Trace analysis"):
            show_tables(window.tables, links)
    for file in window.files:
        download(file)


def download(file: Path) -> None:
    st.download_button(f"Download {file.name} (open in ui.perfetto.dev)", file_bytes(file),
                       file_name=file.name, key=f"download-{file.name}")
