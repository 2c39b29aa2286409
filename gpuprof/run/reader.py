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
import warnings
from functools import cached_property
from pathlib import Path
from typing import Any

import pandas as pd

from gpuprof.errors import DamagedFileError, NotARunError, RunFormatError
from gpuprof.run import schema
from gpuprof.run.query import RunQuery
from gpuprof.run.streams import left_out, read_stream, refuse_without_readable_steps, with_columns
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


# A Chrome trace's event array is named within its first bytes (after the profiler's few header fields).
TRACE_SNIFF_BYTES = 1 << 18


def unlisted_trace_files(root: str | os.PathLike, max_depth: int = 3) -> list[Path]:
    """The Chrome traces under `root` that find_trace_dirs leaves out: `.json[.gz]` files holding `traceEvents`,
    outside gpuprof runs, in folders with no `*.pt.trace.json[.gz]` file (export_chrome_trace's, a renamed one)."""
    root = Path(root)
    found: list[Path] = []

    def visit(folder: Path, depth: int) -> None:
        if (folder / schema.RUN_META).is_file() or lost_meta_error(folder) is not None:
            return
        children = sorted(folder.iterdir())
        files = [child for child in children if child.is_file() and child.name.endswith((".json", ".json.gz"))]
        if not any(file.name.endswith(PLUGIN_TRACE_SUFFIXES) for file in files):
            found.extend(file for file in files if _names_trace_events(file))
        for child in children if depth else ():
            if child.is_dir() and not child.name.startswith("."):
                visit(child, depth - 1)

    if root.is_dir():
        visit(root, max_depth)
    return found


def unlisted_traces_note(root: str | os.PathLike, max_depth: int = 3) -> str | None:
    """One line on the traces under `root` that the dashboard does not list, and why; None when there are none."""
    files = unlisted_trace_files(root, max_depth)
    if not files:
        return None
    named = ", ".join(file.relative_to(root).as_posix() for file in files[:5]) + (" ..." if len(files) > 5 else "")
    return (f"{len(files)} trace file(s) not listed: {named}. Only gpuprof runs and folders of "
            "tensorboard_trace_handler's traces (`NAME.pt.trace.json[.gz]`) are listed; rename a trace to end in "
            "`.pt.trace.json`, or read it with `gpuprof trace FILE`.")


def file_bytes(path: str | os.PathLike) -> bytes:
    """A run's or a trace's file as it is on disk, to hand to people (the dashboard's downloads)."""
    return Path(path).read_bytes()


def _names_trace_events(file: Path) -> bool:
    import gzip

    try:
        with open(file, "rb") as raw:
            gzipped = raw.read(2) == b"\x1f\x8b"
        with (gzip.open(file, "rb") if gzipped else open(file, "rb")) as handle:
            return b'"traceEvents"' in handle.read(TRACE_SNIFF_BYTES)
    except (OSError, EOFError):
        return False


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
    if (root / schema.RUN_META).is_file() or lost_meta_error(root) is not None:  # a lost one is said when read
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
            raise lost_meta_error(self.path) or NotARunError(
                f"{self.path} is not a gpuprof run directory (no {schema.RUN_META})")
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
        for line in missing_steps_files(self):  # said once, where the ranks are read (the report's notes)
            warnings.warn(f"gpuprof: {line}", stacklevel=3)
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
        frames, damaged = [], []
        for rank in self.ranks:
            try:
                frames.append(read_stream(self.path / schema.rank_dir_name(rank), stream))
            except DamagedFileError as error:
                left_out(error, rank)
                damaged.append(error)
        if stream == "steps":
            refuse_without_readable_steps(damaged, len(frames))
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


# --- files the run's meta says were written and are not there ---------------------------------------------

def missing_steps_files(run: Run) -> list[str]:
    """Each rank of the run's world whose folder or steps file is gone, with what the meta files say it should
    hold, for people. A rank's steps file exists from the moment it starts recording (empty until its first step),
    so a missing one was lost or deleted, never a loop that did not step."""
    world = int(run.meta.get("world_size") or 1)
    lines = []
    for rank in range(world):
        rank_dir = run.path / schema.rank_dir_name(rank)
        if not rank_dir.is_dir():
            lines.append(f"{rank_dir}/ is missing: {schema.RUN_META} says the run had {world} rank(s) and "
                         f"{_status_words(run.meta.get('status'))}, so this folder should hold rank {rank}'s "
                         "meta and records (lost, or that rank never started recording)")
        elif not any((rank_dir / f"steps.{kind}").is_file() for kind in ("parquet", "jsonl")):
            said, status = _rank_said(rank_dir, rank, run.meta)
            name = "steps.jsonl" if status == "running" else "steps.parquet"
            lines.append(f"{rank_dir / name} is missing: {said}, so this file should hold its step records "
                         "(one row per optimizer step)")
    return lines


def refuse_without_steps_files(run: Run) -> None:
    """RunFormatError naming the missing files when no rank of the world has a steps file: the run cannot be
    analysed, and saying it "recorded no step" would blame the loop for a lost file."""
    world = int(run.meta.get("world_size") or 1)
    missing = missing_steps_files(run)
    if missing and len(missing) == world:
        shown = "; ".join(missing[:3]) + (f"; and {len(missing) - 3} more rank(s)" if len(missing) > 3 else "")
        raise RunFormatError(f"{shown}. Restore {'it' if len(missing) == 1 else 'them'} from a copy, "
                             "or record the run again")


def lost_meta_error(path: Path) -> RunFormatError | None:
    """The error of a run folder whose own meta.json is gone while rank 0's is there (rank 0 writes the run's
    first, so it was lost or deleted); None for a folder that is no run."""
    rank_dir = path / schema.rank_dir_name(0)
    if (path / schema.RUN_META).is_file() or not (rank_dir / schema.RANK_META).is_file():
        return None
    said, _ = _rank_said(rank_dir, 0, {})
    return RunFormatError(f"{path / schema.RUN_META} is missing: {said}, so this folder is a gpuprof run whose "
                          f"{schema.RUN_META} (its format, devices, model and config) was lost. Restore it from a "
                          "copy, or record the run again")


def _rank_said(rank_dir: Path, rank: int, run_meta: dict) -> tuple[str, str | None]:
    """What the rank's meta.json (else the run's) says of the rank, in words, and its status."""
    try:
        meta, source = read_meta(rank_dir / schema.RANK_META, schema.RankMeta), f"{rank_dir.name}/{schema.RANK_META}"
    except RunFormatError:
        if not run_meta:  # neither meta file can be read: only the folder speaks
            return f"{rank_dir.name}/ holds rank {rank}'s records", None
        meta, source = run_meta, schema.RUN_META
    status = meta.get("status")
    world = meta.get("world_size") or run_meta.get("world_size") or 1
    start, end = meta.get("start_unix_s"), meta.get("end_unix_s")
    took = f" after {end - start:.1f} s" if status != "running" and start is not None and end is not None else ""
    return f"{source} says rank {rank} of {world} {_status_words(status)}{took}", status


def _status_words(status: str | None) -> str:
    return {"running": "was still running (or was killed)", None: "ran"}.get(status, status)
