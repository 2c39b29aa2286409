"""One GPU's NVML readings (utilization, power, clocks, memory, PCIe, throttling; Hopper GPM activity where
supported); construction raises where NVML or the device is unavailable."""

from __future__ import annotations

import torch

THROTTLE_REASONS = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting",
}


def throttle_reason_names(mask: int) -> list[str]:
    return [name for bit, name in THROTTLE_REASONS.items() if mask & bit]


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
