"""Background sampling of the device (NVML) and the host (psutil) at a fixed rate.

Each rank samples only its own GPU. Without NVML (no GPU, no driver, a CPU run) only the
host is sampled and the log says once per process that device metrics are off. An NVML
call failing mid-run switches device sampling off (logged once, an event); host sampling
goes on. Hopper GPM metrics (SM / tensor / DRAM activity) are read where supported.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import psutil
import torch

from gpuprof.capture.memory import RssReader
from gpuprof.capture.stack_sampler import StackSampler
from gpuprof.run.schema import EventKind

logger = logging.getLogger("gpuprof")

_notice_given = False

THROTTLE_REASONS = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting",
}


def throttle_reason_names(mask: int) -> list[str]:
    return [name for bit, name in THROTTLE_REASONS.items() if mask & bit]


def _say_device_metrics_off(reason: str) -> None:
    global _notice_given
    if not _notice_given:
        _notice_given = True
        logger.warning("gpuprof: device metrics off (%s); sampling the host only", reason)


class NvmlDevice:
    """NVML readings of one GPU; construction raises when NVML or the device is unavailable."""

    def __init__(self, device: torch.device):
        import pynvml

        self._nvml = pynvml
        pynvml.nvmlInit()
        self.driver = pynvml.nvmlSystemGetDriverVersion()
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.handle = self._handle_for(self.index)
        self._gpm_samples = self._gpm_setup()

    def _handle_for(self, index: int):
        """By UUID, since NVML's indices ignore CUDA_VISIBLE_DEVICES; by index if that fails."""
        uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "")
        if uuid:
            try:
                return self._nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            except Exception:  # noqa: BLE001 - an unexpected UUID form: fall back to the index
                pass
        return self._nvml.nvmlDeviceGetHandleByIndex(index)

    def _gpm_setup(self):
        try:
            if not self._nvml.nvmlGpmQueryDeviceSupport(self.handle).isSupportedDevice:
                return None
            samples = [self._nvml.nvmlGpmSampleAlloc(), self._nvml.nvmlGpmSampleAlloc()]
            self._nvml.nvmlGpmSampleGet(self.handle, samples[0])
            return samples
        except (self._nvml.NVMLError, AttributeError):
            return None

    def read(self) -> dict:
        nvml, handle = self._nvml, self.handle
        util = nvml.nvmlDeviceGetUtilizationRates(handle)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        row = {
            "device_index": self.index,
            "gpu_util_pct": util.gpu,
            "mem_util_pct": util.memory,
            "mem_used_bytes": memory.used,
            "mem_total_bytes": memory.total,
            "power_w": nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
            "temp_c": nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
            "sm_clock_mhz": nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM),
            "throttle_reasons": self._throttle_reasons(),
            "pcie_tx_bytes_per_s": self._optional(self._pcie_bytes_per_s, nvml.NVML_PCIE_UTIL_TX_BYTES),
            "pcie_rx_bytes_per_s": self._optional(self._pcie_bytes_per_s, nvml.NVML_PCIE_UTIL_RX_BYTES),
        }
        row.update(self._optional(self._read_gpm) or {})
        return row

    def _optional(self, read, *args):
        """A reading some GPUs or drivers do not support: None rather than losing the whole sample."""
        try:
            return read(*args)
        except self._nvml.NVMLError:
            return None

    def _pcie_bytes_per_s(self, counter: int) -> int:
        return self._nvml.nvmlDeviceGetPcieThroughput(self.handle, counter) * 1024  # NVML reports KB/s

    def _throttle_reasons(self) -> list[str] | None:
        read = getattr(self._nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        mask = self._optional(read, self.handle) if read else None
        if mask is None:
            mask = self._optional(self._nvml.nvmlDeviceGetCurrentClocksThrottleReasons, self.handle)
        return throttle_reason_names(mask) if mask is not None else None

    def _read_gpm(self) -> dict:
        if self._gpm_samples is None:
            return {}
        nvml = self._nvml
        first, second = self._gpm_samples
        nvml.nvmlGpmSampleGet(self.handle, second)
        request = nvml.c_nvmlGpmMetricsGet_t()
        request.version = nvml.NVML_GPM_METRICS_GET_VERSION
        request.sample1, request.sample2 = first, second
        metric_ids = (nvml.NVML_GPM_METRIC_SM_UTIL, nvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL, nvml.NVML_GPM_METRIC_DRAM_BW_UTIL)
        request.numMetrics = len(metric_ids)
        for slot, metric_id in enumerate(metric_ids):
            request.metrics[slot].metricId = metric_id
        nvml.nvmlGpmMetricsGet(request)
        self._gpm_samples = [second, first]
        values = [m.value if m.nvmlReturn == nvml.NVML_SUCCESS else None for m in request.metrics[: len(metric_ids)]]
        return dict(zip(("sm_active_pct", "tensor_active_pct", "dram_active_pct"), values))


AUTO_INTERVAL = "auto"
DEVICE_INTERVAL_S = 0.1
# The host alone changes slowly, and on a small machine every wake-up of this thread takes a core
# from the training threads: about 70 us a step at 10 Hz on a 2-core CPU (benchmarks/overhead.py).
HOST_INTERVAL_S = 1.0


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
