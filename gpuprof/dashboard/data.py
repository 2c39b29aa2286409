"""Everything the pages show comes through here: the runs found under the root (gpuprof.run),
each with its report (gpuprof.report: summary, verdict, findings, trace tables, numerics blames),
and the charts drawn from them, cached per run and re-drawn only when its files change.

The cache key of a run is its path plus its signature (gpuprof.run.reader.run_signature: name,
size and mtime of its files), so a live run is re-read as it grows and a finished one is read
once. Paths given by the user (a run picked in the sidebar or named in the URL) are resolved
and must lie under the root: the dashboard reads nothing outside the folder it was given.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import streamlit as st

from gpuprof.dashboard import DEFAULT_REFRESH_S, MIN_REFRESH_S, REFRESH_ENV, RUNS_DIR_ENV, default_runs_dir
from gpuprof.errors import GpuprofError
from gpuprof.report import Report, build_report
from gpuprof.report.memory import MemorySnapshot, read_snapshot, snapshot_files
from gpuprof.report.trace_report import TraceReport, build_trace_report, trace_folder_report
from gpuprof.run.reader import find_run_dirs, find_trace_dirs
from gpuprof.run.tune_result import RESULT_FILE, read_result

# A run whose files have not changed for this long is no longer refreshed as live.
STALLED_AFTER_S = 120.0


def runs_root(argv: list[str]) -> Path:
    """The folder to show: `streamlit run app.py -- DIR`, else $GPUPROF_RUNS_DIR, else the default."""
    launched_as_script = bool(argv) and Path(argv[0]).name == "app.py"
    given = argv[1] if launched_as_script and len(argv) > 1 else os.environ.get(RUNS_DIR_ENV)
    root = Path(given) if given else default_runs_dir()
    if not root.is_dir():
        raise GpuprofError(f"runs folder {root} does not exist or is not a folder")
    return root.resolve()


def refresh_interval_s() -> float:
    """The auto-refresh interval `gpuprof dashboard --refresh-s` passed on, else the default."""
    try:
        return max(MIN_REFRESH_S, float(os.environ.get(REFRESH_ENV, DEFAULT_REFRESH_S)))
    except ValueError:
        return DEFAULT_REFRESH_S


def under_root(root: Path, relative: str) -> Path:
    """`root / relative`, refusing anything (.., absolute paths, symlinks) that leads outside root."""
    path = (root / relative).resolve()
    if not path.is_relative_to(root):
        raise GpuprofError(f"{relative} is outside the runs folder {root}")
    return path


@dataclass
class RunEntry:
    """A run found under the root: `name` is its path relative to the root (also its id in the URL);
    `report` is its report, or `error` says why it cannot be read."""

    name: str
    path: Path
    report: Report | TraceReport | None = None
    error: str | None = None

    @property
    def bare_trace(self) -> bool:
        """A folder of plain torch.profiler traces, not a gpuprof run."""
        return self.report is not None and self.report.bare_trace

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def signature(self) -> tuple:
        return self.report.signature if self.report is not None else ()

    @property
    def meta(self) -> dict:
        return self.report.meta if self.report is not None else {}

    @property
    def idle_s(self) -> float:
        """Seconds since any file of the run last changed."""
        newest_ns = max((mtime_ns for _, _, mtime_ns in self.signature), default=0)
        return time.time() - newest_ns / 1e9

    @property
    def live(self) -> bool:
        """Still being written: status `running` and a file changed recently (a killed run stays `running`)."""
        return self.ok and self.meta.get("status") == "running" and self.idle_s < STALLED_AFTER_S

    @property
    def status(self) -> str:
        if self.bare_trace:
            return f"plain trace, {len(self.report.spans)} span(s) of {len(self.report.ranks)} worker(s)"
        if self.live:
            return "● live"
        if self.meta.get("status") == "running":
            return f"stopped writing {self.idle_s / 60:.0f} min ago (killed?)"
        return self.meta.get("status") or "unknown"


def open_run(root: Path, name: str, report_of=build_report) -> RunEntry:
    """The run `name` (relative to root) with its report (`report_of=trace_folder_report`: a folder of plain
    traces); one that cannot be read keeps its error."""
    path = under_root(root, name)
    try:
        return RunEntry(name, path, report_of(path))
    except (GpuprofError, OSError) as error:
        return RunEntry(name, path, error=str(error))


def catalog(root: Path) -> list[RunEntry]:
    """Every run and every folder of plain traces under root, readable or not, in name order (none that
    a link leads outside root)."""
    runs = ([(path, build_report) for path in find_run_dirs(root)]
            + [(path, trace_folder_report) for path in find_trace_dirs(root)])
    inside = sorted((path, report_of) for path, report_of in runs if path.resolve().is_relative_to(root))
    return [open_run(root, _relative(root, path), report_of) for path, report_of in inside]


@dataclass
class TuneEntry:
    """A `gpuprof tune` folder under the root: `name` is its path relative to the root; `result` its plain
    form (gpuprof.report.tuning reads it), or `error` says why it cannot be read."""

    name: str
    path: Path
    result: dict | None = None
    error: str | None = None

    def run_name(self, trial: dict) -> str:
        """The trial's run as the catalog names it: its folder beside RESULT_FILE (the tune folder may have
        moved since tune wrote the paths)."""
        folder = Path(trial["run_dir"]).name
        return folder if self.name == "." else f"{self.name}/{folder}"


def tune_results(root: Path) -> list[TuneEntry]:
    """Every tune folder under root (one holding RESULT_FILE), readable or not, in name order."""
    entries = []
    for path in sorted(root.rglob(RESULT_FILE)):
        folder = path.parent
        if not folder.resolve().is_relative_to(root):
            continue
        try:
            entries.append(TuneEntry(_relative(root, folder), folder, read_result(path)))
        except GpuprofError as error:
            entries.append(TuneEntry(_relative(root, folder), folder, error=str(error)))
    return entries


def _relative(root: Path, path: Path) -> str:
    return path.relative_to(root).as_posix() if path != root else "."


def _run(path: str):
    """The run the report of `path` read: its query engine answers the charts' few rows."""
    return build_report(path).run


@st.cache_data(show_spinner="Drawing charts…", max_entries=32)
def run_panels(path: str, run_signature: tuple, rank: int) -> list:
    """The Run page's charts for one rank, downsampled (cached: reruns never touch the timelines)."""
    from gpuprof.dashboard.charts import run_panels as build

    return build(_run(path), rank)


@st.cache_data(show_spinner="Drawing the ranks…", max_entries=32)
def rank_heatmaps(path: str, run_signature: tuple) -> dict:
    """The Distributed page's rank x step grids (step time and each phase's share), downsampled by the engine."""
    from gpuprof.dashboard.charts import rank_heatmap_panels

    return rank_heatmap_panels(_run(path).query)


@st.cache_data(show_spinner="Reading the rank…", max_entries=64)
def rank_detail(path: str, run_signature: tuple, rank: int) -> list:
    """One rank's step time against the run's median rank, and its phases: read on demand, one rank's file."""
    from gpuprof.dashboard.charts import rank_detail_panels

    return rank_detail_panels(_run(path).query, rank)


@st.cache_data(show_spinner="Reading the heartbeats…", max_entries=32)
def rank_timeline(path: str, run_signature: tuple):
    """The Distributed page's timeline of every rank's heartbeats, hangs and ends."""
    from gpuprof.dashboard.charts import rank_timeline_panel

    report = build_report(path)
    heartbeats = report.run.query.frame("heartbeats", ["time_unix_s", "rank", "step", "phase", "collective_kind",
                                                      "collective_seq", "where"])
    return rank_timeline_panel(heartbeats, report.hangs, report.rank_outcomes, report.meta.get("start_unix_s"))


@st.cache_data(show_spinner=False, max_entries=16)
def overlay_panels(path_a: str, signature_a: tuple, path_b: str, signature_b: tuple) -> list:
    """Step time and throughput of both runs (rank 0) on shared charts."""
    from gpuprof.dashboard.charts import overlay_panel

    runs = {}
    for label, path, run_signature in (("A", path_a, signature_a), ("B", path_b, signature_b)):
        runs[f"{label} {Path(path).name}"] = _run(path).query.rank_frame("steps", 0)
    return [
        overlay_panel(runs, "step_time_s", "Step time", "ms", scale=1e3),
        overlay_panel(runs, "tokens_per_s", "Throughput", "tokens/s"),
    ]


@st.cache_resource(show_spinner="Analysing trace…", max_entries=16)
def uploaded_trace_report(file: str, file_signature: tuple) -> TraceReport:
    """The report of a trace file uploaded to the Trace page, as `gpuprof trace` makes it (verdict, findings,
    tables); one analysis serves every rerun, not copied per rerun as cache_data would."""
    return build_trace_report(file, jobs=1)


@st.cache_data(show_spinner=False, max_entries=16)
def memory_snapshots(path: str, run_signature: tuple) -> dict[Path, bool]:
    """The run's CUDA memory snapshot files, each with whether an `oom` event names it (else the loop took it)."""
    return snapshot_files(_run(path))


@st.cache_data(show_spinner="Reading the snapshot…", max_entries=8)
def memory_snapshot(path: str, file_signature: tuple) -> MemorySnapshot:
    return read_snapshot(path)


def file_signature(files: list[Path]) -> tuple:
    return tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)


@st.cache_data(show_spinner="Comparing the traces…", max_entries=8)
def traces_diff(path_a: str, signature_a: tuple, path_b: str, signature_b: tuple):
    """Trace B against trace A by kernel and op (two folders of plain traces, their latest spans)."""
    from gpuprof.report.trace_report import diff_of

    return diff_of(path_a, path_b)
