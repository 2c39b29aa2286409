"""Background sampling of the device (NVML, `nvml.py`) and the host (psutil, `host_cpu.py`) at a fixed rate.

Each rank samples only its own GPU. Without NVML (no GPU, no driver, a CPU run) only the
host is sampled; a CUDA run's log says once per process that device metrics are off. An NVML
call failing mid-run switches device sampling off (logged once, an event); host sampling
goes on. Hopper GPM metrics (SM / tensor / DRAM activity) are read where supported.
"""

from __future__ import annotations

import logging
import threading
import time

import psutil
import torch

from gpuprof.capture.host_cpu import JobCpu, LoopCpuWait
from gpuprof.capture.memory import RssReader
from gpuprof.capture.nvml import NvmlDevice
from gpuprof.capture.stack_sampler import StackSampler
from gpuprof.run.schema import EventKind

logger = logging.getLogger("gpuprof")

_notice_given = False


def _say_device_metrics_off(reason: str) -> None:
    global _notice_given
    if not _notice_given:
        _notice_given = True
        logger.warning("gpuprof: device metrics off (%s); sampling the host only", reason)


AUTO_INTERVAL = "auto"
DEVICE_INTERVAL_S = 0.1
# The host alone changes slowly, and on a small machine every wake-up of this thread takes a core
# from the training threads: about 70 us a step at 10 Hz on a 2-core CPU (benchmarks/overhead.py).
HOST_INTERVAL_S = 1.0


class SystemSampler:
    """A daemon thread writing one `system` row per interval (one per device plus the host readings),
    and taking the stack sampler's samples (gpuprof.capture.stack_sampler) between them, one wake-up for both.
    interval_s: seconds, or AUTO_INTERVAL: DEVICE_INTERVAL_S where this rank's GPU can be sampled,
    HOST_INTERVAL_S for the host alone; 0 for no system rows (the thread then runs for the stacks alone)."""

    name = "system"

    def __init__(self, interval_s: float | str, stacks: StackSampler | None = None):
        self.interval_s = interval_s
        self.stacks = stacks
        self.device_mem_used_bytes: int | None = None
        self.proc_rss_bytes: int | None = None  # the latest reading, for the step records
        self._nvml: NvmlDevice | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._rss = RssReader()
        self._job_cpu = JobCpu()
        self._loop_wait: LoopCpuWait | None = None
        self._prof = None

    @property
    def samples_system(self) -> bool:
        return bool(self.interval_s)

    def on_start(self, prof) -> None:
        self._prof = prof
        self._loop_wait = LoopCpuWait()
        if self.samples_system:
            self._start_system(prof)
        self._thread = threading.Thread(target=self._run, name="gpuprof-sampler", daemon=True)
        self._thread.start()

    def _start_system(self, prof) -> None:
        reason = self._open_nvml(prof.device)
        if self.interval_s == AUTO_INTERVAL:
            self.interval_s = HOST_INTERVAL_S if reason else DEVICE_INTERVAL_S
        if reason:
            if prof.device.type == "cuda":  # on another device there was nothing to sample: no news to the user
                _say_device_metrics_off(reason)
            prof.event(EventKind.DEVICE_METRICS_OFF, f"device metrics off: {reason}", reason=reason)
        self.proc_rss_bytes = self._rss.rss_bytes()

    def _open_nvml(self, device: torch.device) -> str | None:
        """None when this rank's GPU can be sampled, else why not."""
        if device.type != "cuda":
            return f"training on {device.type}"
        try:
            self._nvml = NvmlDevice(device)
        except Exception as error:  # noqa: BLE001 - NVMLError, ImportError, OSError: all mean no NVML
            return f"NVML unavailable: {error}"
        return None

    def meta(self, prof) -> dict:
        if not self.samples_system:
            return {}
        facts = {"sample_interval_s": self.interval_s}
        return {**facts, "driver": self._nvml.driver} if self._nvml is not None else facts

    def on_close(self, prof) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(1.0, 3 * self._period_s()))
        if self._thread is None or not self._thread.is_alive():
            self._rss.close()
            if self.stacks is not None:
                self.stacks.flush()

    def _period_s(self) -> float:
        periods = [self.interval_s if self.samples_system else None, self.stacks.interval_s if self.stacks else None]
        return min(period for period in periods if period) if any(periods) else DEVICE_INTERVAL_S

    def _run(self) -> None:
        if self.samples_system:
            # the first readings only start the measurement windows (psutil keeps cpu_percent's per thread)
            psutil.cpu_percent(interval=None)
            self._job_cpu.pct()
            self._loop_wait.pct()
        now = time.monotonic()
        # the first system row soon, also in a short run
        next_system = now + min(self.interval_s, DEVICE_INTERVAL_S) if self.samples_system else float("inf")
        next_stack = now + self.stacks.interval_s if self.stacks is not None else float("inf")
        system_rows = 0
        while not self._stop.wait(max(0.0, min(next_system, next_stack) - time.monotonic())):
            now = time.monotonic()
            if now >= next_stack:
                if not self._take("stack", self.stacks.sample):
                    self.stacks, next_stack = None, float("inf")
                else:
                    next_stack = now + self.stacks.next_interval_s()
            if now >= next_system:
                next_system = now + self.interval_s
                if not self._take("system", self._write_sample):
                    next_system = float("inf")
                system_rows += 1
            if next_system == next_stack == float("inf"):
                return
        if not system_rows and next_system != float("inf"):  # a run shorter than the first interval: a row at its end
            self._take("system", self._write_sample)

    def _write_sample(self) -> None:
        self._prof.writer.write("system", [self.sample()])

    def _take(self, kind: str, take) -> bool:
        """Runs one `kind` ("system" or "stack") of sampling; its first failure stops that kind (logged, an event),
        never the process."""
        try:
            take()
        except Exception as error:  # noqa: BLE001 - the sampler must never take the process down
            logger.warning("gpuprof: %s sampler stopped: %r", kind, error)
            collector = self.name if kind == "system" else self.stacks.name
            self._prof.event(EventKind.COLLECTOR_DISABLED, f"{kind} sampler stopped: {error!r}", severity="warning",
                             collector=collector, hook="sample", error=repr(error))
            return False
        return True

    def sample(self) -> dict:
        memory = psutil.virtual_memory()
        self.proc_rss_bytes = self._rss.rss_bytes()
        row = {
            "time_unix_s": time.time(), "rank": self._prof.ranks.rank, "device_index": None,
            "host_cpu_pct": psutil.cpu_percent(interval=None), "job_cpu_pct": self._job_cpu.pct(),
            "loop_cpu_wait_pct": self._loop_wait.pct(),
            "proc_rss_bytes": self.proc_rss_bytes,
            "host_mem_used_bytes": memory.total - memory.available, "host_mem_total_bytes": memory.total,
        }
        if self._nvml is not None:
            row.update(self._read_device())
        return row

    def _read_device(self) -> dict:
        try:
            reading = self._nvml.read()
        except Exception as error:  # noqa: BLE001 - NVML failing mid-run: device sampling off, host goes on
            self._nvml = None
            logger.warning("gpuprof: NVML failed mid-run (%r); device metrics off", error)
            self._prof.event(EventKind.DEVICE_METRICS_OFF, f"NVML failed mid-run: {error!r}", severity="warning",
                             reason=repr(error))
            return {}
        self.device_mem_used_bytes = reading["mem_used_bytes"]
        return reading
