"""The comparability contract: what two runs must share for their steps to be compared, read
from what each run recorded (its meta, its loop's facts, its steps), never declared by the user.

Every difference is listed. A difference in what one step computes, or on what, makes a
per-step comparison meaningless and blocks it (`gpuprof compare --gate` exits 4); a different
torch, CUDA, driver, precision or optimizer is what a comparison is often for, so it is listed
and the comparison goes on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from gpuprof.analysis.run.host_load import CONTENDED_CORES, DIFFERENT_LOAD_POINTS, DIFFERENT_LOAD_RATIO, HostLoad
from gpuprof.report.format import MISSING, device_label, figure


HOST_LOAD = "host load"


@dataclass(frozen=True)
class Term:
    name: str
    # meta, median tokens per measured step -> the recorded value (None when not recorded)
    read: Callable[[dict, float | None], object]
    blocks: bool
    group: str


def _nested(*keys: str) -> Callable[[dict, float | None], object]:
    def read(meta: dict, _tokens) -> object:
        value = meta
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        return value
    return read


def _model_class(meta: dict, _tokens) -> str | None:
    return _nested("loop", "model", "class")(meta, None) or _nested("model", "class")(meta, None)


TERMS = (
    Term("torch", _nested("versions", "torch"), False, "environment"),
    Term("CUDA", _nested("versions", "cuda"), False, "environment"),
    Term("driver", _nested("versions", "driver"), False, "environment"),
    Term("devices", lambda meta, _: device_label(meta) if meta.get("devices") else None, True, "environment"),
    Term("world size", lambda meta, _: int(meta.get("world_size") or 1), True, "environment"),
    Term("model class", _model_class, True, "workload"),
    Term("parameters", _nested("model", "n_params"), True, "workload"),
    Term("parameter shapes", _nested("model", "param_shapes_digest"), True, "workload"),
    Term("tokens per step", lambda _, tokens: tokens, True, "workload"),
    Term("precision", _nested("compute_dtype"), False, "workload"),
    Term("optimizer", _nested("loop", "optimizer", "class"), False, "workload"),
)


@dataclass(frozen=True)
class Difference:
    term: str
    group: str
    a: str
    b: str
    # it makes the comparison meaningless (False also where one run did not record it)
    blocks: bool

    @property
    def text(self) -> str:
        return f"{self.term}: A {self.a}, B {self.b}"

    def to_dict(self) -> dict:
        return {"term": self.term, "group": self.group, "a": self.a, "b": self.b, "blocks": self.blocks}


def shown(value) -> str:
    if value is None:
        return f"{MISSING} (not recorded)"
    return figure(float(value)) if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def differences(meta_a: dict, tokens_a: float | None, meta_b: dict, tokens_b: float | None) -> list[Difference]:
    """Every term of the contract on which the two runs differ; a term one run did not record
    is listed but cannot block (it cannot be checked)."""
    found = []
    for term in TERMS:
        a, b = term.read(meta_a, tokens_a), term.read(meta_b, tokens_b)
        if a == b:
            continue
        found.append(Difference(term.name, term.group, shown(a), shown(b),
                                term.blocks and a is not None and b is not None))
    return found


def host_load_difference(load_a: HostLoad | None, load_b: HostLoad | None) -> Difference | None:
    """Other processes' load on the runs' hosts, where one run competed for its cores and the other did not as
    much: each speed then holds a different share of someone else's work. Listed, never blocking."""
    loads = (load_a, load_b)
    if not any(load is not None and load.contended for load in loads):
        return None
    if None not in loads and load_a.contended == load_b.contended and not _loads_differ(load_a, load_b):
        return None
    return Difference(HOST_LOAD, "environment", *(_load_text(load) for load in loads), blocks=False)


def _loads_differ(load_a: HostLoad, load_b: HostLoad) -> bool:
    """By the shares of the CPU the loops got where both were read (what the load did to them), else by the cores
    other processes held."""
    received = (load_a.loop_cpu_received_pct, load_b.loop_cpu_received_pct)
    if None not in received:
        low, high = sorted(received)
        return high >= DIFFERENT_LOAD_RATIO * max(low, 1.0) and high - low >= DIFFERENT_LOAD_POINTS
    return abs(load_a.other_cpu_cores - load_b.other_cpu_cores) >= CONTENDED_CORES


def busier(load_a: HostLoad, load_b: HostLoad) -> bool:
    """Whether B's host took more from its loop than A's did: by the loops' waits for a core where both were
    read, else by the cores other processes held."""
    if load_a.loop_cpu_wait_pct is not None and load_b.loop_cpu_wait_pct is not None:
        return load_b.loop_cpu_wait_pct > load_a.loop_cpu_wait_pct
    return load_b.other_cpu_cores > load_a.other_cpu_cores


def host_load_caution(difference: Difference) -> str:
    """What a host-load difference means for the comparison's speed, and what to do."""
    return (f"but the hosts' load differed (A: {difference.a}; B: {difference.b}), so the speeds measure other jobs "
            f"too: record both back to back, or on a quiet machine")


def _load_text(load: HostLoad | None) -> str:
    if load is None:
        return shown(None)
    taken = f"{load.other_cpu_cores:.1f} of {load.cpu_count} CPUs taken by other processes"
    if load.loop_cpu_wait_pct is None:
        return taken
    return f"{taken}, the loop waiting for a core {load.loop_cpu_wait_pct:.0f} % of the time it wanted one"
