"""`TraceAnalysis`: the entry point; each method is one call into a per-topic module.

    analysis = TraceAnalysis("traces/")          # a file, a directory of per-rank files, or a list
    analysis.temporal_breakdown()                # pandas DataFrames, units in column names

By default the last profiler step is left out of every analysis, as HTA does (it is
often cut short when the profiler stops); pass include_last_step=True to keep it.
"""

from __future__ import annotations

from functools import cached_property

import pandas as pd

from gpuprof.analysis.trace import across_ranks, cpu_ops, events, idle, kernels, launches, overlap, steps, syncs
from gpuprof.analysis.trace import collectives, memory, nn_modules
from gpuprof.analysis.trace import tensor_cores, temporal
from gpuprof.analysis.trace.loader import Trace, load_trace


class TraceAnalysis:
    def __init__(self, path, *, include_last_step: bool = False, fallback_rank: int | None = None):
        self.trace: Trace = events.windowed(load_trace(path, fallback_rank), include_last_step)
        self.include_last_step = include_last_step

    @property
    def ranks(self) -> list[int]:
        return list(self.trace.ranks)

    @property
    def has_device_activity(self) -> bool:
        return any(rank_trace.has_device_activity for rank_trace in self.trace.ranks.values())

    def overview(self) -> pd.DataFrame:
        return events.overview(self.trace)

    @cached_property
    def _temporal(self) -> pd.DataFrame:
        return temporal.temporal_breakdown(self.trace)

    def temporal_breakdown(self) -> pd.DataFrame:
        return self._temporal.copy()

    @cached_property
    def _steps(self) -> pd.DataFrame:
        return steps.step_breakdown(self.trace)

    def step_breakdown(self) -> pd.DataFrame:
        return self._steps.copy()

    def kernel_type_breakdown(self) -> pd.DataFrame:
        return kernels.kernel_type_breakdown(self.trace)

    def top_kernels(self, limit: int = 10) -> pd.DataFrame:
        return kernels.top_kernels(self.trace, limit)

    def idle_by_stream(self, kernel_wait_us: float = idle.KERNEL_WAIT_US) -> pd.DataFrame:
        return idle.idle_by_stream(self.trace, kernel_wait_us)

    def comm_comp_overlap(self) -> pd.DataFrame:
        return overlap.comm_comp_overlap(self.trace)

    def collective_times(self) -> pd.DataFrame:
        return collectives.collective_times(self.trace)

    def kernel_launches(self) -> pd.DataFrame:
        return launches.kernel_launches(self.trace)

    def launch_summary(self) -> pd.DataFrame:
        return launches.launch_summary(self.trace)

    def host_device_syncs(self) -> pd.DataFrame:
        return syncs.host_device_syncs(self.trace)

    def tensor_core_share(self) -> pd.DataFrame:
        return tensor_cores.tensor_core_share(self.trace)

    def rank_spread(self) -> pd.DataFrame:
        return across_ranks.rank_spread(self._steps)

    def stragglers(self, threshold_pct: float = across_ranks.THRESHOLD_PCT) -> pd.DataFrame:
        return across_ranks.stragglers(self._steps, threshold_pct)

    @cached_property
    def _host_trees(self) -> dict:
        return {rank: cpu_ops.host_tree(rank_trace) for rank, rank_trace in self.trace.ranks.items()}

    @cached_property
    def _op_times(self) -> dict[int, pd.DataFrame]:
        return {rank: cpu_ops.op_times(tree) for rank, tree in self._host_trees.items()}

    def top_cpu_ops(self, limit: int = 10) -> pd.DataFrame:
        return cpu_ops.cpu_op_tables(self._op_times, ["name"], limit, cpu_ops.COLUMNS)

    def cpu_ops_by_shape(self, limit: int = 10) -> pd.DataFrame:
        return cpu_ops.cpu_op_tables(self._op_times, ["name", "input_dims"], limit, cpu_ops.SHAPE_COLUMNS)

    def cpu_ops_by_stack(self, limit: int = 10) -> pd.DataFrame:
        return cpu_ops.cpu_op_tables(self._op_times, ["name", "stack"], limit, cpu_ops.STACK_COLUMNS)

    def kernels_by_op(self, limit: int = 10) -> pd.DataFrame:
        return kernels.kernels_by_op(self.trace, self._host_trees, limit)

    def memory_timeline(self) -> pd.DataFrame:
        return memory.memory_timeline(self.trace)

    def memory_summary(self) -> pd.DataFrame:
        return memory.memory_summary(self.trace)

    def memory_by_op(self, limit: int = 10) -> pd.DataFrame:
        return memory.memory_by_op(self.trace, self._host_trees, limit)

    def module_times(self, limit: int | None = None) -> pd.DataFrame:
        return nn_modules.module_times(self.trace, self._host_trees, limit)
