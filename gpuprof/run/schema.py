"""The run directory's names and columns: the one place code takes them from.

docs/run-format.md is the human-readable contract; these tuples are its machine copy.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

import msgspec

FORMAT = "gpuprof-run"
FORMAT_VERSION = 1

RUN_META = "meta.json"
RANK_META = "meta.json"
TRACES_DIR = "traces"
# The record_function range around gpuprof's own step-end work in a trace window, so analyses
# can tell its host reads of the loss and flags from the loop's own.
OWN_WORK_RANGE = "gpuprof.bookkeeping"
SNAPSHOTS_DIR = "snapshots"
# meta.json's config["recorded_by"] for a run of the reference workload (its knobs are this command's flags).
WORKLOAD_COMMAND = "gpuprof train"
NUMERICS_DIR = "numerics"

# The phases a step is split into, each timed in the steps stream as `{phase}_time_s`, with what
# each times (docs/capture.md). Capture times all but "other", the step time no phase covers;
# evaluation inside the loop is no part of the training step, so its split leaves "eval" out.
STEP_PHASES = {
    "data": "waiting for and preparing the next batch",
    "forward": "the model's forward pass",
    "backward": "the backward pass",
    "optimizer": "the optimizer's update",
    "eval": "evaluation inside the loop",
    "other": "step time no phase covers",
}
EVAL_PHASE = "eval"
OTHER_PHASE = "other"
TIMED_PHASES = tuple(phase for phase in STEP_PHASES if phase != OTHER_PHASE)
SPLIT_PHASES = tuple(phase for phase in STEP_PHASES if phase != EVAL_PHASE)
MODEL_PHASES = ("data", "forward", "backward")  # timed by the model's hooks: lost where it cannot be hooked
COMPUTE_PHASES = ("forward", "backward", "optimizer")  # the work a compute-bound step spends its time on
# Where NaN forensics' re-run found the first non-finite value made (a `nonfinite` event's
# details["phase"]), and what each says about it, for people.
BLAME_PHASES = {
    "forward": "the model's forward pass made it",
    "backward": "the backward pass made it, in a gradient",
    "loss": "the loop's loss computation, after the model's outputs, made it",
    "optimizer": "the optimizer's update made it, in the weights or the optimizer's state",
    "state": "it was already in the weights or the optimizer's state when the step began",
}

STREAM_COLUMNS: dict[str, tuple[str, ...]] = {
    "steps": (
        "step", "rank", "time_unix_s", "step_time_s", *(f"{phase}_time_s" for phase in STEP_PHASES),
        "capture_time_s", "micro_batches", "loss", "tokens",
        "tokens_per_s", "flops_per_s", "mfu", "grad_norm", "grad_norm_finite", "loss_finite",
        "scaler_scale", "scaler_growth_tracker", "step_skipped", "lr", "mem_allocated_bytes",
        "mem_reserved_bytes", "mem_peak_allocated_bytes", "mem_alloc_retries", "mem_ooms",
        "mem_nvml_used_bytes", "mem_nvml_gap_bytes", "mem_rss_bytes", "collective_arrivals_unix_s",
    ),
    "system": (
        "time_unix_s", "rank", "device_index", "gpu_util_pct", "mem_util_pct", "mem_used_bytes",
        "mem_total_bytes", "power_w", "temp_c", "sm_clock_mhz", "throttle_reasons",
        "pcie_tx_bytes_per_s", "pcie_rx_bytes_per_s", "sm_active_pct", "tensor_active_pct",
        "dram_active_pct", "host_cpu_pct", "job_cpu_pct", "loop_cpu_wait_pct", "proc_rss_bytes", "host_mem_used_bytes",
        "host_mem_total_bytes",
    ),
    "events": ("time_unix_s", "rank", "step", "kind", "severity", "message", "details"),
    "stacks": ("time_unix_s", "rank", "step", "phase", "function", "file", "line", "running_line", "inner_function",
               "inner_file", "inner_line", "loop_file", "loop_line"),
    "layers": ("step", "rank", "layer", "level", "grad_norm", "update_ratio"),
    # the hang watchdog's beat, every few seconds (gpuprof.capture.watchdog)
    "heartbeats": ("time_unix_s", "rank", "step", "phase", "stalled_s", "collectives", "collective_kind",
                   "collective_seq", "where"),
}
STREAMS = tuple(STREAM_COLUMNS)
# Lists, with what their items hold.
LIST_COLUMNS = {"system": {"throttle_reasons": "text"}, "steps": {"collective_arrivals_unix_s": "number"}}
# Booleans (a rank that never wrote one stores an all-null float column instead).
FLAG_COLUMNS = {"steps": ("grad_norm_finite", "loss_finite", "step_skipped")}
# Text columns; every other documented column (lists, flags, details aside) holds numbers.
TEXT_COLUMNS = {"events": ("kind", "severity", "message"), "layers": ("layer", "level"),
                "stacks": ("phase", "function", "file", "inner_function", "inner_file", "loop_file"),
                "heartbeats": ("phase", "collective_kind", "where")}
DETAILS_COLUMN = "details"  # of events: a JSON object (JSON text in Parquet)
SORT_KEYS = {
    "steps": ["step", "rank"],
    "system": ["time_unix_s", "rank"],
    "events": ["time_unix_s", "rank"],
    "stacks": ["time_unix_s", "rank"],
    "layers": ["step", "rank", "layer"],
    "heartbeats": ["time_unix_s", "rank"],
}
# Rows of a steps file as gpuprof writes them, which the reader checks (a verdict drawn from other rows would be
# false): `step` a whole number from 0 up, rising row by row (each step once); these columns finite and not
# negative, in every row (REQUIRED_STEP_VALUES) or where present (STEP_AMOUNTS).
REQUIRED_STEP_VALUES = ("step_time_s",)
STEP_AMOUNTS = (*(f"{phase}_time_s" for phase in STEP_PHASES), "capture_time_s", "micro_batches", "tokens")


# Columns that say where a row belongs rather than what was measured.
KEY_COLUMNS = {"step", "rank", "time_unix_s", "device_index"}


def measured_columns(stream: str) -> list[str]:
    """The columns of `stream` that hold a measure a tracker can plot: its numbers and flags."""
    return [column for column in STREAM_COLUMNS[stream]
            if column not in KEY_COLUMNS and column_kind(stream, column) in ("number", "flag")]


def column_kind(stream: str, column: str) -> str | None:
    """What a documented column holds: "number", "flag", "text", "list" or "details"; None for an extra one."""
    if column not in STREAM_COLUMNS[stream]:
        return None
    if column == DETAILS_COLUMN:
        return "details"
    for kind, columns in (("list", LIST_COLUMNS), ("flag", FLAG_COLUMNS), ("text", TEXT_COLUMNS)):
        if column in columns.get(stream, ()):
            return kind
    return "number"


# The `error` of a rank_failed event when torchrun stopped the rank with SIGTERM: nothing was raised in it.
TERMINATED_ERROR = "terminated by SIGTERM"
# Severity of an event or a finding, most severe first (findings are ranked in this order).
SEVERITIES = ("critical", "warning", "info")


class EventKind:
    """The `kind` of an event record: written by capture and numerics, read by the diagnoses,
    the report and the dashboard. Each kind is spelled here only."""

    # capture
    COLLECTOR_DISABLED = "collector_disabled"
    PROFILER_DISABLED = "profiler_disabled"
    DEVICE_METRICS_OFF = "device_metrics_off"
    PHASE_UNAVAILABLE = "phase_unavailable"
    TRACE_WRITTEN = "trace_written"
    OOM = "oom"
    STEP_SKIPPED = "step_skipped"
    LR_STEP_ON_SKIPPED = "lr_step_on_skipped_step"
    HANG = "hang"
    HANG_ENDED = "hang_ended"
    RANK_FAILED = "rank_failed"
    # numerics
    NONFINITE = "nonfinite"
    NONFINITE_STEPS = "nonfinite_steps"
    STATE_KEEPING_FALLBACK = "state_keeping_fallback"
    STATE_PLACEMENT = "state_placement"
    LOSS_SPIKE = "loss_spike"
    GRAD_NORM_SPIKE = "grad_norm_spike"
    EXPLODING_GRADIENT = "exploding_gradient"
    VANISHING_GRADIENT = "vanishing_gradient"
    SCALER_BACKOFF = "scaler_backoff"
    SCALER_RECOVERY = "scaler_recovery"
    SCALER_PERSISTENT_OVERFLOW = "scaler_persistent_overflow"
    SCALER_SCALE_BELOW_ONE = "scaler_scale_below_one"


EVENT_KINDS = tuple(value for name, value in vars(EventKind).items() if name.isupper())


def rank_dir_name(rank: int) -> str:
    return f"rank-{rank}"


def bundle_in_run(run_dir: str | Path, recorded: str) -> Path:
    """The replay bundle an event names, in the run's numerics folder where the format keeps it: the path
    recorded at training time is relative to that process's working folder, or to a machine the run may
    since have left."""
    return Path(run_dir) / NUMERICS_DIR / Path(recorded).name


# A blame's source as numerics records it: "/abs/path/file.py:12 in function: code".
SOURCE_LINE = re.compile(r"^(?P<file>.+?):(?P<line>\d+) in (?P<function>[^:]+)(?:: (?P<code>.*))?$")
INSTALLED_PACKAGES = re.compile(r".*[/\\](?:site|dist)-packages[/\\]")


def source_text(source: str) -> str:
    """A blame's source with its file as a person names it: an installed package's from the package
    ("transformers/activations.py:66 in forward: ..."), one's own by its name ("train.py:40 in main: ...")."""
    match = SOURCE_LINE.match(source)
    if match is None:
        return source
    path = match["file"]
    shown = INSTALLED_PACKAGES.sub("", path) if INSTALLED_PACKAGES.match(path) else Path(path).name
    return f"{shown}:{match['line']} in {match['function']}" + (f": {match['code']}" if match["code"] else "")


def in_installed_package(source: str) -> bool:
    """Whether a blame's source is a line of an installed package's (site-packages), not the user's."""
    match = SOURCE_LINE.match(source)
    return match is not None and INSTALLED_PACKAGES.match(match["file"]) is not None


# ---------------------------------------------------------------- what meta files must hold
# The reader checks every field it or the analysis reads, once (gpuprof.run.reader.read_meta);
# fields not listed here are kept unchecked (collectors add their own). Null is allowed wherever
# a fact may be unknown, and every field may be absent (older runs, other writers).


class _Facts(msgspec.Struct, forbid_unknown_fields=False, omit_defaults=True):
    pass


class DeviceFacts(_Facts):
    index: int | None = None
    name: str | None = None
    kind: str | None = None
    total_memory_bytes: int | None = None
    capability: str | list[int] | None = None  # "8.0", or [8, 0]


class ModelFacts(_Facts, rename={"class_name": "class"}):
    class_name: str | None = None
    wrapper: str | None = None
    n_params: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    d_model: int | None = None
    seq_len: int | None = None
    flops_per_token: float | None = None


class LoopModelFacts(_Facts, rename={"class_name": "class"}):
    class_name: str | None = None
    attn_implementation: str | None = None
    compiled: bool | None = None
    module_types: dict[str, int] | None = None


class OptimizerFacts(_Facts, rename={"class_name": "class"}):
    class_name: str | None = None
    fused: bool | None = None
    foreach: bool | None = None
    param_groups: int | None = None
    fused_supported: bool | None = None
    params_without_optimizer: int | None = None
    params_without_optimizer_names: list[str] | None = None
    members: list["OptimizerFacts"] | None = None


class LoaderFacts(_Facts, rename={"class_name": "class"}):
    class_name: str | None = None
    num_workers: int | None = None
    pin_memory: bool | None = None
    prefetch_factor: int | None = None
    persistent_workers: bool | None = None
    batch_size: int | None = None


class TorchSettings(_Facts):
    float32_matmul_precision: str | None = None
    cuda_matmul_allow_tf32: bool | None = None
    cudnn_allow_tf32: bool | None = None
    cudnn_benchmark: bool | None = None


class LoopFactsSchema(_Facts):
    model: LoopModelFacts | None = None
    optimizer: OptimizerFacts | None = None
    loader: LoaderFacts | None = None
    torch: TorchSettings | None = None
    autocast_dtype: str | None = None


class DistributedFacts(_Facts):
    backend: str | None = None
    world_size: int | None = None
    sharding: dict[str, Any] | None = None  # FSDP: parallel, fsdp_units, state bytes


class GradientClipping(_Facts):
    clipped_steps: Annotated[int, msgspec.Meta(ge=0)] = 0
    max_norm: float | None = None


class RunMeta(_Facts):
    """`meta.json` of a run (docs/run-format.md)."""

    format: str
    format_version: int
    run_id: str | None = None
    name: str | None = None
    status: str | None = None
    start_unix_s: float | None = None
    end_unix_s: float | None = None
    world_size: Annotated[int, msgspec.Meta(ge=1)] | None = None
    process_group: bool | None = None  # the ranks joined a torch.distributed group (None: recorded before this field)
    versions: dict[str, str | None] | None = None
    devices: list[DeviceFacts] | None = None
    model: ModelFacts | None = None
    loop: LoopFactsSchema | None = None
    config: dict[str, Any] | None = None
    compute_dtype: str | None = None
    peak_flops_per_s: float | None = None
    distributed: DistributedFacts | None = None
    gradient_clipping: GradientClipping | None = None
    options: dict[str, Any] | None = None
    clock: str | None = None
    sample_interval_s: float | None = None


class RankMeta(_Facts):
    """`rank-R/meta.json`."""

    rank: Annotated[int, msgspec.Meta(ge=0)] | None = None
    local_rank: int | None = None
    world_size: Annotated[int, msgspec.Meta(ge=1)] | None = None
    run_id: str | None = None
    status: str | None = None
    start_unix_s: float | None = None
    end_unix_s: float | None = None
    device: DeviceFacts | None = None
    clock: str | None = None
    host: str | None = None
    host_cpu_count: Annotated[int, msgspec.Meta(ge=1)] | None = None
    pid: int | None = None
    platform: str | None = None
