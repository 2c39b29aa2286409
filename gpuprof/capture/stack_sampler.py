"""Where the training thread's time goes in the user's own code: its Python stack, sampled at a low rate.

Every `interval_s` (STACK_INTERVAL_S by default; longer after a sample that cost more than CPU_BUDGET)
the system sampler's thread reads the training thread's stack (gpuprof.capture.usercode.thread_user_frames,
in one call that holds the GIL) and writes one `stacks` row: the step, the phase the step is in at that
moment (an explicit `prof.phase()` first, else the automatic phases' state), and the innermost frame of the user's code (gpuprof.capture.usercode) with the line it runs and
the line of the loop that led there. A sample taken between the model calls of an evaluation the
loop runs with its own statements waits until the loop's next move says whether it was evaluation
(see `_settle`). Over many steps the samples of a phase split its measured
time among the user's functions (gpuprof.analysis.run.hotspots), so that no share of the step is
a black box. Its cost is measured by `benchmarks/overhead.py --components stacks`.
"""

from __future__ import annotations

import threading
import time

from gpuprof.capture.usercode import code_key, function_site, thread_user_frames

# 20 samples a second: a few per step of a small model, a few hundred per minute of any run.
STACK_INTERVAL_S = 0.05
# Where a sample costs more (deep stacks: faulthandler makes about nine system calls a frame), fewer, down to a
# quarter of the rate: the sampler takes at most this share of one core.
CPU_BUDGET = 0.005
SLOWEST_RATE = 4  # the longest wait is this many intervals (a first sample compiles the user's files once)


class StackSampler:
    """A collector sampling the stack of the thread that started the Profiler (the training thread)."""

    name = "stacks"

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._prof = None
        self._thread_id: int | None = None
        self._explicit: tuple[str, ...] = ()  # the prof.phase() spans open now, innermost last (replaced, not changed)
        self._unsettled: list[tuple[float, list, dict]] = []  # (perf_counter, its window, row) between evaluation calls
        self._cost_s = 0.0  # the last sample's CPU time

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
        loop, a Trainer's), the row names none: its share stays in the phase, said to be the libraries'. A stack
        read while the training thread moved on (another step, phase or evaluation call, gpuprof's own step-end
        work) is dropped: its phase would be another moment's."""
        started_s = time.thread_time()
        moment = self._moment()
        frames = thread_user_frames(self._thread_id)
        self._cost_s = time.thread_time() - started_s
        if frames is None or moment[0] or self._moment() != moment:
            return
        _, step, phase, window, between = moment
        prof, hooks = self._prof, self._prof.phase_hooks
        row = {"time_unix_s": time.time(), "rank": prof.ranks.rank, "step": step, "phase": phase}
        if frames:
            entry, loop = _entry_and_loop(frames, hooks.loop_codes)
            function, filename, line = function_site(entry, by_line=entry is loop)
            inner = function_site(frames[0])
            row.update(function=function, file=filename, line=line, running_line=entry.f_lineno,
                       inner_function=inner[0], inner_file=inner[1], inner_line=inner[2],
                       loop_file=loop.f_code.co_filename, loop_line=loop.f_lineno)
        self._settle(window)
        if not self._explicit and window is not None and between:
            self._unsettled.append((time.perf_counter(), window, row))
        else:
            prof.writer.write("stacks", [row])

    def next_interval_s(self) -> float:
        """The wait before the next sample: `interval_s`, longer where the last sample cost more than CPU_BUDGET
        of a core at that rate, at most SLOWEST_RATE intervals."""
        return min(max(self.interval_s, self._cost_s / CPU_BUDGET), SLOWEST_RATE * self.interval_s)

    def _moment(self) -> tuple:
        """Where the training thread is, as the row says it: gpuprof at its own work, the step, the phase, the
        evaluation window open and whether it is between that window's calls."""
        prof, explicit, hooks = self._prof, self._explicit, self._prof.phase_hooks
        return (prof.bookkeeping, prof.step_index, explicit[-1] if explicit else hooks.current_phase,
                hooks.evaluation_window, hooks.between_evaluation_calls)

    def flush(self) -> None:
        """Once sampling has stopped: the samples left unsettled were taken after their window's last call."""
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


def _entry_and_loop(frames: list, loop_codes) -> tuple:
    """The frame a sample is named by, and the loop's frame: the innermost frame running the code that calls
    the model in training (the loop), and the user function it called (`get_batch`), or the loop itself at its
    line. Before the loop is known, the innermost and outermost user frames."""
    loop_keys = {code_key(code) for code in loop_codes or ()}
    at = next((index for index, frame in enumerate(frames) if code_key(frame.f_code) in loop_keys), None)
    if at is None:
        return frames[0], frames[-1]
    return frames[max(at - 1, 0)], frames[at]
