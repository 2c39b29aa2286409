"""A run's CUDA memory snapshots as the Memory page shows them: which files the run holds, whether an `oom`
event took each, and one snapshot read into its allocation timeline and largest live blocks."""

from __future__ import annotations

from pathlib import Path

from gpuprof.analysis.memory_snapshot import MemorySnapshot, read_snapshot
from gpuprof.run.reader import Run
from gpuprof.run.schema import EventKind

__all__ = ["MemorySnapshot", "read_snapshot", "snapshot_files"]


def snapshot_files(run: Run) -> dict[Path, bool]:
    """The run's CUDA memory snapshot files, each with whether an `oom` event names it (else the loop took it)."""
    named = run.events.loc[run.events["kind"] == EventKind.OOM, "details"]
    on_oom = {run.path / details["snapshot"] for details in named if isinstance(details, dict) and "snapshot" in details}
    return {file: file in on_oom for file in run.snapshot_files}

