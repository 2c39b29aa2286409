"""What every rule looks at: the run, its summary, and views derived once for all rules."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import cached_property

import pandas as pd

from gpuprof.analysis.run.summary import RunSummary, after_warmup, column, measured_samples, primary_device, summarize
from gpuprof.errors import GpuprofError

log = logging.getLogger(__name__)

# Compute capability from which matmuls can run on tensor cores (Volta).
TENSOR_CORE_MIN_CAPABILITY = (7, 0)


def parse_capability(value) -> tuple[int, int] | None:
    """CUDA compute capability as (major, minor), from "8.0" or [8, 0]."""
    if value is None:
        return None
    parts = str(value).split(".") if isinstance(value, (str, float)) else list(value)
    try:
        return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except (ValueError, IndexError):
        return None


@dataclass
class RunContext:
    run: object
    summary: RunSummary
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def of(cls, run) -> "RunContext":
        return cls(run=run, summary=summarize(run))

    @property
    def meta(self) -> dict:
        return self.run.meta

    @property
    def config(self) -> dict:
        return self.run.meta.get("config") or {}

    @property
    def world_size(self) -> int:
        return self.summary.world_size

    @property
    def on_gpu(self) -> bool:
        return self.summary.device_kind == "cuda"

    @property
    def gpu_warning(self) -> str:
        """Severity of a problem that costs time on a GPU but little or nothing on a CPU run."""
        return "warning" if self.on_gpu else "info"

    @property
    def device(self) -> dict:
        """The run's first device, as the summary describes it ({} when none was recorded)."""
        return primary_device(self.run.meta)

    @property
    def has_tensor_cores(self) -> bool:
        capability = parse_capability(self.device.get("capability"))
        return self.on_gpu and capability is not None and capability >= TENSOR_CORE_MIN_CAPABILITY

    @cached_property
    def measured(self) -> pd.DataFrame:
        """Step rows (all ranks) after the warm-up steps the summary excluded."""
        return after_warmup(self.run.steps, self.summary.warmup)

    @cached_property
    def device_samples(self) -> pd.DataFrame:
        """Device rows of the system samples taken during measured steps."""
        samples = measured_samples(self.run.system, self.run.steps, self.summary.warmup)
        return samples[column(samples, "device_index").notna()] if not samples.empty else samples

    def memo(self, key: str, compute):
        """`compute()`, computed once per run for views that more than one rule derives."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def config_value(self, *keys: str):
        """The first of `keys` present in the run's config (workloads name their knobs differently)."""
        return next((self.config[key] for key in keys if key in self.config), None)

    def events_of(self, *kinds: str) -> pd.DataFrame:
        events = self.run.events
        if events.empty or "kind" not in events.columns:
            return events
        return events[events["kind"].isin(kinds)]

    @cached_property
    def trace(self):
        """The trace analyzer over the run's traces, or None when it has none (or none readable)."""
        if not self.run.trace_files:
            return None
        from gpuprof.analysis.trace import TraceAnalysis

        try:
            return TraceAnalysis(self.run.trace_files)
        except GpuprofError as error:
            log.warning("traces of %s not analysed, trace-based rules skipped: %s", self.summary.path, error)
            return None

    @cached_property
    def device_trace(self):
        """The trace analyzer when the traces hold device (GPU) activity, else None."""
        return self.trace if self.trace is not None and self.trace.has_device_activity else None
