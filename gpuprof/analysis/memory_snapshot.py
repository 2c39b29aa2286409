"""CUDA memory snapshots (`torch.cuda.memory._snapshot()`, pickled): the allocation timeline and
the largest live allocations, as DataFrames.

A snapshot holds the allocator's `segments` (cudaMalloc'd memory, split into blocks, each live
one with the stack that allocated it) and, when the loop ran with `memory_history=True`, the
`device_traces`: every alloc / free_completed / segment_alloc / segment_free / oom the allocator
saw, newest last, each with its stack (torch/cuda/_memory_viz.py reads the same format).
"""

from __future__ import annotations

import pickle
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from gpuprof.errors import SnapshotFormatError

TOP_ALLOCATIONS = 20
LIVE_STATES = ("active_allocated", "active_awaiting_free")
# The change each allocator action makes to (allocated, reserved) bytes.
ACTION_DELTAS = {"alloc": (1, 0), "free_completed": (-1, 0), "segment_alloc": (0, 1), "segment_free": (0, -1), "oom": (0, 0)}
TIMELINE_COLUMNS = ["device", "entry", "time_us", "action", "size_bytes", "allocated_bytes", "reserved_bytes",
                    "top_frame"]
TOP_COLUMNS = ["device", "size_bytes", "requested_bytes", "state", "stream", "top_frame", "stack"]
# A frame of the profiler-derived format carries its place in its name: "path/file.py(12): func".
PLACE_IN_NAME = re.compile(r"^(?P<file>\S+\.py)\((?P<line>\d+)\): (?P<func>.+)$")
STACK_FRAMES = 8


@dataclass
class MemorySnapshot:
    """One snapshot: `timeline` (one row per allocator action, empty without memory history) and
    `top_allocations` (the largest live blocks); byte totals at the moment it was taken."""

    timeline: pd.DataFrame
    top_allocations: pd.DataFrame
    allocated_bytes: int
    reserved_bytes: int
    segments: int

    @property
    def has_history(self) -> bool:
        return not self.timeline.empty

    @property
    def failed_request_bytes(self) -> int | None:
        """What the last request the allocator could not meet asked for; None when none failed."""
        failed = self.timeline.loc[self.timeline["action"] == "oom", "size_bytes"]
        return int(failed.iloc[-1]) if len(failed) else None


class _DataOnly(pickle.Unpickler):
    """A snapshot is dicts, lists, strings and numbers: refuse anything that would run code."""

    def find_class(self, module, name):
        raise SnapshotFormatError(f"not a memory snapshot (it references {module}.{name})")


def load_snapshot(path: str | Path) -> dict:
    """The snapshot dict pickled at `path`; SnapshotFormatError when it is not one."""
    try:
        with open(path, "rb") as handle:
            snapshot = _DataOnly(handle).load()
    except SnapshotFormatError:
        raise
    except (OSError, pickle.UnpicklingError, EOFError, ValueError) as error:
        raise SnapshotFormatError(f"{path}: not a readable memory snapshot ({error})") from None
    if not isinstance(snapshot, dict) or not isinstance(snapshot.get("segments"), list):
        raise SnapshotFormatError(f"{path}: not a memory snapshot (no 'segments' list)")
    return snapshot


def read_snapshot(path: str | Path, limit: int = TOP_ALLOCATIONS) -> MemorySnapshot:
    snapshot = load_snapshot(path)
    segments = snapshot["segments"]
    return MemorySnapshot(
        timeline=allocation_timeline(snapshot),
        top_allocations=top_allocations(snapshot, limit),
        allocated_bytes=sum(_live_bytes(segment) for segment in segments),
        reserved_bytes=sum(int(segment.get("total_size", 0)) for segment in segments),
        segments=len(segments),
    )


def allocation_timeline(snapshot: dict) -> pd.DataFrame:
    """Allocated and reserved bytes after each allocator action, per device.

    The history is a ring buffer that may have dropped its oldest actions, so the running
    totals are anchored at the end: after the last action they equal what the snapshot's
    segments hold."""
    frames = [_device_timeline(device, entries, snapshot["segments"])
              for device, entries in enumerate(snapshot.get("device_traces") or []) if entries]
    frames = [frame for frame in frames if not frame.empty]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=TIMELINE_COLUMNS)


def _device_timeline(device: int, entries: list[dict], segments: list[dict]) -> pd.DataFrame:
    entries = [entry for entry in entries if entry.get("action") in ACTION_DELTAS]
    frame = pd.DataFrame({
        "device": device,
        "entry": np.arange(len(entries)),
        "time_us": [entry.get("time_us", np.nan) for entry in entries],
        "action": [entry["action"] for entry in entries],
        "size_bytes": [int(entry.get("size", 0)) for entry in entries],
        "top_frame": [top_user_frame(entry.get("frames") or []) for entry in entries],
    })
    signs = np.array([ACTION_DELTAS[action] for action in frame["action"]], dtype=np.int64).reshape(-1, 2)
    sizes = frame["size_bytes"].to_numpy()
    on_device = [segment for segment in segments if segment.get("device", device) == device]
    for column, sign, at_end in (
        ("allocated_bytes", signs[:, 0], sum(_live_bytes(segment) for segment in on_device)),
        ("reserved_bytes", signs[:, 1], sum(int(segment.get("total_size", 0)) for segment in on_device)),
    ):
        running = np.cumsum(sign * sizes)
        frame[column] = at_end - (running[-1] if len(running) else 0) + running
    return frame[TIMELINE_COLUMNS]


def top_allocations(snapshot: dict, limit: int = TOP_ALLOCATIONS) -> pd.DataFrame:
    """The `limit` largest live blocks, with the innermost frame of the user's code that allocated each."""
    rows = [
        (segment.get("device", 0), int(block["size"]), int(block.get("requested_size", block["size"])),
         block["state"], segment.get("stream", 0), top_user_frame(block.get("frames") or []),
         " ← ".join(map(frame_label, (block.get("frames") or [])[:STACK_FRAMES])))
        for segment in snapshot["segments"] for block in segment.get("blocks") or []
        if block.get("state") in LIVE_STATES
    ]
    table = pd.DataFrame(rows, columns=TOP_COLUMNS)
    return table.nlargest(limit, "size_bytes", keep="first").reset_index(drop=True) if rows else table


def _live_bytes(segment: dict) -> int:
    return sum(int(block["size"]) for block in segment.get("blocks") or [] if block.get("state") in LIVE_STATES)


def frame_label(frame: dict) -> str:
    """`file.py:12:func`, the way torch's memory viewer names a frame."""
    filename = str(frame.get("filename", ""))
    if filename in ("", "none", "??"):
        return str(frame.get("name", "?"))
    return f"{filename}:{frame.get('line', 0)}:{frame.get('name', '?')}"


def top_user_frame(frames: list[dict]) -> str | None:
    """The innermost Python frame outside torch itself (frames run innermost first), or None."""
    for frame in frames:
        place = _python_file(frame)
        if place is not None and not _inside_torch(place):
            return frame_label(frame)
    return None


def _python_file(frame: dict) -> str | None:
    filename = str(frame.get("filename", ""))
    if filename.endswith(".py"):
        return filename
    match = PLACE_IN_NAME.match(str(frame.get("name", "")))
    return match.group("file") if match else None


def _inside_torch(path: str) -> bool:
    return path.startswith("torch/") or "/torch/" in path
