"""Where the training thread's time goes in the user's own code: its Python stack, sampled at a low rate.

Every `interval_s` (STACK_INTERVAL_S by default) the system sampler's thread reads the training
thread's current frame (`sys._current_frames()`) and writes one `stacks` row: the step, the phase
the step is in at that moment (an explicit `prof.phase()` first, else the automatic phases' state),
and the innermost frame of the user's code (gpuprof.capture.usercode) with the line it runs and
the line of the loop that led there. Over many steps the samples of a phase split its measured
time among the user's functions (gpuprof.analysis.run.hotspots), so that no share of the step is
a black box. A sample reads a few dozen frames and builds no string but the row's; its cost is
measured by `benchmarks/overhead.py --components stacks`.
"""

from __future__ import annotations

import sys
import threading
import time

from gpuprof.capture.usercode import function_site, user_frames

# 20 samples a second: a few per step of a small model, a few hundred per minute of any run.
STACK_INTERVAL_S = 0.05


class StackSampler:
    """A collector sampling the stack of the thread that started the Profiler (the training thread)."""

    name = "stacks"

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._prof = None
        self._thread_id: int | None = None
        self._explicit: tuple[str, ...] = ()  # the prof.phase() spans open now, innermost last (replaced, not changed)

    def on_start(self, prof) -> None:
        self._prof = prof
        self._thread_id = threading.get_ident()

    def on_phase_begin(self, prof, name: str) -> None:
        self._explicit = (*self._explicit, name)

    def on_phase_end(self, prof, name: str) -> None:
        if name in self._explicit:
            last = len(self._explicit) - 1 - self._explicit[::-1].index(name)
            self._explicit = self._explicit[:last] + self._explicit[last + 1:]

    def meta(self, prof) -> dict:
        return {"stack_interval_s": self.interval_s}

    def sample(self) -> None:
        """One row, from the sampler's thread. With no user frame on the stack (the thread in a library's own
        loop, a Trainer's), the row names none: its share stays in the phase, said to be the libraries'."""
        frame = sys._current_frames().get(self._thread_id)
        if frame is None or self._prof.bookkeeping:
            return
        frames = user_frames(frame)
        prof, explicit = self._prof, self._explicit
        row = {"time_unix_s": time.time(), "rank": prof.ranks.rank, "step": prof.step_index,
               "phase": explicit[-1] if explicit else prof.phase_hooks.current_phase}
        if frames:
            entry, loop = _entry_and_loop(frames, prof.phase_hooks.loop_codes)
            function, filename, line = function_site(entry, by_line=entry is loop)
            inner = function_site(frames[0])
            row.update(function=function, file=filename, line=line, running_line=entry.f_lineno,
                       inner_function=inner[0], inner_file=inner[1], inner_line=inner[2],
                       loop_file=loop.f_code.co_filename, loop_line=loop.f_lineno)
        prof.writer.write("stacks", [row])


def _entry_and_loop(frames: list, loop_codes) -> tuple:
    """The frame a sample is named by, and the loop's frame: the innermost frame running the code that calls
    the model in training (the loop), and the user function it called (`get_batch`), or the loop itself at its
    line. Before the loop is known, the innermost and outermost user frames."""
    at = next((index for index, frame in enumerate(frames) if frame.f_code in loop_codes), None) if loop_codes else None
    if at is None:
        return frames[0], frames[-1]
    return frames[max(at - 1, 0)], frames[at]
