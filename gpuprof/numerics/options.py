"""The numerics options of `gpuprof.profile(numerics=...)`, typed and checked once, at the call."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from gpuprof.errors import GpuprofError
from gpuprof.numerics.budget import DEFAULT_BUDGET_PCT

POLICIES = ("record", "raise", "skip")
# keep_state: "every_step" copies the pre-step state of every step (exact replay of any bad step);
# "when_bad" copies it only once a step goes bad, just before its update (no copy per step, but blind
# to an update that itself overflows): decided on the host on the CPU, by the device on CUDA with
# Triton, else by reading the flags on the host, a sync per step; "auto" is "when_bad" where that
# needs no sync and "every_step" elsewhere (see numerics/keeping.py); False keeps nothing.
KEEP_STATE = ("auto", "every_step", "when_bad", False)


@dataclass(frozen=True)
class NumericsOptions:
    state_interval: int = 50  # steps between reads of every parameter and optimizer state value
    keep_state: str | bool = "auto"  # one of KEEP_STATE
    spike_z: float = 6.0  # a loss or gradient norm this many standard deviations above its window
    spike_window: int = 50  # steps in that window
    max_reports: int = 1  # non-finite steps investigated; later ones are counted
    layer_factor: float = 1e3  # a block's gradient norm this many times off the median block
    builder: dict[str, Any] | None = None  # how `gpuprof replay` rebuilds the model (bundle.builder_for)
    memory_budget_pct: float = DEFAULT_BUDGET_PCT  # of a memory pool, the most the kept state may take (budget.py)

    def __post_init__(self):
        if self.keep_state not in KEEP_STATE:
            raise GpuprofError(f"numerics keep_state must be one of {KEEP_STATE}, got {self.keep_state!r}")
        budget = self.memory_budget_pct
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 <= budget <= 100:
            raise GpuprofError(f"numerics memory_budget_pct must be a number from 0 to 100, got {budget!r}")

    @classmethod
    def given(cls, value: Mapping[str, Any] | NumericsOptions | bool) -> NumericsOptions | None:
        """What `numerics=` asks for: None (off) for False, the defaults for True."""
        if isinstance(value, cls) or value is False or value is None:
            return value or None
        if value is True:
            return cls()
        if not isinstance(value, Mapping):
            raise GpuprofError(f"numerics must be True, False or a dict of options, got {value!r}")
        unknown = set(value) - {field.name for field in dataclasses.fields(cls)}
        if unknown:
            raise GpuprofError(f"unknown numerics option(s): {', '.join(sorted(unknown))}")
        return cls(**value)


def check_policy(on_nonfinite: str) -> str:
    if on_nonfinite not in POLICIES:
        raise GpuprofError(f"on_nonfinite must be one of {', '.join(POLICIES)}, got {on_nonfinite!r}")
    return on_nonfinite
