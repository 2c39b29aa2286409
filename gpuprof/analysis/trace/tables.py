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
    "top_cpu_ops": "Operators: host and device time, total and self",
    "cpu_ops_by_shape": "Operators by input shape",
    "cpu_ops_by_stack": "Operators by call stack",
    "kernels_by_op": "Kernels by the operator that launched them",
    "memory_summary": "Memory per device",
    "memory_timeline": "Memory over time",
    "memory_by_op": "Memory allocated by operator",
    "module_times": "Modules",
}
TABLE_NAMES = tuple(TABLE_TITLES)
# What every reader of a trace analysis is told about its window (TraceAnalysis's default).
LAST_STEP_LEFT_OUT = "The last profiler step is left out, as HTA does (the profiler often stops inside it)"
# The views only a trace recorded with a profiler option can fill: their tables, the option, and why it.
VIEW_NEEDS = {
    "Input shapes": (("cpu_ops_by_shape",), "record_shapes=True", ""),
    "Call stacks": (("cpu_ops_by_stack",), "with_stack=True", ""),
    "Memory": (("memory_summary", "memory_timeline", "memory_by_op"), "profile_memory=True", ""),
    "Modules": (("module_times",), "with_stack=True",
                "the nn.Module frames come from torch's Python tracer; with_modules=True adds TorchScript modules"),
}


def missing_note(view: str) -> str:
    """What a reader of `view` is told when the trace lacks its profiler option (the same keyword in
    torch.profiler.profile and in gpuprof.profile, whose trace windows pass it on)."""
    _, option, why = VIEW_NEEDS[view]
    return (f"{view}: not in this trace; record it by passing {option} to torch.profiler.profile(...) (or to "
            f"gpuprof.profile(...) for a run's trace windows)" + (f"; {why}" if why else ""))


def missing_views(tables: dict) -> list[str]:
    """The views of VIEW_NEEDS whose tables (`tables`: name -> DataFrame) are all empty."""
    return [view for view, (names, _, _) in VIEW_NEEDS.items()
            if all(name in tables and len(tables[name]) == 0 for name in names)]
