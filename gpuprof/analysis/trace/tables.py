"""The trace analyzer's tables: each name is a `TraceAnalysis` method and the table's key in
`gpuprof trace --json`; each title is what people read above it (terminal, report, dashboard).
In report order."""

from __future__ import annotations

TABLE_TITLES = {
    "overview": "Overview (per rank)",
    "temporal_breakdown": "Temporal breakdown (HTA definition)",
    "step_breakdown": "Step time breakdown",
    "kernel_type_breakdown": "Device time by kernel type",
    "top_kernels": "Top kernels",
    "comm_comp_overlap": "Computation/communication overlap",
    "idle_by_stream": "Idle time by cause per stream",
    "launch_summary": "Kernel launches",
    "host_device_syncs": "Host-device synchronizations inside steps",
    "tensor_core_share": "Tensor-core share of matmul time",
    "rank_spread": "Step time per rank",
    "stragglers": "Straggler candidates",
    "top_cpu_ops": "Top CPU ops (inclusive time)",
}
TABLE_NAMES = tuple(TABLE_TITLES)
