"""GPU-only rules on runs written through the real RunWriter.

A CPU machine cannot record NVML utilization, tensor-core capability, CUDA allocator
retries or throttle reasons, so each rule here is tested on a written A100 run made to show
the problem, paired with the healthy written run where it must stay silent; the real CPU
runs (test_diagnoses_cpu_silence.py) check these rules stay silent without a GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from diagnoses_helpers import fired

import gpuprof
from gpuprof.diagnoses import diagnose
from gpuprof.diagnoses.registry import all_rules
from gpuprof.diagnoses.rules import memory, throttling, utilization
from gpuprof.report import build_report

all_rules()


def test_healthy_gpu_run_has_no_findings(write_gpu_run):
    assert diagnose(write_gpu_run(), strict=True) == []


def test_low_gpu_utilization(write_gpu_run):
    idle_pct = utilization.GPU_UTIL_CRITICAL_PCT - 10
    (finding,) = fired(write_gpu_run(sample=lambda i: {"gpu_util_pct": idle_pct}), "low-gpu-utilization")
    assert finding.severity == "critical"
    assert finding.evidence["gpu_busy_pct"] == pytest.approx(idle_pct)
    assert finding.evidence["source"] == "nvml" and finding.evidence["gpu_util_p10_pct"] == pytest.approx(idle_pct)
    busy = utilization.GPU_UTIL_WARNING_PCT + 1
    assert not fired(write_gpu_run(sample=lambda i: {"gpu_util_pct": busy}), "low-gpu-utilization")


def test_low_gpu_utilization_ignores_warmup_samples(write_gpu_run):
    idle_during_warmup = write_gpu_run(sample=lambda i: {"gpu_util_pct": 0.0 if i == 0 else 97.0})
    assert not fired(idle_during_warmup, "low-gpu-utilization")


def test_low_mfu_on_a_busy_gpu(write_gpu_run):
    low = utilization.LOW_MFU_PCT / 100 - 0.1
    slow_kernels = {"step": lambda i: {"mfu": low}}
    (finding,) = fired(write_gpu_run(**slow_kernels), "low-mfu")
    assert finding.category == "compute" and finding.severity == "warning"
    assert finding.evidence["mfu_pct"] == pytest.approx(100 * low) and finding.evidence["gpu_busy_pct"] == 97.0
    assert "torch.compile(model)" in finding.fix
    assert finding.est_gain_pct == pytest.approx(100 * (1 - 100 * low / utilization.REACHABLE_MFU_PCT))
    compiled = write_gpu_run(meta={"loop": {"model": {"compiled": True}}}, **slow_kernels)
    (finding,) = fired(compiled, "low-mfu")
    assert "micro-batch" in finding.fix and "torch.compile(model)" not in finding.fix
    assert not fired(write_gpu_run(step=lambda i: {"mfu": utilization.LOW_MFU_PCT / 100 + 0.01}), "low-mfu")
    idle = {"gpu_util_pct": utilization.GPU_UTIL_WARNING_PCT - 1}  # an idle GPU is low-gpu-utilization's
    assert not fired(write_gpu_run(sample=lambda i: idle, **slow_kernels), "low-mfu")


H200_RUNS = Path(__file__).resolve().parents[2] / "sample_runs"


def test_low_mfu_on_the_recorded_h200_runs():
    """GPT-2 124M on an H200 (benchmarks/gpu_validate.py): bf16 with sdpa and fused AdamW, busy 89% of the
    time at 17% MFU, gets the finding and the verdict's next step; the fp32 baseline at 56% does not."""
    optimized = gpuprof.load_run(H200_RUNS / "h200-gpt2-optimized")
    (finding,) = fired(optimized, "low-mfu")
    assert finding.evidence["mfu_pct"] < 20 and finding.evidence["source"] == "nvml"
    assert "(finding low-mfu, est. gain " in build_report(H200_RUNS / "h200-gpt2-optimized").verdict.next_step
    assert not fired(gpuprof.load_run(H200_RUNS / "h200-gpt2-baseline"), "low-mfu")


FP32_LOOP = {"compute_dtype": "fp32", "loop": {"torch": {"float32_matmul_precision": "highest",
                                                         "cuda_matmul_allow_tf32": False}}}


def test_fp32_matmul_on_tensor_cores(write_gpu_run):
    (finding,) = fired(write_gpu_run(meta=FP32_LOOP), "fp32-matmul")
    assert finding.evidence["compute_dtype"] == "fp32"
    assert not fired(write_gpu_run(meta={**FP32_LOOP, "compute_dtype": "bf16"}), "fp32-matmul")
    assert not fired(write_gpu_run(meta={**FP32_LOOP, "config": {"tf32": False}, "loop": {}}), "fp32-matmul")


def test_fp32_matmul_silent_without_tensor_cores(write_gpu_run, gpu_device):
    pascal = [{**gpu_device, "name": "Tesla P100", "capability": "6.0"}]
    assert not fired(write_gpu_run(meta={**FP32_LOOP, "devices": pascal}), "fp32-matmul")


def test_memory_near_limit_and_oom(write_gpu_run, gpu_device):
    total = gpu_device["total_memory_bytes"]
    near = memory.NEAR_LIMIT_WARNING_FRACTION + 0.02
    (finding,) = fired(write_gpu_run(step=lambda i: {"mem_reserved_bytes": near * total}), "memory-near-limit")
    assert finding.severity == "warning"
    assert finding.evidence["peak_used_pct"] == pytest.approx(100 * near)
    (oom,) = fired(write_gpu_run(step=lambda i: {"mem_ooms": int(i == 5)}), "memory-near-limit")
    assert oom.severity == "critical" and oom.evidence["ooms"] == 1


def test_memory_underused(write_gpu_run, gpu_device):
    total = gpu_device["total_memory_bytes"]
    small = memory.UNUSED_BELOW_FRACTION / 2

    def light(i):
        return {"mem_reserved_bytes": small * total, "mem_allocated_bytes": small * total * 0.9}

    (finding,) = fired(write_gpu_run(step=light), "memory-underused")
    assert finding.evidence["headroom_factor"] == pytest.approx(1 / small)
    assert not fired(write_gpu_run(), "memory-underused")


def test_allocator_retries_and_fragmentation(write_gpu_run):
    (retries,) = fired(write_gpu_run(step=lambda i: {"mem_alloc_retries": i // 5}), "allocator-fragmentation")
    assert retries.severity == "warning" and retries.evidence["alloc_retries"] == 3
    gap = {"mem_allocated_bytes": 20 * 2**30, "mem_reserved_bytes": 40 * 2**30}
    (fragmented,) = fired(write_gpu_run(step=lambda i: gap), "allocator-fragmentation")
    assert fragmented.severity == "info"
    assert fragmented.evidence["reserved_unallocated_max_pct"] == pytest.approx(50)


def test_gpu_throttling(write_gpu_run):
    def hot(i):
        return {"throttle_reasons": ["hw_thermal_slowdown"], "sm_clock_mhz": 900.0} if i % 2 else {}

    assert throttling.THROTTLED_SHARE_WARNING_PCT < 50, "half the samples throttled must fire"
    (finding,) = fired(write_gpu_run(sample=hot), "gpu-throttling")
    assert finding.evidence["reasons"] == {"hw_thermal_slowdown": 10}
    assert finding.evidence["sm_clock_throttled_median_mhz"] == 900.0
    idle_only = write_gpu_run(sample=lambda i: {"throttle_reasons": ["gpu_idle"]})
    assert not fired(idle_only, "gpu-throttling")


def test_non_nccl_backend(write_gpu_run):
    gloo = {"world_size": 2, "distributed": {"backend": "gloo", "world_size": 2}}
    (finding,) = fired(write_gpu_run(meta=gloo), "non-nccl-backend")
    assert finding.evidence["backend"] == "gloo"
    nccl = {"world_size": 2, "distributed": {"backend": "nccl", "world_size": 2}}
    assert not fired(write_gpu_run(meta=nccl), "non-nccl-backend")

