"""What the run's own processes and the training thread got of this host's CPUs: the job's CPU use and the share
of its wanted CPU time the training thread waited for one (what other processes took from the loop)."""

from __future__ import annotations

import os
import threading
import time

import psutil


class JobCpu:
    """The CPU used by the run's own processes on this host between two readings, in percent of all the
    host's CPUs: host_cpu_pct's scale, so that host_cpu_pct minus this is what other processes took. The
    run's own: this process and its children (DataLoader and compile workers); under a launcher that runs
    several ranks here (torchrun: LOCAL_WORLD_SIZE > 1), the launcher's whole tree, every local rank and its
    workers. The children are listed again every CHILDREN_REFRESH_S; a child's first interval after it is
    seen is not counted."""

    CHILDREN_REFRESH_S = 5.0

    def __init__(self):
        self._process = _job_root()
        self._cpu_count = psutil.cpu_count() or 1
        self._children: list[psutil.Process] = []
        self._listed_at = float("-inf")
        self._last: tuple[float, dict[int, float]] | None = None
        self._known: dict[int, psutil.Process] = {}

    def pct(self) -> float | None:
        """Percent of the host's CPUs since the previous call; None on the first."""
        now = time.monotonic()
        if now - self._listed_at >= self.CHILDREN_REFRESH_S:
            self._children, self._listed_at = self._list_children(), now
        cpu_s = {process.pid: seconds for process in (self._process, *self._children)
                 if (seconds := _cpu_seconds(process)) is not None}
        last, self._last = self._last, (now, cpu_s)
        if last is None or now <= last[0]:
            return None
        used_s = sum(seconds - last[1][pid] for pid, seconds in cpu_s.items() if pid in last[1])
        return max(0.0, 100 * used_s / ((now - last[0]) * self._cpu_count))

    def _list_children(self) -> list[psutil.Process]:
        pids = _descendant_pids(self._process.pid)
        if pids is None:  # no /proc children lists: psutil's listing, which reads every process's stat file
            try:
                return self._process.children(recursive=True)
            except psutil.Error:
                return []
        self._known = {pid: self._known.get(pid) or _process(pid) for pid in pids}
        return [process for process in self._known.values() if process is not None]


class LoopCpuWait:
    """Of the time the training thread wanted a CPU between two readings, the share it waited for one, runnable but
    not running, in percent: what other processes took from the loop itself (host_cpu_pct minus job_cpu_pct says
    only what they used, and on a saturated host of few cores it cannot tell a loop that got half a core from one
    that got a tenth). From Linux's schedstat of the thread (nanoseconds on a CPU, nanoseconds on a run queue);
    None where the kernel keeps none, or where the thread wanted no CPU in the window (asleep throughout). Made on
    the thread that starts the Profiler, the loop's."""

    def __init__(self):
        self._path = f"/proc/self/task/{threading.get_native_id()}/schedstat"
        self._last: tuple[int, int] | None = None

    def pct(self) -> float | None:
        try:
            with open(self._path) as schedstat:
                ran_ns, waited_ns = (int(field) for field in schedstat.read().split()[:2])
        except (OSError, ValueError):  # not Linux, no schedstats, or the thread has ended
            return None
        last, self._last = self._last, (ran_ns, waited_ns)
        if last is None:
            return None
        ran, waited = ran_ns - last[0], waited_ns - last[1]
        return 100 * waited / (ran + waited) if ran + waited > 0 else None


def _descendant_pids(root: int) -> list[int] | None:
    """Every descendant of `root`, from Linux's per-thread children lists (a few small reads, where psutil's
    listing reads the stat file of every process on the host); None where the kernel keeps no such lists."""
    if not os.path.exists(f"/proc/{root}/task/{root}/children"):
        return None
    found, pending = [], [root]
    while pending:
        pid = pending.pop()
        try:
            threads = os.listdir(f"/proc/{pid}/task")
        except OSError:  # gone
            continue
        for thread in threads:
            try:
                with open(f"/proc/{pid}/task/{thread}/children") as children:
                    new = [int(child) for child in children.read().split()]
            except OSError:
                continue
            found += new
            pending += new
    return found


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def _job_root() -> psutil.Process:
    process = psutil.Process()
    if int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1) > 1:
        return process.parent() or process
    return process


def _cpu_seconds(process: psutil.Process) -> float | None:
    try:
        times = process.cpu_times()
    except psutil.Error:  # a worker that has exited
        return None
    return times.user + times.system
