"""On-demand torch.profiler windows: Chrome traces for chosen optimizer steps.

Each contiguous run of `trace_steps` is one window, written as
`traces/steps-A-B/rank-R.pt.trace.json.gz` (see RunWriter.trace_path) (one file per rank per window, so each window
folder is what HTA expects). Steps are marked `ProfilerStep#N` with N the optimizer step,
phases as `gpuprof.<phase>` ranges, gpuprof's own step-end work as `gpuprof.bookkeeping`,
and `distributedInfo` (rank, world size) is always present so Perfetto and HTA open the
files unchanged.
"""

from __future__ import annotations

import contextlib
import json
import os

import torch
from torch.profiler import ProfilerAction, ProfilerActivity, record_function

from gpuprof.modules import initialized
from gpuprof.run.schema import OWN_WORK_RANGE, EventKind
from gpuprof.torch_compat import private


# Kineto prints a line at every profiler start and stop (its "USDT" level, above its errors) into the user's
# terminal; a window that fails is recorded by gpuprof itself, so kineto stays quiet unless the user asks
# (KINETO_LOG_LEVEL set). Kineto reads it when the process first profiles.
KINETO_SILENT_LEVEL = "6"


def windows(steps: list[int]) -> list[tuple[int, int]]:
    """Contiguous [start, stop) ranges covering sorted `steps`."""
    ranges: list[tuple[int, int]] = []
    for step in steps:
        if ranges and ranges[-1][1] == step:
            ranges[-1] = (ranges[-1][0], step + 1)
        else:
            ranges.append((step, step + 1))
    return ranges


def own_work():
    """Marks gpuprof's own work while a profiler records; a no-op (one flag read) otherwise."""
    recording = private("torch.autograd._profiler_enabled", bool)()
    return record_function(OWN_WORK_RANGE) if recording else contextlib.nullcontext()


class TraceCollector:
    name = "trace"

    def __init__(self, steps: list[int], record_shapes: bool, profile_memory: bool, with_stack: bool):
        self._windows = windows(steps)
        self._options = {"record_shapes": record_shapes, "profile_memory": profile_memory, "with_stack": with_stack}
        self._profiler: torch.profiler.profile | None = None
        self._window: tuple[int, int] | None = None
        self._ranges: dict[str, list[record_function]] = {}

    def on_step_start(self, prof, step: int) -> None:
        if self._profiler is None and self._windows and self._windows[0][0] == step:
            self._open(prof, self._windows.pop(0))

    def on_phase_begin(self, prof, name: str) -> None:
        if self._profiler is not None:
            scope = record_function(f"gpuprof.{name}")
            scope.__enter__()
            self._ranges.setdefault(name, []).append(scope)

    def on_phase_end(self, prof, name: str) -> None:
        if self._profiler is not None and self._ranges.get(name):
            self._ranges[name].pop().__exit__(None, None, None)

    def on_step_end(self, prof, state) -> None:
        if self._profiler is None:
            return
        if state.step + 1 >= self._window[1]:
            self._close(prof)
        else:
            self._profiler.step()

    def on_close(self, prof) -> None:
        if self._profiler is not None:
            self._close(prof)

    def _open(self, prof, window: tuple[int, int]) -> None:
        os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_SILENT_LEVEL)
        activities = [ProfilerActivity.CPU]
        if prof.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(
            activities=activities, schedule=lambda _step: ProfilerAction.RECORD, **self._options
        )
        profiler.step_num = window[0]  # ProfilerStep#N carries the optimizer step number
        profiler.start()
        if not initialized():
            info = {"backend": None, "rank": prof.ranks.rank, "world_size": prof.ranks.world_size}
            profiler.add_metadata_json("distributedInfo", json.dumps(info))
        self._profiler, self._window = profiler, window

    def _close(self, prof) -> None:
        profiler, (start, stop) = self._profiler, self._window
        self._profiler = self._window = None
        for scopes in self._ranges.values():
            while scopes:
                scopes.pop().__exit__(None, None, None)
        profiler.stop()
        path = prof.writer.trace_path(start, stop - 1)
        profiler.export_chrome_trace(str(path))
        prof.event(EventKind.TRACE_WRITTEN, f"torch.profiler trace of steps {start}-{stop - 1}",
                   step=start, path=prof.writer.relative(path), first_step=start, last_step=stop - 1)
