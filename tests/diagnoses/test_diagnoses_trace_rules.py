"""Trace-based rules on real torch.profiler traces from other projects (../shared/traces).

The traces are real GPU recordings (A100 with NCCL, V100 fp32, two ranks sampled from a
128-rank job, a CPU-only one); a CPU machine cannot record such traces, so each is placed in
a run written through the real RunWriter with the matching device. Tests skip cleanly when
the shared folder is absent.
"""

from __future__ import annotations

import pytest
from diagnoses_helpers import fired

from gpuprof.analysis.trace import TraceAnalysis
from gpuprof.diagnoses import diagnose
from gpuprof.diagnoses.context import RunContext
from gpuprof.diagnoses.registry import all_rules
from gpuprof.diagnoses.rules import communication, host_sync, kernels

all_rules()
V100 = {"index": 0, "name": "Tesla V100-SXM2-32GB", "kind": "cuda", "total_memory_bytes": 32 * 2**30,
        "capability": "7.0"}
TRACE_RULES = ("launch-bound", "pageable-memcpy", "communication-bound")


@pytest.fixture
def traced(write_gpu_run, shared_trace):
    """traced(folder, **meta) -> a GPU run (no NVML samples) holding that real trace."""

    def make(folder, **meta):
        return write_gpu_run(meta=meta, samples=False, traces=shared_trace(folder))

    return make


def test_launch_bound(traced, shared_trace):
    (finding,) = fired(traced("a100_2rank_nccl"), "launch-bound")
    analysis = TraceAnalysis(shared_trace("a100_2rank_nccl"))
    assert finding.evidence["idle_time_pct"] == analysis.temporal_breakdown()["idle_time_pct"].iloc[0]
    assert finding.evidence["short_kernel_pct"] >= kernels.LAUNCH_BOUND_SHORT_KERNEL_PCT
    assert not fired(traced("v100_ns_timestamps", devices=[V100]), "launch-bound")  # busy GPU
    assert not fired(traced("sampled_world128", world_size=2), "launch-bound")  # idle, long kernels


def test_communication_bound(traced):
    (finding,) = fired(traced("sampled_world128", world_size=2), "communication-bound")
    assert finding.evidence["exposed_comm_pct"] >= communication.EXPOSED_COMM_WARNING_PCT
    assert finding.est_gain_pct == pytest.approx(finding.evidence["exposed_comm_pct"])
    assert not fired(traced("a100_2rank_nccl", world_size=2), "communication-bound")  # little exposed comm
    assert not fired(traced("v100_ns_timestamps", devices=[V100]), "communication-bound")  # no comm


def test_pageable_memcpy(traced):
    (finding,) = fired(traced("sampled_world128", world_size=2), "pageable-memcpy")
    assert all("Pageable" in name for name in finding.evidence["copies"])
    assert not fired(traced("a100_2rank_nccl"), "pageable-memcpy")


def test_host_device_sync_from_trace(traced):
    (finding,) = fired(traced("sampled_world128", world_size=2), "host-device-sync")
    assert finding.evidence["source"] == "trace"
    assert "aten::_local_scalar_dense" in finding.evidence["by_cpu_op"]  # what .item() runs
    assert finding.evidence["syncs_per_step"] >= host_sync.SYNCS_PER_STEP_MIN
    assert not fired(traced("a100_2rank_nccl"), "host-device-sync")  # NCCL's event syncs only


def test_fp32_matmul_from_trace(traced):
    (finding,) = fired(traced("v100_ns_timestamps", devices=[V100], compute_dtype=None), "fp32-matmul")
    assert finding.evidence["tensor_core_matmul_pct"] == 0.0  # volta_sgemm: plain fp32
    # fp32 on an A100 whose matmuls the trace shows on tensor cores (TF32): nothing to fix.
    assert not fired(traced("a100_2rank_nccl", compute_dtype="fp32"), "fp32-matmul")


def test_low_gpu_utilization_from_trace(traced):
    (finding,) = fired(traced("a100_2rank_nccl"), "low-gpu-utilization")
    assert finding.evidence["source"] == "trace" and finding.severity == "critical"
    assert not fired(traced("v100_ns_timestamps", devices=[V100]), "low-gpu-utilization")


def test_cpu_only_trace_triggers_no_device_rule(traced):
    run = traced("cpu_only")
    assert not RunContext.of(run).device_trace
    assert diagnose(run, strict=True) == []
