"""Load torch.profiler (Kineto) Chrome traces into one columnar DataFrame per rank.

Input: a `.json` or `.json.gz` file (gzip is detected from the content, not the name),
a directory of per-rank files, or a list of files. The JSON is read in blocks
(jsonstream.py) and decoded with msgspec straight into typed structs that keep only the
fields gpuprof uses; each block becomes compact columns (categorical codes, int64
microseconds) before the next is read, so memory is about the final DataFrame plus one
block, never the whole document.

Time: Chrome-trace timestamps are microseconds (`displayTimeUnit` only affects
display and is ignored, as in HTA). Kineto writes nanosecond fractions; like HTA we
round every complete event inward to whole microseconds (start up, end down) so that
back-to-back events never overlap by a rounding error, then make times relative to
the earliest event of all ranks.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pandas as pd

from gpuprof.analysis.trace.classify import DEVICE_KINDS, event_kinds, kernel_types
from gpuprof.analysis.trace.jsonstream import decode_trace
from gpuprof.errors import TraceFormatError
from gpuprof.run.schema import RUN_META

TRACE_SUFFIXES = (".json", ".json.gz")
MAX_TIME_US = 1e17  # about 3,000 years: anything larger is not a timestamp
_RANK_IN_NAME_RE = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)
# tensorboard_trace_handler's file names: WORKER.TIMESTAMP.pt.trace.json[.gz] (ms in torch 1.x, ns since).
PLUGIN_FILE_RE = re.compile(r"^(?P<worker>.+)\.(?P<timestamp>\d+)\.pt\.trace\.json(\.gz)?$")
MEMORY_EVENT = "[memory]"
MEMORY_FIGURES = ("bytes", "total_allocated_bytes", "total_reserved_bytes")
# RankTrace.memory: one row per "[memory]" event, in time order (bytes < 0: a free).
MEMORY_COLUMNS = ["ts_us", "ts_frac_ns", "pid", "tid", "device", *MEMORY_FIGURES]


class _Args(msgspec.Struct, gc=False, frozen=True):
    external_id: int | None = msgspec.field(default=-1, name="External id")
    correlation: int | None = -1
    stream: int | str | None = -1
    device: int | str | None = -1
    # record_shapes=True (any shape: shown as written); with_stack=True in torch < 1.11 (later: python_function events).
    input_dims: Any = msgspec.field(default=None, name="Input Dims")
    call_stack: str | None = msgspec.field(default=None, name="Call stack")
    # Kineto's occupancy fields of CUDA kernels (NaN, not None, when absent: a list of floats converts fastest).
    blocks_per_sm: float | str | None = msgspec.field(default=math.nan, name="blocks per SM")
    occupancy_pct: float | str | None = msgspec.field(default=math.nan, name="est. achieved occupancy %")
    # profile_memory=True: the "[memory]" instant events.
    bytes: int | float | str | None = msgspec.field(default=None, name="Bytes")
    total_allocated: int | float | str | None = msgspec.field(default=None, name="Total Allocated")
    total_reserved: int | float | str | None = msgspec.field(default=None, name="Total Reserved")
    device_type: int | str | None = msgspec.field(default=None, name="Device Type")
    device_id: int | str | None = msgspec.field(default=None, name="Device Id")


_NO_ARGS = _Args()


class _Event(msgspec.Struct, gc=False):
    ph: str | None = None
    name: str | int | None = None
    cat: str | None = None
    ts: float | None = None
    dur: float | None = None
    pid: int | str | None = None
    tid: int | str | None = None
    args: _Args | None = _NO_ARGS


class _DistributedInfo(msgspec.Struct, gc=False):
    rank: int | str | None = None
    world_size: int | str | None = None
    backend: str | None = None


class _TraceDocument(msgspec.Struct, gc=False):
    traceEvents: list[_Event] | None = None  # noqa: N815 - the Chrome-trace key
    distributedInfo: _DistributedInfo | None = None  # noqa: N815
    deviceProperties: list[dict] | None = None  # noqa: N815


@dataclass
class RankTrace:
    """The complete ("X") events of one rank, one row per event, times in integer µs; ts_frac_ns and
    end_frac_ns: the recorded time less the rounded one, in ns (recorded_ns)."""

    rank: int
    events: pd.DataFrame
    path: Path
    world_size: int | None = None
    backend: str | None = None
    device_properties: list[dict] = field(default_factory=list)
    # profile_memory=True's allocations and frees (MEMORY_COLUMNS); empty when not recorded.
    memory: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=MEMORY_COLUMNS))

    @property
    def has_device_activity(self) -> bool:
        return bool(self.events["is_device"].any())


@dataclass
class Trace:
    """All ranks of one trace; `base_ts_us` is the absolute time of relative time 0."""

    ranks: dict[int, RankTrace]
    base_ts_us: int


def recorded_ns(frame: pd.DataFrame, time: str = "ts") -> np.ndarray:
    """Column `time`_us of RankTrace.events or .memory as recorded: ns from the trace's base, not rounded."""
    return frame[f"{time}_us"].to_numpy() * 1000 + frame[f"{time}_frac_ns"].to_numpy()


def trace_files(path) -> list[Path]:
    """The trace files named by `path`: a file, a directory of them, or a list of files."""
    if isinstance(path, (list, tuple)):
        files = [Path(p) for p in path]
    else:
        path = Path(path)
        if (path / RUN_META).is_file():
            raise TraceFormatError(f"{path} is a gpuprof run, not a torch.profiler trace: `gpuprof analyze {path}` "
                                   f"reports it, and its trace windows are the folders under {path / 'traces'}")
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(TRACE_SUFFIXES))
            if not files:
                raise TraceFormatError(f"{path}: no .json or .json.gz trace files in this directory")
        else:
            files = [path]
    for file in files:
        if not file.is_file():
            raise TraceFormatError(f"{file}: no such trace file")
    if not files:
        raise TraceFormatError("no trace files given")
    return files


def trace_spans(files: list[Path]) -> list[list[Path]]:
    """The files of one folder as trace windows ("spans"), each a list of one file per worker (rank):
    tensorboard_trace_handler writes a file per worker each time the profiler's schedule completes a
    cycle, so a worker's n-th file (by timestamp) is the n-th span. Files none of which the handler named
    are one window; beside files it named, the others are in no span (the report says which)."""
    matched = [PLUGIN_FILE_RE.match(file.name) for file in files]
    if not any(matched):
        return [list(files)]
    by_worker: dict[str, list[tuple[int, Path]]] = {}
    for match, file in zip(matched, files):
        if match:
            by_worker.setdefault(match["worker"], []).append((int(match["timestamp"]), file))
    ordered = [[file for _, file in sorted(items)] for items in by_worker.values()]
    n_spans = max(len(worker_files) for worker_files in ordered)
    return [[worker_files[span] for worker_files in ordered if span < len(worker_files)] for span in range(n_spans)]


def load_trace(path, fallback_rank: int | None = None) -> Trace:
    """Read every rank's file; raise TraceFormatError for anything that is not a usable trace.

    A file that names no rank (no distributedInfo, no rank in its name) takes its position in
    the list, or `fallback_rank` (a worker given one file of many passes the file's position)."""
    raw = [_read_file(file) for file in trace_files(path)]
    ranks = _assign_ranks(raw, fallback_rank)
    base = min(r["ts_min"] for r in raw)
    traces = {rank: _rank_trace(rank, item, base) for rank, item in ranks.items()}
    return Trace(ranks=dict(sorted(traces.items())), base_ts_us=int(base))


def _read_file(file: Path) -> dict:
    columns = _Columns(file)
    document = decode_trace(file, _Event, _TraceDocument, columns.add)
    if columns.count == 0:
        raise TraceFormatError(f"{file}: empty trace (no complete 'X' events)")
    info = document.distributedInfo or _DistributedInfo()
    complete, memory = columns.finish()
    return {
        "file": file,
        "columns": complete,
        "memory": memory,
        "ts_min": columns.start_min,
        "rank": _as_int(info.rank) if _as_int(info.rank) >= 0 else None,
        "world_size": _as_int(info.world_size) if _as_int(info.world_size) > 0 else None,
        "backend": info.backend,
        "device_properties": document.deviceProperties or [],
    }


class _Columns:
    """Accumulates the complete events of each decoded chunk as compact arrays."""

    EVENT_STRINGS = ("name", "cat", "pid", "tid")
    STRINGS = (*EVENT_STRINGS, "input_dims", "stack")
    INTEGERS = ("stream", "device", "correlation", "external_id")
    FLOATS = ("blocks_per_sm", "occupancy_pct")
    DTYPES = {**dict.fromkeys(STRINGS, np.int32), **dict.fromkeys(INTEGERS, np.int64),
              **dict.fromkeys(FLOATS, np.float32), "start_abs": np.float64, "end_abs": np.float64,
              "ts_frac_ns": np.int16, "end_frac_ns": np.int16}

    def __init__(self, file: Path):
        self.file = file
        self.codes = {key: {None: -1} for key in self.STRINGS}
        self.parts = {key: _GrowingArray(dtype) for key, dtype in self.DTYPES.items()}
        self.count = 0
        self.start_min = np.inf
        self.memory = _MemoryColumns(self.codes)

    def add(self, events: list[_Event], offset: int) -> None:
        self.memory.add([e for e in events if e.ph == "i" and e.name == MEMORY_EVENT and e.ts is not None])
        complete = [e for e in events if e.ph == "X" and e.cat != "Trace"]
        if not complete:
            return
        ts = np.array([e.ts for e in complete], dtype=np.float64)
        dur = np.array([e.dur for e in complete], dtype=np.float64)
        bad = np.flatnonzero(~(np.abs(ts) < MAX_TIME_US) | ~(np.abs(dur) < MAX_TIME_US))
        missing_name = [i for i, e in enumerate(complete) if e.name is None]
        if len(bad) or missing_name:
            event = complete[min([*bad.tolist(), *missing_name])]
            raise TraceFormatError(
                f"{self.file}: complete event {event.name!r} at ts {event.ts} lacks 'name', 'ts' or 'dur' "
                "or has a time out of range"
            )
        # Whole µs, rounded inward as HTA does, not ending before the start; float64 is exact for these magnitudes.
        start = np.ceil(ts)
        end = np.maximum(np.floor(ts + dur), start)
        self.parts["start_abs"].append(start)
        self.parts["end_abs"].append(end)
        self.parts["ts_frac_ns"].append(_frac_ns(ts, start))
        self.parts["end_frac_ns"].append(_frac_ns(np.maximum(ts + dur, ts), end))
        self.start_min = min(self.start_min, float(start.min()))
        for key in self.EVENT_STRINGS:
            self.parts[key].append(_codes(list(map(attrgetter(key), complete)), self.codes[key]))
        args = [e.args or _NO_ARGS for e in complete]
        for key in self.INTEGERS:
            self.parts[key].append(_int_column(list(map(attrgetter(key), args))))
        for key in self.FLOATS:
            self.parts[key].append(_float_column(list(map(attrgetter(key), args)), np.float32))
        for key, texts in (("input_dims", _shape_texts(args)), ("stack", list(map(attrgetter("call_stack"), args)))):
            self.parts[key].append(_codes(texts, self.codes[key]))
        self.count += len(complete)

    def finish(self) -> tuple[dict, dict]:
        """The complete events' columns, and the memory events' (empty without any)."""
        columns = {key: part.array() for key, part in self.parts.items()}
        for key in self.STRINGS:
            columns[key] = _categorical(columns[key], self.codes[key])
        return columns, self.memory.finish(lambda codes, key: _categorical(codes, self.codes[key]))


class _GrowingArray:
    """A column grown block by block in one buffer, which reallocation grows in place: arrays of each
    block concatenated at the end would leave their freed memory fragmented on the heap, where it
    still counts in the process's peak memory."""

    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)
        self.buffer = bytearray()

    def append(self, values: np.ndarray) -> None:
        self.buffer += np.ascontiguousarray(values, dtype=self.dtype).data

    def array(self) -> np.ndarray:
        """The values so far, sharing the buffer (which can grow no more)."""
        return np.frombuffer(self.buffer, dtype=self.dtype)


class _MemoryColumns:
    """The "[memory]" instant events of profile_memory=True: one allocation (bytes > 0) or free each,
    with the allocator's totals after it (absent before torch 1.10: NaN)."""

    THREAD = ("pid", "tid")

    def __init__(self, codes: dict):
        self.codes = codes  # the complete events' code tables of pid and tid
        self.parts = {"ts_abs": _GrowingArray(np.float64), **{key: _GrowingArray(np.int32) for key in self.THREAD},
                      **{key: _GrowingArray(np.float64) for key in MEMORY_FIGURES}}
        self.device_parts: list[list[str]] = []

    def add(self, events: list[_Event]) -> None:
        if not events:
            return
        args = [e.args or _NO_ARGS for e in events]
        self.parts["ts_abs"].append(np.array([e.ts for e in events], dtype=np.float64))
        for key in self.THREAD:
            self.parts[key].append(_codes(list(map(attrgetter(key), events)), self.codes[key]))
        for key, column in (("bytes", "bytes"), ("total_allocated_bytes", "total_allocated"),
                            ("total_reserved_bytes", "total_reserved")):
            self.parts[key].append(_float_column(list(map(attrgetter(column), args)), np.float64))
        self.device_parts.append([_device_name(a.device_type, a.device_id) for a in args])

    def finish(self, categorical) -> dict:
        """`categorical(codes, key)`: pid and tid as the complete events' columns have them."""
        if not self.device_parts:
            return {}
        columns = {key: part.array() for key, part in self.parts.items()}
        for key in self.THREAD:
            columns[key] = categorical(columns[key], key)
        columns["device"] = pd.Categorical([name for part in self.device_parts for name in part])
        return columns


def _frac_ns(time: np.ndarray, rounded: np.ndarray) -> np.ndarray:
    """Kineto's ns that rounding to whole µs dropped (under 1000; exact: `time` is near `rounded`)."""
    return np.rint((time - rounded) * 1000).astype(np.int16)


def _device_name(device_type, device_id) -> str:
    """c10's DeviceType numbering: 0 is the CPU, 1 CUDA (ROCm reports as CUDA)."""
    kind = {0: "cpu", 1: "cuda"}.get(_as_int(device_type), f"device type {device_type}")
    index = _as_int(device_id)
    return kind if kind == "cpu" or index < 0 else f"{kind}:{index}"


def _shape_texts(args: list[_Args]) -> list[str | None]:
    """The recorded input shapes as text, e.g. "[[8, 32], [64, 32], [64]]" (None where not recorded)."""
    shapes = list(map(attrgetter("input_dims"), args))
    return shapes if shapes.count(None) == len(shapes) else [None if v is None else str(v) for v in shapes]


def _float_column(values: list, dtype) -> np.ndarray:
    """Numbers, NaN where absent (numpy reads None as NaN) or not a number."""
    try:
        return np.array(values, dtype=dtype)
    except (TypeError, ValueError):
        return np.array([_as_float(v) for v in values], dtype=dtype)


def _as_float(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return np.nan


def _as_int(value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1


def _int_column(values: list) -> np.ndarray:
    """Integers, -1 where absent; numeric strings (as some exporters write streams) are parsed."""
    try:
        return np.array(values, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        return np.array([_as_int(v) for v in values], dtype=np.int64)


def _assign_ranks(raw: list[dict], fallback_rank: int | None = None) -> dict[int, dict]:
    ranks: dict[int, dict] = {}
    for position, item in enumerate(raw):
        rank = item["rank"]
        if rank is None:
            match = _RANK_IN_NAME_RE.search(item["file"].name)
            unnamed = fallback_rank if fallback_rank is not None else (0 if len(raw) == 1 else position)
            rank = int(match.group(1)) if match else unnamed
        if rank in ranks:
            raise TraceFormatError(
                f"two trace files for rank {rank} ({ranks[rank]['file']}, {item['file']}): "
                "pass one file, or a directory with one file per rank"
            )
        ranks[rank] = item
    return ranks


def _codes(values: list, codes_by_value: dict) -> np.ndarray:
    """Integer codes of `values`, extending the shared value -> code table (None is -1).

    pandas' hash-based factorize does the per-event work in C; only distinct values
    go through the Python table."""
    if values.count(None) == len(values):
        return np.full(len(values), -1, dtype=np.int32)
    local_codes, uniques = pd.factorize(np.array(values, dtype=object), use_na_sentinel=True)
    table = np.array([codes_by_value.setdefault(v, len(codes_by_value) - 1) for v in uniques] + [-1], dtype=np.int32)
    return table[local_codes]  # local code -1 (missing) picks the trailing -1


def _categorical(codes: np.ndarray, codes_by_value: dict) -> pd.Categorical:
    """The values as strings; values equal as strings (1 and "1") share one category."""
    labels = [str(v) for v in codes_by_value if v is not None]
    unique = list(dict.fromkeys(labels))
    if len(unique) < len(labels):
        remap = np.array([unique.index(label) for label in labels] + [-1], dtype=np.int32)
        codes = remap[codes]  # code -1 picks the trailing -1
    return pd.Categorical.from_codes(codes, categories=unique)


def _rank_trace(rank: int, item: dict, base: float) -> RankTrace:
    """The rank's events as a DataFrame in time order; column arrays are released as they are used."""
    columns = item.pop("columns")
    order = np.argsort(columns["start_abs"], kind="stable")
    start = (columns.pop("start_abs")[order] - base).astype(np.int64)
    end = (columns.pop("end_abs")[order] - base).astype(np.int64)
    data = {"ts_us": start, "end_us": end, "dur_us": end - start}
    for key in ("ts_frac_ns", "end_frac_ns"):
        data[key] = columns.pop(key)[order]
    for key in _Columns.STRINGS:
        values = columns.pop(key)
        data[key] = pd.Categorical.from_codes(values.codes[order], dtype=values.dtype)
    for key in (*_Columns.INTEGERS, *_Columns.FLOATS):
        data[key] = columns.pop(key)[order]
    frame = pd.DataFrame(data, copy=False)
    frame["kind"] = event_kinds(frame["cat"])
    frame["is_device"] = frame["kind"].isin(DEVICE_KINDS).to_numpy()
    frame["kernel_type"] = kernel_types(frame["name"], frame["kind"])
    return RankTrace(
        rank=rank,
        events=frame,
        path=item["file"],
        world_size=item["world_size"],
        backend=item["backend"],
        device_properties=item["device_properties"],
        memory=_memory_frame(item.pop("memory"), base),
    )


def _memory_frame(columns: dict, base: float) -> pd.DataFrame:
    if not columns:
        return pd.DataFrame(columns=MEMORY_COLUMNS)
    order = np.argsort(columns["ts_abs"], kind="stable")
    ts = columns.pop("ts_abs")[order]
    data = {"ts_us": (np.ceil(ts) - base).astype(np.int64), "ts_frac_ns": _frac_ns(ts, np.ceil(ts))}
    for key in MEMORY_COLUMNS[2:]:
        data[key] = columns[key][order]
    return pd.DataFrame(data)
