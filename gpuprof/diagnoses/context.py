"""What every rule looks at: the run, its summary, and views derived once for all rules."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import cached_property

import pandas as pd

from gpuprof.analysis.run.host_load import COLUMNS as HOST_LOAD_COLUMNS
from gpuprof.analysis.run.host_load import HostLoad, host_load
from gpuprof.analysis.run.hotspots import COLUMNS as HOTSPOT_COLUMNS
from gpuprof.analysis.run.hotspots import hotspots, site_label, top_sites
from gpuprof.analysis.run.ranks import hangs, rank_outcomes
from gpuprof.analysis.run.summary import (
    RunSummary, first_row, measured_samples, measured_steps, primary_device, summarize, trace_summary,
)
from gpuprof.diagnoses.fits import Hardware, parse_capability
from gpuprof.run import query as q
from gpuprof.run import schema
from gpuprof.errors import GpuprofError

log = logging.getLogger(__name__)

# Compute capability from which matmuls can run on tensor cores (Volta).
TENSOR_CORE_MIN_CAPABILITY = (7, 0)
# NVML clock-event reasons that mean heat or power, not idleness or an application setting.
THERMAL_OR_POWER = ("thermal", "power", "hw_slowdown")
THROTTLED = q.list_contains_any("throttle_reasons", THERMAL_OR_POWER)
# What the rules read of the measured device samples, computed in the summary's one scan of the
# system stream (see `measured_sample_figures`) and read as `ctx.device_figures`.
DEVICE_FIGURES = {
    "samples": q.count(),
    "throttled_samples": q.count_where(THROTTLED),
    "gpu_util_mean_pct": q.mean("gpu_util_pct"),
    "gpu_util_samples": q.count("gpu_util_pct"),
}


class Context:
    """What every rule may read, whether it looks at a run or at a bare trace: the meta (the run's,
    or what a trace records of its devices and ranks), the summary, the trace analyzer."""

    summary: RunSummary
    # True for a bare torch.profiler trace: only rules registered with `on_trace` run on it.
    bare_trace = False

    @property
    def meta(self) -> dict:
        raise NotImplementedError

    @property
    def config(self) -> dict:
        return self.meta.get("config") or {}

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
        """The first device, as the summary describes it ({} when none was recorded)."""
        return primary_device(self.meta)

    @property
    def has_tensor_cores(self) -> bool:
        capability = parse_capability(self.device.get("capability"))
        return self.on_gpu and capability is not None and capability >= TENSOR_CORE_MIN_CAPABILITY

    @property
    def hardware(self) -> Hardware:
        """What the device and host the run was recorded on support: every fix that names a dtype, TF32,
        pinned memory or loader workers asks it (gpuprof.diagnoses.fits)."""
        return Hardware.of(self.meta, self.host_cpu_count)

    @property
    def device_figures(self) -> dict:
        """`DEVICE_FIGURES` over the measured device samples (None where unknown)."""
        return self.summary.device_figures

    def memo(self, key: str, compute):
        """`compute()`, computed once per context for views that more than one rule derives."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def loop(self, part: str) -> dict:
        """What capture saw of the training loop itself: meta["loop"][part] for part in model,
        optimizer, loader, torch ({} when not recorded; a bare trace has only what its ops show of the model,
        `traced_model`); rules read the loop here."""
        facts = (self.meta.get("loop") or {}).get(part)
        return facts if isinstance(facts, dict) else {}

    @property
    def loop_clipping(self) -> dict | None:
        """{clipped_steps, max_norm} where capture saw the loop clip its gradients (meta["gradient_clipping"];
        max_norm None where it was a tensor, or the clip ran inside compiled code); None where it did not."""
        clipping = self.meta.get("gradient_clipping") or {}  # its types checked by the reader (run.schema)
        return clipping if clipping.get("clipped_steps") else None

    def config_value(self, *keys: str):
        """The first of `keys` present in the run's config (workloads name their knobs differently).
        Evidence only: a user's loop has no such config, so no rule may fire on it alone."""
        return next((self.config[key] for key in keys if key in self.config), None)

    @property
    def recorded_by_workload(self) -> bool:
        """A run of `gpuprof train` (the reference workload), whose knobs are command-line flags."""
        return self.config.get("recorded_by") == schema.WORKLOAD_COMMAND

    def workload_flags(self, flags: str) -> str:
        """" (gpuprof train: FLAGS)" for a run of the workload, else nothing: a user's loop has no such flags."""
        return f" ({schema.WORKLOAD_COMMAND}: {flags})" if self.recorded_by_workload else ""

    @property
    def hotspots(self) -> pd.DataFrame:
        """Each phase's share split among the user's functions (gpuprof.analysis.run.hotspots): a run's stack
        samples; none in a bare trace."""
        return pd.DataFrame(columns=HOTSPOT_COLUMNS)

    def top_site(self, phase: str) -> str | None:
        """The user function holding most of `phase`'s samples, as `get_batch (train.py:116)`; else the user
        function gpuprof timed for that phase (meta.json's `phase_sources`); None when neither is known."""
        rows = top_sites(self.hotspots, phase, limit=1)
        if not rows.empty:
            return rows["label"].iloc[0]
        sources = [source for source in self.meta.get("phase_sources") or [] if source.get("role") == phase]
        return site_label(sources[0]["function"], sources[0]["file"], sources[0]["line"]) if sources else None

    @property
    def host_cpu_count(self) -> int | None:
        """The CPUs of the first rank's host; None where not recorded (a bare trace)."""
        return None

    @property
    def device_trace(self):
        """The trace analyzer when the traces hold device (GPU) activity, else None."""
        trace = self.trace
        return trace if trace is not None and trace.has_device_activity else None


@dataclass
class TraceContext(Context):
    """A bare torch.profiler trace (one rank's, or several ranks of one window) as the rules see it:
    `trace` is its analyzer, `summary` the step times it records (`trace_summary`), `meta` its devices."""

    trace: object
    summary: RunSummary
    trace_meta: dict
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    bare_trace = True

    @property
    def meta(self) -> dict:
        return self.trace_meta

    @property
    def gradient_accumulation(self) -> bool | None:
        return None  # a trace does not say how many micro-batches make a step


@dataclass
class RunContext(Context):
    run: object
    summary: RunSummary
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def of(cls, run) -> "RunContext":
        return cls(run=run, summary=summarize(run, DEVICE_FIGURES))

    @property
    def meta(self) -> dict:
        return self.run.meta

    @property
    def gradient_accumulation(self) -> bool:
        """Whether a measured step ran more than one micro-batch."""
        return bool(self.measured({"most": q.maximum("micro_batches")})["most"].iloc[0] > 1)

    # Data access: the run's streams are aggregated out of core (run.query); rules never load
    # every row of every rank, which at hundreds of ranks does not fit in memory.
    def measured(self, aggregates: dict, by: str | None = None) -> pd.DataFrame:
        """`aggregates` (gpuprof.run.query) over the step rows of all ranks after the warm-up the summary excluded."""
        return self._aggregate("steps", aggregates, by, tuple(measured_steps(self.summary.warmup)))

    def all_steps(self, aggregates: dict) -> dict:
        """`aggregates` over every step row of every rank (warm-up included), as a dict of numbers (None when unknown)."""
        return first_row(self._aggregate("steps", aggregates, None, ()))

    def _aggregate(self, stream: str, aggregates: dict, by, where: tuple) -> pd.DataFrame:
        """One engine query per distinct question: rules that ask the same (memory ones do) share it."""
        key = ("aggregate", stream, tuple(aggregates.items()), by, where)
        return self.memo(key, lambda: self.run.query.aggregate(stream, aggregates, by=by, where=list(where)))

    @cached_property
    def _measured_device_rows(self) -> list:
        return [q.device_rows(), *measured_samples(self.run.query, self.summary.warmup)]

    def device_samples(self, aggregates: dict) -> dict:
        """`aggregates` over the device rows of the system samples taken during measured steps."""
        return first_row(self._aggregate("system", aggregates, None, tuple(self._measured_device_rows)))

    def device_sample_counts(self, column: str) -> pd.Series:
        """How often each entry of a list column (throttle reasons) occurs in the measured device samples."""
        return self.run.query.list_value_counts("system", column, where=self._measured_device_rows)

    def step_rows(self, where: q.Filter, columns=None) -> pd.DataFrame:
        """The step rows (all ranks) a query filter keeps: for rare rows (non-finite steps), never all of them."""
        return self.run.query.frame("steps", columns, where=[where])

    @cached_property
    def rank_outcomes(self) -> pd.DataFrame:
        """How each rank ended (gpuprof.analysis.run.ranks)."""
        return rank_outcomes(self.run)

    @cached_property
    def hangs(self) -> pd.DataFrame:
        return hangs(self.run)

    @cached_property
    def first_rank(self) -> int | None:
        ranks = self.run.query.ranks_with_steps
        return ranks[0] if ranks else None

    @cached_property
    def first_rank_steps(self) -> pd.DataFrame:
        """Every step of the lowest rank (the loop's own series: loss, grad norm, scaler)."""
        return self.run.query.rank_frame("steps", self.first_rank if self.first_rank is not None else 0)

    @cached_property
    def first_rank_layers(self) -> pd.DataFrame:
        """Per-layer gradient norms of the lowest rank."""
        return self.run.query.rank_frame("layers", self.first_rank if self.first_rank is not None else 0)

    @cached_property
    def hotspots(self) -> pd.DataFrame:
        return hotspots(self.run, self.summary)

    @property
    def host_cpu_count(self) -> int | None:
        rank = self.first_rank
        return None if rank is None else (self.run.rank_meta.get(rank) or {}).get("host_cpu_count")

    @cached_property
    def host_load(self) -> HostLoad | None:
        """What other processes took of the first rank's host (gpuprof.analysis.run.host_load)."""
        rank = self.first_rank
        if rank is None:
            return None
        return host_load(self.first_rank_steps, self.run.query.rank_frame("system", rank, HOST_LOAD_COLUMNS),
                         self.host_cpu_count,
                         self.summary.warmup.first_measured_step, self.meta.get("sample_interval_s"))

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


# Ops that are fused attention: torch's scaled_dot_product_attention (and the kernels it dispatches to), flash-attn.
FUSED_ATTENTION_OPS = ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product", "flash_attn")
# softmax(QK^T)V computed op by op: a softmax beside batched matmuls (a linear layer runs addmm or mm, not bmm).
EAGER_ATTENTION_OPS = {"aten::softmax", "aten::bmm"}
COMPILED_REGIONS = ("Torch-Compiled Region", "CompiledFunction")


def traced_model(analysis) -> dict:
    """What a trace's op names show of the model, in the keys of a run's meta["loop"]["model"]: its attention
    (sdpa when a fused attention op ran, eager for a softmax beside batched matmuls and no fused op, else None:
    no attention seen) and whether torch.compile ran it."""
    names: set[str] = set()
    for rank_trace in analysis.trace.ranks.values():
        names.update(str(name) for name in rank_trace.events["name"].unique())
    fused = any(name.startswith(FUSED_ATTENTION_OPS) for name in names)
    attention = "sdpa" if fused else "eager" if EAGER_ATTENTION_OPS <= names else None
    return {"attn_implementation": attention, "compiled": any(name.startswith(COMPILED_REGIONS) for name in names)}


def trace_meta(analysis) -> dict:
    """What a bare trace records of the run's world and devices, in the run meta's keys: Kineto's
    `distributedInfo` and `deviceProperties` (CUDA and ROCm alike are torch's "cuda" devices), and what its
    ops show of the model (`traced_model`)."""
    ranks = list(analysis.trace.ranks.values())
    first = ranks[0]
    properties = first.device_properties[0] if first.device_properties else {}
    device = {"kind": "cuda" if analysis.has_device_activity else "cpu", "name": properties.get("name")}
    if "computeMajor" in properties:
        device["capability"] = f"{properties['computeMajor']}.{properties.get('computeMinor', 0)}"
    if properties.get("totalGlobalMem"):
        device["total_memory_bytes"] = int(properties["totalGlobalMem"])
    world_size = max((rank.world_size or 0 for rank in ranks), default=0) or len(ranks)
    return {"world_size": world_size, "devices": [device], "distributed": {"backend": first.backend},
            "loop": {"model": traced_model(analysis)}}


def trace_context(analysis, name: str, path: str) -> TraceContext:
    """The rules' view of a bare trace (`analysis`, a TraceAnalysis)."""
    meta = trace_meta(analysis)
    return TraceContext(trace=analysis, summary=trace_summary(name, path, analysis.step_breakdown(), meta,
                                                              DEVICE_FIGURES), trace_meta=meta)
