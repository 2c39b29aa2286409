"""Everything the pages show comes through here: runs found under the root, loaded, summarised
and diagnosed by the analysis layer, cached per run and re-read only when its files change.

The cache key of a run is its path plus a signature of its files (name, size, mtime), so a
live run is re-read as it grows and a finished one is read once. Paths given by the user
(a run picked in the sidebar or named in the URL) are resolved and must lie under the root:
the dashboard reads nothing outside the folder it was given.
"""

from __future__ import annotations

import os
import re
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import streamlit as st

from gpuprof.dashboard import DEFAULT_REFRESH_S, MIN_REFRESH_S, REFRESH_ENV, RUNS_DIR_ENV, default_runs_dir
from gpuprof.errors import GpuprofError

DISCOVERY_DEPTH = 4
# A run whose files have not changed for this long is no longer refreshed as live.
STALLED_AFTER_S = 120.0
RANK_DIR = re.compile(r"rank-\d+")
RANK_IN_NAME = re.compile(r"rank[-_]?\d+", re.IGNORECASE)


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


def signature(path: Path) -> tuple:
    """Name, size and mtime of every file in a run's top two levels: changes whenever the run is written."""
    entries = []
    for folder in (path, *sorted(p for p in path.iterdir() if p.is_dir())):
        for entry in os.scandir(folder):
            if entry.is_file():
                stat = entry.stat()
                entries.append((f"{folder.name}/{entry.name}", stat.st_size, stat.st_mtime_ns))
    return tuple(sorted(entries))


@dataclass
class RunEntry:
    """A run found under the root: `name` is its path relative to the root (also its id in the URL)."""

    name: str
    path: Path
    signature: tuple = ()
    meta: dict = field(default_factory=dict)
    summary: object = None
    findings: list = field(default_factory=list)
    notes: tuple = ()
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

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
        if self.live:
            return "● live"
        if self.meta.get("status") == "running":
            return f"stopped writing {self.idle_s / 60:.0f} min ago (killed?)"
        return self.meta.get("status") or "unknown"

    def load(self):
        """The run: its meta, and its streams through `run.query` (nothing is read until asked)."""
        return load(str(self.path))


def _run_dirs(root: Path) -> list[Path]:
    """Folders under root holding a run's meta file, readable or not (the reader says which)."""
    from gpuprof.run.reader import discover_runs
    from gpuprof.run.schema import RUN_META

    readable = {run.path.resolve() for run in discover_runs(root)}
    candidates = {
        meta.parent.resolve() for depth in range(1, DISCOVERY_DEPTH + 1)
        for meta in root.glob("/".join(["*"] * (depth - 1) + [RUN_META]))
        if not RANK_DIR.fullmatch(meta.parent.name)
    }
    return sorted(path for path in readable | candidates if path.is_relative_to(root))


def load(path: str):
    """The run at `path`: meta only; pages ask its query engine for the few rows they draw, so no
    page ever holds every stream of every rank (a run of hundreds of ranks would not fit)."""
    from gpuprof.run.reader import load_run

    return load_run(path)


@st.cache_data(show_spinner="Diagnosing…", max_entries=32)
def analyse(path: str, run_signature: tuple):
    """(meta, summary, ranked findings, reader warnings) of the run at `path`, from the analysis layer
    (cached until its files change). Small enough to cache and copy cheaply.

    The reader warns about what it had to skip (a torn last line of a killed run, a damaged rank
    file); the pages show it.
    """
    from gpuprof.diagnoses.context import RunContext
    from gpuprof.diagnoses.registry import diagnose_context

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        context = RunContext.of(load(path))
        findings = diagnose_context(context)
    notes = tuple(dict.fromkeys(str(warning.message) for warning in caught if "gpuprof" in str(warning.message)))
    return context.meta, context.summary, findings, notes


def open_run(root: Path, name: str) -> RunEntry:
    """The run `name` (relative to root) loaded and diagnosed; a run that cannot be read keeps its error."""
    path = under_root(root, name)
    try:
        run_signature = signature(path)
        meta, summary, findings, notes = analyse(str(path), run_signature)
    except (GpuprofError, OSError) as error:
        return RunEntry(name, path, error=str(error))
    return RunEntry(name, path, run_signature, meta, summary, findings, notes)


def catalog(root: Path) -> list[RunEntry]:
    """Every run under root, readable or not, in name order."""
    return [open_run(root, _relative(root, path)) for path in sorted(_run_dirs(root))]


def _relative(root: Path, path: Path) -> str:
    return path.relative_to(root).as_posix() if path != root else "."


@st.cache_data(show_spinner="Drawing charts…", max_entries=32)
def run_panels(path: str, run_signature: tuple, rank: int) -> list:
    """The Run page's charts for one rank, downsampled (cached: reruns never touch the timelines)."""
    from gpuprof.dashboard.charts import run_panels as build

    return build(load(path), rank)


@st.cache_data(show_spinner="Drawing the ranks…", max_entries=32)
def rank_heatmaps(path: str, run_signature: tuple) -> dict:
    """The Distributed page's rank x step grids (step time and each phase's share), downsampled by the engine."""
    from gpuprof.dashboard.charts import rank_heatmap_panels

    return rank_heatmap_panels(load(path).query)


@st.cache_data(show_spinner="Reading the rank…", max_entries=64)
def rank_detail(path: str, run_signature: tuple, rank: int) -> list:
    """One rank's step time against the run's median rank, and its phases: read on demand, one rank's file."""
    from gpuprof.dashboard.charts import rank_detail_panels

    return rank_detail_panels(load(path).query, rank)


@st.cache_data(show_spinner="Comparing…", max_entries=16)
def comparison(path_a: str, signature_a: tuple, path_b: str, signature_b: tuple):
    """The analysis layer's comparison of run B against run A."""
    from gpuprof.analysis.run import compare

    return compare(load(path_a), load(path_b))


@st.cache_data(show_spinner=False, max_entries=16)
def overlay_panels(path_a: str, signature_a: tuple, path_b: str, signature_b: tuple) -> list:
    """Step time and throughput of both runs (rank 0) on shared charts."""
    from gpuprof.dashboard.charts import overlay_panel

    runs = {}
    for label, path, run_signature in (("A", path_a, signature_a), ("B", path_b, signature_b)):
        runs[f"{label} {Path(path).name}"] = load(path).query.rank_frame("steps", 0)
    return [
        overlay_panel(runs, "step_time_s", "Step time", "ms", scale=1e3),
        overlay_panel(runs, "tokens_per_s", "Throughput", "tokens/s"),
    ]


TRACE_TABLES = (
    "overview", "temporal_breakdown", "step_breakdown", "kernel_type_breakdown", "top_kernels",
    "idle_by_stream", "comm_comp_overlap", "launch_summary", "host_device_syncs", "tensor_core_share",
    "rank_spread", "stragglers", "top_cpu_ops",
)


@st.cache_data(show_spinner="Analysing trace…", max_entries=16)
def trace_tables(files: tuple[str, ...], file_signature: tuple) -> dict:
    """Every table of the trace analyzer for these files (one window, all its ranks)."""
    from gpuprof.analysis.trace import TraceAnalysis

    analysis = TraceAnalysis(list(files))
    return {name: getattr(analysis, name)() for name in TRACE_TABLES}


def file_signature(files: list[Path]) -> tuple:
    return tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)


def trace_windows(entry: RunEntry) -> dict[str, list[Path]]:
    """The run's trace files grouped by window: the same path but for the rank makes one window
    (`traces/steps-10-12/rank-*.pt.trace.json.gz`)."""
    from gpuprof.run.reader import load_run
    from gpuprof.run.schema import TRACES_DIR

    windows: dict[str, list[Path]] = {}
    # a listing of the traces folder: a fresh reader (meta only), not a copy of the cached timelines
    for file in load_run(entry.path).trace_files:
        relative = Path(file).relative_to(entry.path / TRACES_DIR).as_posix()
        windows.setdefault(RANK_IN_NAME.sub("rank-*", relative), []).append(Path(file))
    return windows


def communication_by_rank(entry: RunEntry) -> dict:
    """The trace analyzer's per-rank step spread, stragglers and overlap, over the run's first trace window."""
    windows = trace_windows(entry)
    if not windows:
        return {}
    files = next(iter(windows.values()))
    tables = trace_tables(tuple(map(str, files)), file_signature(files))
    return {name: tables[name] for name in ("rank_spread", "stragglers", "comm_comp_overlap")}
