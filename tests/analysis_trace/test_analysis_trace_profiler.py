"""A real torch.profiler trace of a tiny CPU model, recorded in the test."""

from gpuprof.analysis.trace import TraceAnalysis
from gpuprof.analysis.trace.steps import CATEGORIES


def test_real_cpu_profiler_trace(cpu_profiler_trace):
    analysis = TraceAnalysis(cpu_profiler_trace)
    assert not analysis.has_device_activity
    assert analysis.temporal_breakdown().empty and analysis.top_kernels().empty
    steps = analysis.step_breakdown()
    assert len(steps) == 3  # four active steps recorded, the last left out
    summed = steps[[f"{c}_us" for c in CATEGORIES] + ["other_us"]].sum(axis=1)
    assert (summed == steps["step_time_us"]).all()
    assert (steps["cpu_exec_us"] > 0).all() and (steps["dataloader_us"] > 0).all()
    ops = analysis.top_cpu_ops(limit=50)["name"].tolist()
    assert "aten::addmm" in ops or "aten::linear" in ops


def test_real_cpu_profiler_trace_with_the_last_step(cpu_profiler_trace):
    assert len(TraceAnalysis(cpu_profiler_trace, include_last_step=True).step_breakdown()) == 4
