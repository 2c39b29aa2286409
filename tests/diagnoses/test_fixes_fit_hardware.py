"""Every fix fits the hardware it was recorded on (issue 50, point 5): a CPU-only host is told no pin_memory and no
more loader workers than it has cores, with the estimate assuming the workers the fix names; a V100 (compute
capability 7.0, no bf16 or TF32) is told fp16 autocast with a GradScaler, where an A100 is told bf16.

The CPU runs are real loops recorded here; a GPU's facts come from the run a GPU records (written by the real
RunWriter) and from a real V100 trace of ../shared/traces, as recorded and with its deviceProperties rewritten.
"""

from __future__ import annotations

import gzip
import json

import pytest
from diagnoses_helpers import fired
from loops import nanogpt_loop, one_thread
from processes import gpuprof_cli

from gpuprof.diagnoses.registry import all_rules
from gpuprof.diagnoses.rules import dataloader, memory
from gpuprof.report import build_report

all_rules()

SLOW_SAMPLE_S = 0.0125  # 50 ms a batch: several times a tiny GPT-2 step, even on a loaded machine
V100 = {"name": "Tesla V100-SXM2-32GB", "capability": "7.0"}
A100 = {"name": "NVIDIA A100-SXM4-80GB", "capability": "8.0"}
FP32_LOOP = {"compute_dtype": "fp32", "loop": {"torch": {"float32_matmul_precision": "highest",
                                                         "cuda_matmul_allow_tf32": False}}}
FP16_WITH_SCALER = "fp16 autocast with a GradScaler"
NOT_ON_A_V100 = ("bf16", "bfloat16", "tf32")
NOT_ON_A_CPU = ("pin_memory", "non_blocking", "cuda", "bf16", "tf32")


def words_in(text: str, words) -> list[str]:
    return [word for word in words if word in text.lower()]


@pytest.fixture(scope="module")
def slow_loader_run(tmp_path_factory):
    """A real nanoGPT-style loop on this CPU whose DataLoader, with no workers, takes most of each step."""
    with one_thread():
        run = nanogpt_loop(tmp_path_factory.mktemp("fits") / "slow-loader", loader_delay_s=SLOW_SAMPLE_S)
    return build_report(run.path)


def test_a_cpu_run_is_told_workers_its_host_has_and_no_pinned_memory(slow_loader_run):
    report = slow_loader_run
    cores = report.run.rank_meta[0]["host_cpu_count"]
    [finding] = report.findings_in("input")
    workers = finding.evidence["estimate_workers"]
    assert finding.rule == "dataloader-bound" and 1 <= workers <= cores
    assert f"DataLoader(num_workers={workers}," in finding.fix
    assert finding.est_gain_pct == pytest.approx(dataloader.hidden_by_workers_pct(
        finding.evidence["data_share_pct"], workers)), "the estimate assumes the workers the fix names"
    assert report.verdict.bound == "input" and report.verdict.next_step.startswith(finding.fix)
    assert not words_in(" ".join(f.fix for f in report.findings) + report.verdict.next_step, NOT_ON_A_CPU)


def test_a_gpu_run_is_told_to_pin_its_batches(write_gpu_run):
    """The contrast: the same finding on a GPU names pin_memory."""
    slow_data = write_gpu_run(meta={"loop": {"loader": {"class": "DataLoader", "num_workers": 0, "pin_memory": False}}},
                              step=lambda i: {"data_time_s": 0.1})
    [finding] = fired(slow_data, "dataloader-bound")
    assert f"num_workers={finding.evidence['estimate_workers']}, pin_memory=True" in finding.fix


def test_an_fp16_cpu_loop_that_overflows_is_not_told_to_use_bf16(loop_runs):
    [finding] = fired(loop_runs["fp16_overflow"], "gradscaler-trouble")
    assert finding.fix.startswith("Gradients overflow fp16") and not words_in(finding.fix, NOT_ON_A_V100)


@pytest.mark.parametrize("device, leads, absent", [
    (V100, FP16_WITH_SCALER, NOT_ON_A_V100),
    (A100, "bf16 autocast", ("fp16", "gradscaler")),
])
def test_fp32_matmuls_are_told_the_precision_the_gpu_has(write_gpu_run, gpu_device, device, leads, absent):
    run = write_gpu_run(meta={**FP32_LOOP, "devices": [{**gpu_device, **device}]})
    [finding] = fired(run, "fp32-matmul")
    assert finding.fix.startswith(f"Run forward and loss under {leads}")
    assert not words_in(finding.fix, absent)
    assert build_report(run.path).verdict.next_step.startswith(finding.fix)


def test_memory_near_the_limit_of_a_v100_is_told_fp16_activations(write_gpu_run, gpu_device):
    near_limit = (memory.NEAR_LIMIT_WARNING_FRACTION + 0.02) * gpu_device["total_memory_bytes"]
    run = write_gpu_run(meta={"devices": [{**gpu_device, **V100}]}, step=lambda i: {"mem_reserved_bytes": near_limit})
    [finding] = fired(run, "memory-near-limit")
    assert "fp16 activations (autocast with a GradScaler)" in finding.fix and not words_in(finding.fix, NOT_ON_A_V100)
    assert "--grad-accum" not in finding.fix, "a user's loop has no gpuprof train flags"


def test_the_verdicts_own_compute_levers_fit_a_v100(write_gpu_run, gpu_device):
    """Without the finding (TF32 settings not recorded), the verdict's usual levers for a compute-bound fp32 loop."""
    model = {"class": "GPT2LMHeadModel", "attn_implementation": "sdpa", "compiled": False}
    run = write_gpu_run(meta={"compute_dtype": "fp32", "devices": [{**gpu_device, **V100}], "loop": {"model": model}})
    verdict = build_report(run.path).verdict
    assert verdict.bound == "compute" and verdict.next_step.startswith(f"Make the compute cheaper: {FP16_WITH_SCALER}")
    assert not words_in(verdict.next_step, NOT_ON_A_V100)


def v100_copy(files, folder, **properties):
    """A copy of the V100 trace whose deviceProperties say `properties` (an A100's capability: 8.0)."""
    (source,) = files
    with gzip.open(source, "rt") as handle:
        document = json.load(handle)
    document["deviceProperties"] = [{**device, **properties} for device in document["deviceProperties"]]
    target = folder / source.name
    with gzip.open(target, "wt") as handle:
        json.dump(document, handle)
    return target


def advice_of_gpuprof_trace(path) -> str:
    """The verdict and findings `gpuprof trace` prints (up to its overview of the trace), wrapping undone."""
    result = gpuprof_cli("trace", path)
    assert result.returncode == 0, result.stderr[-3000:]
    text = " ".join(result.stdout.split())
    return text[:text.index(" rank 0: ")]


def test_a_real_v100_trace_is_told_fp16_with_a_gradscaler(shared_trace, tmp_path):
    files = shared_trace("v100_ns_timestamps")
    advice = advice_of_gpuprof_trace(files[0])
    assert f"next Run forward and loss under {FP16_WITH_SCALER}" in advice
    assert not words_in(advice, NOT_ON_A_V100)
    as_ampere = advice_of_gpuprof_trace(v100_copy(files, tmp_path, computeMajor=8, computeMinor=0))
    assert "next Run forward and loss under bf16 autocast" in as_ampere
    assert "allow_tf32" in as_ampere
