"""Where the kept state may go: the memory budget of keep_state "when_bad" (numerics memory_budget_pct).

"when_bad" holds one copy of the state a step starts from (every parameter, buffer and optimizer
state tensor: 16 bytes a parameter for AdamW in fp32, 2 GB for GPT-2 124M). That copy may take at
most `memory_budget_pct` (5 by default) of a memory pool, and never more than half of what the run
leaves free of it, measured after the run's first step, when its peak is known. The first choice
that fits wins:
1. the whole state on the device (on CUDA a byte copy inside device memory, made when a step goes bad);
2. the whole state in pinned host memory (the same kernel writes it across the bus, when a step goes bad);
3. the parameters and buffers alone, on the device, then on the host (the re-run then starts the
   optimizer's state afresh, and says so);
4. nothing: the `nonfinite` event says the state was not kept, and why.
Before the first step ends (no peak measured yet) only the host is considered. On the CPU the
device is the host: one pool.
"""

from __future__ import annotations

import resource
from dataclasses import asdict, dataclass

import psutil
import torch

from gpuprof.units import bytes_text

DEFAULT_BUDGET_PCT = 5.0
FREE_SHARE = 0.5  # of the memory the run leaves free, the most the copy may take
WHAT = {"state": "the whole state", "parameters": "the parameters and buffers alone"}
WHERE = {"device": "in device memory", "host": "in host memory"}  # pinned where there is CUDA


@dataclass(frozen=True)
class Pool:
    """One memory pool as measured: its size, what nobody holds of it now, the run's peak use of it."""

    name: str  # "device" or "host"
    total_bytes: int
    free_bytes: int
    peak_bytes: int | None = None  # CUDA: the allocator's peak; host: the process's peak RSS

    def budget_bytes(self, pct: float, held_bytes: int = 0) -> int:
        """The most the copy may take: `pct` of the pool and half of what is free, counting as free
        the `held_bytes` an earlier copy holds in it (those go when the new copy comes)."""
        return max(0, min(int(self.total_bytes * pct / 100), int((self.free_bytes + held_bytes) * FREE_SHARE)))


@dataclass(frozen=True)
class Placement:
    """What of the state is kept where, from `step` on, and why."""

    what: str  # "state", "parameters" or "nothing"
    where: str  # "device", "host" or "none"
    bytes: int
    step: int
    measured: bool  # decided from the run's measured peak (after its first step), not provisionally
    reason: str
    pools: tuple[Pool, ...]

    @property
    def kept(self) -> bool:
        return self.what != "nothing"

    def describe(self) -> str:
        if not self.kept:
            return "not kept (over the memory budget)"
        return f"{WHAT[self.what]} {WHERE[self.where]}"

    def for_meta(self) -> dict:
        return {"what": self.what, "where": self.where, "bytes": self.bytes, "from_step": self.step,
                "measured": self.measured, "reason": self.reason, "pools": [asdict(pool) for pool in self.pools]}


def pools_for(device: torch.device, measured: bool) -> tuple[Pool, ...]:
    """The pools the copy may use, measured now: the device's then the host's on CUDA (the host's alone
    before the run's peak is `measured`), the host's alone elsewhere."""
    host = host_pool()
    if device.type != "cuda" or not measured:
        return (host,)
    return device_pool(device), host


def device_pool(device: torch.device) -> Pool:
    free, total = torch.cuda.mem_get_info(device)
    return Pool("device", total, free, torch.cuda.max_memory_allocated(device))


def host_pool() -> Pool:
    memory = psutil.virtual_memory()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return Pool("host", memory.total, memory.available, peak_rss)


def place(sizes: dict[str, int], pools: tuple[Pool, ...], pct: float, step: int, measured: bool,
          held: dict[str, int] | None = None) -> Placement:
    """The first of (the whole state, the parameters alone) x `pools` in that order whose size fits the
    pool's budget. `sizes`: bytes of "state" and of "parameters"; `held`: bytes per pool an earlier copy holds."""
    held = held or {}
    budgets = {pool.name: pool.budget_bytes(pct, held.get(pool.name, 0)) for pool in pools}
    considered = "; ".join(_budget_text(pool, budgets[pool.name], pct, held.get(pool.name, 0)) for pool in pools)
    when = "after step " + str(step - 1) if measured else "before the first step ends (its peak not measured yet)"
    for what in ("state", "parameters"):
        for pool in pools:
            if sizes[what] <= budgets[pool.name]:
                reason = f"{WHAT[what]} ({bytes_text(sizes[what])}) fits the {pool.name}'s budget {when}: {considered}"
                if what != "state":
                    reason += f"; the whole state ({bytes_text(sizes['state'])}) fits none"
                return Placement(what, pool.name, sizes[what], step, measured, reason, pools)
    reason = (f"neither the whole state ({bytes_text(sizes['state'])}) nor the parameters ({bytes_text(sizes['parameters'])}) "
              f"fit a budget {when}: {considered}")
    return Placement("nothing", "none", 0, step, measured, reason, pools)


def _budget_text(pool: Pool, budget: int, pct: float, held: int) -> str:
    free = f"{bytes_text(pool.free_bytes)} free" + (f" + {bytes_text(held)} held by the copy before" if held else "")
    return f"{pool.name} {bytes_text(budget)} (the least of {pct:g}% of {bytes_text(pool.total_bytes)} and half of {free})"


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
