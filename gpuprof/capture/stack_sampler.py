"""Where the training thread's time goes in the user's own code: its Python stack, sampled at a low rate.

Every `interval_s` (STACK_INTERVAL_S by default; longer after a sample that cost more than CPU_BUDGET) the
system sampler's thread asks for one sample, and the training thread takes it itself at its next bytecode
(gpuprof.capture.main_thread): the step, the phase the step is in at that moment (an explicit `prof.phase()`
first, else the automatic phases' state), and the user frames of its stack (gpuprof.capture.usercode), read
together. A request made while the thread is inside a C call (a sleep, a wait on a loader or a device) is
answered when the call returns, at the line that made it, and that sample stands for every interval the wait
took: each interval is one `stacks` row, named by the innermost frame of the user's code with the line it runs
and the line of the loop that led there. A sample taken between the model calls of an evaluation the loop runs
with its own statements waits until the loop's next move says whether it was evaluation (see `_settle`). Over
many steps the samples of a phase split its measured time among the user's functions
(gpuprof.analysis.run.hotspots), so that no share of the step is a black box. The thread has to be the main
thread (where CPython runs such requests); on another, no stack is sampled. Its cost is measured by
`benchmarks/overhead.py --components stacks`.
"""

from __future__ import annotations

import collections
import logging
import sys
import threading
import time

from gpuprof.capture import main_thread
from gpuprof.capture.usercode import ReadFrame, function_site, user_frames

logger = logging.getLogger("gpuprof")

# 20 samples a second: a few per step of a small model, a few hundred per minute of any run.
STACK_INTERVAL_S = 0.05
# Where a sample costs the training thread more (deep stacks), fewer, down to a quarter of the rate: sampling
# takes at most this share of its time.
CPU_BUDGET = 0.005
SLOWEST_RATE = 4  # the longest wait is this many intervals


class StackSampler:
    """A collector sampling the stack of the thread that started the Profiler (the training thread)."""

    name = "stacks"

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._prof = None
        self._sampling = False  # the training thread is the main thread, where a sample can be taken
        self._explicit: tuple[str, ...] = ()  # the prof.phase() spans open now, innermost last (replaced, not changed)
        self._unsettled: list[tuple[float, list, dict]] = []  # (perf_counter, its window, row) between evaluation calls
        # the intervals the next sample stands for, alike ones counted together (a thread stuck in a C call for hours
        # keeps one entry): [first time, last time, count, batch function running, phase]
        self._ticks: list[list] = []
        self._requested = False  # a sample asked for and not taken yet
        self._taken: collections.deque = collections.deque()  # (perf_counter, moment, frames, ticks) to write
        self._cost_s = 0.0  # the last sample's time on the training thread

    def on_start(self, prof) -> None:
        self._prof = prof
        self._sampling = threading.current_thread() is threading.main_thread() and main_thread.available()
        if not self._sampling:
            logger.info("gpuprof: no stack samples: the training thread is not this process's main thread")

    def on_phase_begin(self, prof, name: str) -> None:
        self._explicit = (*self._explicit, name)

    def on_phase_end(self, prof, name: str) -> None:
        if name in self._explicit:
            last = len(self._explicit) - 1 - self._explicit[::-1].index(name)
            self._explicit = self._explicit[:last] + self._explicit[last + 1:]

    def meta(self, prof) -> dict:
        return {"stack_interval_s": self.interval_s if self._sampling else None}

    def sample(self) -> None:
        """From the sampler's thread, each interval: writes the samples taken since, and asks for the next one
        unless one is still asked for (the training thread in a C call), which then stands for this interval too."""
        self._write_taken()
        if not self._sampling:
            return
        self._count_tick(time.time(), self._prof.phase_hooks.producing, self._phase())
        if not self._requested:
            self._requested = main_thread.call_on_main_thread(self._take)

    def _count_tick(self, now_unix_s: float, producing, phase: str) -> None:
        ticks = self._ticks
        if ticks and ticks[-1][3] is producing and ticks[-1][4] == phase:
            ticks[-1][1:3] = [now_unix_s, ticks[-1][2] + 1]
        else:
            ticks.append([now_unix_s, now_unix_s, 1, producing, phase])

    def _take(self) -> None:
        """On the training thread, between two of its bytecodes: its moment and its stack's user frames, read at
        once. None is kept while gpuprof itself is at work (its step-end bookkeeping)."""
        started_s = time.perf_counter()
        ticks, self._ticks = self._ticks, []
        moment = self._moment()
        if not moment[0]:
            frames = [ReadFrame(frame.f_code, frame.f_lineno) for frame in user_frames(sys._getframe(1))]
            self._taken.append((started_s, moment, frames, ticks))
        self._requested = False
        self._cost_s = time.perf_counter() - started_s

    def _write_taken(self) -> None:
        while self._taken:
            taken_s, moment, frames, ticks = self._taken.popleft()
            self._write(taken_s, moment, frames, ticks)

    def _write(self, taken_s: float, moment: tuple, frames: list[ReadFrame], ticks: list[list]) -> None:
        """One row per interval the sample stands for. With no user frame on the stack (the thread in a library's
        own loop, a Trainer's), the row names none: its share stays in the phase, said to be the libraries'. An
        interval during which one of the loop's batch functions ran is that function's (data), also when the
        sample was taken after it returned: C code it waited in (a C iterator a generator reads) comes back to
        Python only in its caller."""
        _, step, phase, window, between = moment
        site = {"rank": self._prof.ranks.rank, "step": step, "phase": phase, **self._site(frames)}
        running = {frame.f_code for frame in frames}
        rows = []
        for first_unix_s, last_unix_s, count, producing, tick_phase in ticks:
            ticked = site
            if producing is not None and producing not in running:
                ticked = {**site, **_producer_site(producing), "phase": tick_phase}
            spacing_s = (last_unix_s - first_unix_s) / max(count - 1, 1)
            rows += [{"time_unix_s": first_unix_s + index * spacing_s, **ticked} for index in range(count)]
        self._settle(window)
        if not self._explicit and window is not None and between:
            self._unsettled.extend((taken_s, window, row) for row in rows)
        else:
            self._prof.writer.write("stacks", rows)

    def _site(self, frames: list[ReadFrame]) -> dict:
        """Where a sample landed: the user frame it is named by (see `_entry_and_loop`), the innermost and the
        loop's."""
        if not frames:
            return {}
        entry, loop = _entry_and_loop(frames, self._prof.phase_hooks.loop_codes)
        function, filename, line = function_site(entry, by_line=entry is loop)
        inner = function_site(frames[0])
        return {"function": function, "file": filename, "line": line, "running_line": entry.f_lineno,
                "inner_function": inner[0], "inner_file": inner[1], "inner_line": inner[2],
                "loop_file": loop.f_code.co_filename, "loop_line": loop.f_lineno}

    def next_interval_s(self) -> float:
        """The wait before the next sample: `interval_s`, longer where the last sample cost more than CPU_BUDGET
        of a core at that rate, at most SLOWEST_RATE intervals."""
        return min(max(self.interval_s, self._cost_s / CPU_BUDGET), SLOWEST_RATE * self.interval_s)

    def _moment(self) -> tuple:
        """Where the training thread is, as the row says it: gpuprof at its own work, the step, the phase, the
        evaluation window open and whether it is between that window's calls."""
        prof, hooks = self._prof, self._prof.phase_hooks
        return (prof.bookkeeping, prof.step_index, self._phase(), hooks.evaluation_window,
                hooks.between_evaluation_calls)

    def _phase(self) -> str:
        """The phase the training thread is in: an explicit `prof.phase()` first, else the automatic phases'."""
        return self._explicit[-1] if self._explicit else self._prof.phase_hooks.current_phase

    def flush(self) -> None:
        """Once sampling has stopped: the samples taken are written; those left unsettled were taken after their
        window's last call."""
        self._write_taken()
        self._settle(None)

    def _settle(self, open_window: list[float] | None) -> None:
        """Writes the samples taken between evaluation calls whose phase is known now: evaluation where a call of
        their window ended after them, their own phase where none did and that window has closed (the training
        work went on: evaluation ended at its last call); the rest wait, in order."""
        settled = 0
        for taken_s, window, row in self._unsettled:
            if taken_s < window[1]:
                row["phase"] = "eval"
            elif window is open_window:
                break
            settled += 1
        if settled:
            self._prof.writer.write("stacks", [row for _, _, row in self._unsettled[:settled]])
            del self._unsettled[:settled]


def _producer_site(code) -> dict:
    """A batch function's interval, named by that function (its line unknown: it had returned)."""
    function, filename, line = function_site(ReadFrame(code, None))
    return {"function": function, "file": filename, "line": line, "running_line": None,
            "inner_function": function, "inner_file": filename, "inner_line": line}


def _entry_and_loop(frames: list, loop_codes) -> tuple:
    """The frame a sample is named by, and the loop's frame: the innermost frame running the code that calls
    the model in training (the loop), and the user function it called (`get_batch`), or the loop itself at its
    line. Before the loop is known, the innermost and outermost user frames."""
    loop_codes = loop_codes or ()
    at = next((index for index, frame in enumerate(frames) if frame.f_code in loop_codes), None)
    if at is None:
        return frames[0], frames[-1]
    return frames[max(at - 1, 0)], frames[at]
