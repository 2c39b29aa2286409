"""Reads a run directory (docs/run-format.md): its meta files, and each rank's streams through streams.py.

    run = load_run("runs/exp1")
    run.meta, run.steps, run.system, run.events, run.layers, run.ranks, run.trace_files, run.trace_windows,
    run.snapshot_files
    discover_runs(root), find_run_dirs(root), run_signature(path)   # what is under a folder; a cache key
    run.query        # DuckDB aggregates over all ranks without loading them (query.py)

Streams load lazily on first access, each into pandas: fine for a few ranks; the analysis
layer asks `run.query` instead, which stays within bounded memory at any number of ranks.
A run still being written (or killed) is read from its JSON lines; a torn last line is
skipped with a warning.
"""

from __future__ import annotations

import json
import logging
import os
from functools import cached_property
from pathlib import Path
from typing import Any

import pandas as pd

from gpuprof.errors import DamagedFileError, NotARunError, RunFormatError
from gpuprof.run import schema
from gpuprof.run.query import RunQuery
from gpuprof.run.streams import left_out, read_stream, with_columns
from gpuprof.validation import misfit

logger = logging.getLogger("gpuprof")
# How many folder levels below a run's own folder `run_signature` looks (traces/steps-A-B/ is two).
SIGNATURE_DEPTH = 2


def load_run(path: str | os.PathLike) -> "Run":
    """The run at `path`; NotARunError or RunFormatError when it cannot be read as one."""
    return Run(path)


def discover_runs(root: str | os.PathLike, max_depth: int = 3) -> list["Run"]:
    """Every readable run under `root` (itself included), newest first; unreadable ones are skipped."""
    runs = []
    for path in find_run_dirs(root, max_depth):
        try:
            runs.append(Run(path))
        except RunFormatError as error:
            logger.warning("gpuprof: skipping %s: %s", path, error)
    return sorted(runs, key=lambda run: run.meta.get("start_unix_s") or 0, reverse=True)


def find_run_dirs(root: str | os.PathLike, max_depth: int = 3) -> list[Path]:
    """The folders under `root` (itself included) that hold a run's meta file, readable or not, in path order."""
    root = Path(root)
    if not root.is_dir():
        raise NotARunError(f"{root} is not a directory")
    return sorted(meta_path.parent for meta_path in _find_run_metas(root, max_depth))


# The files torch.profiler.tensorboard_trace_handler writes, one per worker and span.
PLUGIN_TRACE_SUFFIXES = (".pt.trace.json", ".pt.trace.json.gz")


def find_trace_dirs(root: str | os.PathLike, max_depth: int = 3) -> list[Path]:
    """The folders under `root` (itself included) that hold plain torch.profiler traces as the TensorBoard
    plugin read them (`*.pt.trace.json[.gz]` files, one per worker and span), outside any gpuprof run."""
    root = Path(root)
    found = []

    def visit(folder: Path, depth: int) -> None:
        if (folder / schema.RUN_META).is_file():
            return
        children = sorted(folder.iterdir())
        if any(child.is_file() and child.name.endswith(PLUGIN_TRACE_SUFFIXES) for child in children):
            found.append(folder)
        if depth:
            for child in children:
                if child.is_dir() and not child.name.startswith("."):
                    visit(child, depth - 1)

    if root.is_dir():
        visit(root, max_depth)
    return found


def run_signature(path: str | os.PathLike) -> tuple:
    """Name, size and mtime of every file of the run at `path` (its folder and two levels below:
    rank folders, trace windows): it changes whenever the run is written, so it keys caches."""
    entries: list[tuple] = []
    _scan_files(Path(path), "", SIGNATURE_DEPTH, entries)
    return tuple(sorted(entries))


def _scan_files(folder: Path, prefix: str, depth: int, entries: list) -> None:
    # Dot files are the writer's temporaries, replaced while we look.
    for entry in os.scandir(folder):
        if entry.name.startswith("."):
            continue
        name = prefix + entry.name
        if entry.is_file():
            stat = entry.stat()
            entries.append((name, stat.st_size, stat.st_mtime_ns))
        elif depth and entry.is_dir():
            _scan_files(Path(entry.path), name + "/", depth - 1, entries)


def _find_run_metas(root: Path, max_depth: int):
    if (root / schema.RUN_META).is_file():
        yield root / schema.RUN_META
        return
    if max_depth == 0:
        return
    for child in sorted(root.iterdir()):
        if child.is_dir() and not child.name.startswith("."):
            yield from _find_run_metas(child, max_depth - 1)


def read_meta(path: Path, shape: type) -> dict[str, Any]:
    """A meta file's facts, every field the analysis reads checked against `shape` (gpuprof.run.schema)."""
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RunFormatError(f"{path}: corrupt meta file ({error})") from None
    if not isinstance(meta, dict):
        raise RunFormatError(f"{path}: corrupt meta file (not a JSON object)")
    if shape is schema.RunMeta:
        _check_format(meta, path)  # a newer format may hold other fields: said before they are checked
    problem = misfit(meta, shape)
    if problem is not None:
        raise RunFormatError(f"{path}: corrupt meta file ({problem})")
    return meta


class Run:
    """One recorded run: meta dict plus pandas DataFrames of its record streams (all ranks)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        meta_path = self.path / schema.RUN_META
        if not self.path.is_dir():
            raise NotARunError(f"{self.path} is not a directory")
        if not meta_path.is_file():
            raise NotARunError(f"{self.path} is not a gpuprof run directory (no {schema.RUN_META})")
        self.meta = read_meta(meta_path, schema.RunMeta)

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r})"

    @property
    def name(self) -> str:
        return self.meta.get("name") or self.path.name

    @cached_property
    def ranks(self) -> list[int]:
        ranks = []
        for child in self.path.glob("rank-*"):
            suffix = child.name.removeprefix("rank-")
            if child.is_dir() and suffix.isdigit():
                ranks.append(int(suffix))
        return sorted(ranks)

    @cached_property
    def rank_meta(self) -> dict[int, dict[str, Any]]:
        metas = {}
        for rank in self.ranks:
            path = self.path / schema.rank_dir_name(rank) / schema.RANK_META
            if not path.is_file():
                continue
            try:
                metas[rank] = read_meta(path, schema.RankMeta)
            except RunFormatError as error:  # its records still count; its status is then the run's
                left_out(error, rank, "meta.json")
        return metas

    @property
    def trace_files(self) -> list[Path]:
        traces = self.path / schema.TRACES_DIR
        return sorted(p for p in traces.rglob("*.json*") if p.is_file()) if traces.is_dir() else []

    @property
    def trace_windows(self) -> dict[str, list[Path]]:
        """Trace files per window folder (`steps-10-13`: one file per rank), in step order."""
        windows: dict[str, list[Path]] = {}
        for path in self.trace_files:
            windows.setdefault(path.parent.name, []).append(path)
        return dict(sorted(windows.items(), key=lambda item: _window_start(item[0])))

    @property
    def snapshot_files(self) -> list[Path]:
        """CUDA memory snapshots (`snapshots/rank-R.step-S.pickle`: on out-of-memory, or prof.memory_snapshot())."""
        snapshots = self.path / schema.SNAPSHOTS_DIR
        return sorted(snapshots.glob("*.pickle")) if snapshots.is_dir() else []

    @cached_property
    def query(self):
        """Out-of-core aggregates over every rank's streams (gpuprof/run/query.py): what the
        analysis uses, since `steps`/`system` of hundreds of ranks do not fit in pandas."""
        return RunQuery(self)

    @cached_property
    def steps(self) -> pd.DataFrame:
        return self._stream("steps")

    @cached_property
    def system(self) -> pd.DataFrame:
        return self._stream("system")

    @cached_property
    def events(self) -> pd.DataFrame:
        return self._stream("events")

    @cached_property
    def heartbeats(self) -> pd.DataFrame:
        return self._stream("heartbeats")

    @cached_property
    def layers(self) -> pd.DataFrame:
        return self._stream("layers")

    @cached_property
    def stacks(self) -> pd.DataFrame:
        """The stack sampler's rows: where in the user's code each sample of the training thread landed."""
        return self._stream("stacks")

    def _stream(self, stream: str) -> pd.DataFrame:
        frames = []
        for rank in self.ranks:
            try:
                frames.append(read_stream(self.path / schema.rank_dir_name(rank), stream))
            except DamagedFileError as error:
                left_out(error, rank)
        frames = [frame for frame in frames if not frame.empty]
        if not frames:
            return with_columns(pd.DataFrame(), stream)
        frame = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
        keys = [key for key in schema.SORT_KEYS[stream] if key in frame]
        return frame.sort_values(keys, kind="stable", ignore_index=True)


def _window_start(name: str) -> int:
    first = name.removeprefix("steps-").split("-")[0]
    return int(first) if first.isdigit() else -1


def _check_format(meta: dict[str, Any], path: Path) -> None:
    if meta.get("format") != schema.FORMAT:
        raise RunFormatError(f"{path}: not a gpuprof run meta file (format is {meta.get('format')!r})")
    version = meta.get("format_version")
    if not isinstance(version, int):
        raise RunFormatError(f"{path}: corrupt meta file (format_version is {version!r})")
    if version > schema.FORMAT_VERSION:
        raise RunFormatError(
            f"{path}: format version {version} was written by a newer gpuprof "
            f"(this one reads up to {schema.FORMAT_VERSION}); upgrade gpuprof"
        )
