"""Trace page: the trace analyzer's tables for a run's trace window, or for any trace file the
user uploads, with the raw trace to download for Perfetto."""

from __future__ import annotations

import tempfile
from pathlib import Path

import streamlit as st

from gpuprof.dashboard import data
from gpuprof.dashboard.charts import kernel_types_panel, top_kernels_panel, trace_steps_panel
from gpuprof.dashboard.views.common import section, show_panel

UPLOAD = "A trace file I upload"
TRACE_FILE_HELP = "A torch.profiler Chrome trace (.json or .json.gz)."
TABLES = (
    ("Temporal breakdown (as HTA defines it)", "temporal_breakdown"),
    ("Idle time by cause, per stream", "idle_by_stream"),
    ("Computation/communication overlap", "comm_comp_overlap"),
    ("Kernel launches", "launch_summary"),
    ("Host-device synchronizations inside steps", "host_device_syncs"),
    ("Matmul time in tensor-core kernels", "tensor_core_share"),
    ("Step time across ranks", "rank_spread"),
    ("Straggler candidates", "stragglers"),
    ("Top CPU ops", "top_cpu_ops"),
)


def pick_files(selected) -> list[Path] | None:
    """The trace files to analyse: a window of the selected run, or an uploaded file."""
    windows = data.trace_windows(selected[0]) if selected else {}
    choice = st.selectbox(
        "Trace", [*windows, UPLOAD], key="trace_choice",
        format_func=lambda option: option if option == UPLOAD else f"{option} ({len(windows[option])} file(s))",
        help="A trace window of the selected run (all its ranks), or any torch.profiler trace.",
    )
    if choice != UPLOAD:
        return windows[choice]
    upload = st.file_uploader("Trace file", type=["json", "gz"], key="trace_upload", help=TRACE_FILE_HELP)
    if upload is None:
        st.info("Upload a torch.profiler Chrome trace (.json or .json.gz) to analyse it.")
        return None
    return [saved_upload(upload)]


def saved_upload(upload) -> Path:
    """The uploaded file in a private temporary folder (the analyzer reads paths), written once per
    upload so reruns hit the analysis cache."""
    folder = Path(st.session_state.setdefault("upload_dir", tempfile.mkdtemp(prefix="gpuprof-upload-")))
    path = folder / upload.file_id / Path(upload.name).name
    if not path.exists():
        path.parent.mkdir(parents=True)
        path.write_bytes(upload.getvalue())
    return path


def show_tables(tables: dict) -> None:
    overview = tables["overview"]
    st.dataframe(overview, hide_index=True, key="trace_overview")
    if not overview["has_device_activity"].any():
        st.info("This trace has no device activity (a CPU-only run): kernel figures are empty, the CPU side is below.")
    show_panel(trace_steps_panel(tables["step_breakdown"]))
    show_panel(kernel_types_panel(tables["kernel_type_breakdown"]))
    show_panel(top_kernels_panel(tables["top_kernels"]))
    st.dataframe(tables["top_kernels"], hide_index=True, key="top_kernels_table")
    for title, name in TABLES:
        st.subheader(title)
        st.dataframe(tables[name], hide_index=True, key=f"trace_{name}")


def render(root, entries, selected) -> None:
    st.header("Trace" + (f" · `{selected[0].name}`" if selected else ""))
    files = pick_files(selected)
    if not files:
        if selected and not data.trace_windows(selected[0]):
            st.caption("This run has no trace window; record one with the profile's trace_steps.")
        return
    with section("Trace analysis"):
        show_tables(data.trace_tables(tuple(map(str, files)), data.file_signature(files)))
    for file in files:
        st.download_button(f"Download {file.name} (open in ui.perfetto.dev)", file.read_bytes(),
                           file_name=file.name, key=f"download-{file.name}")
