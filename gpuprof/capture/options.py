"""The Profiler's options, typed: what `gpuprof.profile(...)` was asked to record (see Profiler)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from gpuprof.capture.stack_sampler import STACK_INTERVAL_S
from gpuprof.numerics.options import NumericsOptions


@dataclass(frozen=True)
class CaptureOptions:
    trace_steps: tuple[int, ...] = ()
    sample_interval_s: float | str = "auto"  # 0: no background sampler; "auto": see SystemSampler
    stack_interval_s: float = STACK_INTERVAL_S  # 0: no stack samples (gpuprof.capture.stack_sampler)
    grad_norms: bool = True
    layer_interval: int = 10
    update_ratio_interval: int = 100
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    memory_history: bool = False
    numerics: NumericsOptions | None = field(default_factory=NumericsOptions)  # None: off
    on_nonfinite: str = "record"
    hang_timeout_s: float | None = None  # None: max(120 s, 20 median steps); 0: no hang watchdog
    live_export: str | None = None  # a folder: each step's figures streamed there for TensorBoard

    def for_meta(self) -> dict[str, Any]:
        """As meta.json's `options` records them (numerics off is `false`)."""
        values = dataclasses.asdict(self)
        values["trace_steps"] = list(self.trace_steps)
        values["numerics"] = values["numerics"] or False
        return values
