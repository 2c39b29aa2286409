"""The run directory's names and columns: the one place code takes them from.

docs/run-format.md is the human-readable contract; these tuples are its machine copy.
"""

from __future__ import annotations

FORMAT = "gpuprof-run"
FORMAT_VERSION = 1

RUN_META = "meta.json"
RANK_META = "meta.json"
TRACES_DIR = "traces"
# The record_function range around gpuprof's own step-end work in a trace window, so analyses
# can tell its host reads of the loss and flags from the loop's own.
OWN_WORK_RANGE = "gpuprof.bookkeeping"
SNAPSHOTS_DIR = "snapshots"
NUMERICS_DIR = "numerics"

STREAM_COLUMNS: dict[str, tuple[str, ...]] = {
    "steps": (
        "step", "rank", "time_unix_s", "step_time_s", "data_time_s", "forward_time_s",
        "backward_time_s", "optimizer_time_s", "other_time_s", "capture_time_s", "micro_batches", "loss", "tokens",
        "tokens_per_s", "flops_per_s", "mfu", "grad_norm", "grad_norm_finite", "loss_finite",
        "scaler_scale", "scaler_growth_tracker", "step_skipped", "lr", "mem_allocated_bytes",
        "mem_reserved_bytes", "mem_peak_allocated_bytes", "mem_alloc_retries", "mem_ooms",
        "mem_nvml_used_bytes", "mem_nvml_gap_bytes", "mem_rss_bytes", "collective_arrival_unix_s",
    ),
    "system": (
        "time_unix_s", "rank", "device_index", "gpu_util_pct", "mem_util_pct", "mem_used_bytes",
        "mem_total_bytes", "power_w", "temp_c", "sm_clock_mhz", "throttle_reasons",
        "pcie_tx_bytes_per_s", "pcie_rx_bytes_per_s", "sm_active_pct", "tensor_active_pct",
        "dram_active_pct", "host_cpu_pct", "proc_rss_bytes", "host_mem_used_bytes",
        "host_mem_total_bytes",
    ),
    "events": ("time_unix_s", "rank", "step", "kind", "severity", "message", "details"),
    "layers": ("step", "rank", "layer", "level", "grad_norm", "update_ratio"),
    # the hang watchdog's beat, every few seconds (gpuprof.capture.watchdog)
    "heartbeats": ("time_unix_s", "rank", "step", "phase", "stalled_s", "collectives", "collective_kind",
                   "collective_seq", "where"),
}
STREAMS = tuple(STREAM_COLUMNS)
LIST_COLUMNS = {"system": ("throttle_reasons",)}
# Booleans (a rank that never wrote one stores an all-null float column instead).
FLAG_COLUMNS = {"steps": ("grad_norm_finite", "loss_finite", "step_skipped")}
SORT_KEYS = {
    "steps": ["step", "rank"],
    "system": ["time_unix_s", "rank"],
    "events": ["time_unix_s", "rank"],
    "layers": ["step", "rank", "layer"],
    "heartbeats": ["time_unix_s", "rank"],
}
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
