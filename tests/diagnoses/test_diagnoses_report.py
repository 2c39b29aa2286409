"""The report layer: one report per run, cached by its files' signature, and its verdict, on real
tiny runs and on written step streams and synthetic traces for each bound (thresholds on written
figures, never on live timing)."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
from analysis_trace.conftest import TraceBuilder
from diagnoses_helpers import CPU_DEVICE

from gpuprof.analysis.trace.tables import TABLE_NAMES
from gpuprof.diagnoses.finding import Finding
from gpuprof.report import build_report, compare, verdict
from gpuprof.report.verdict import BOUND_MIN_SHARE_PCT, HOW_TO_RECORD

STEP_US = 1000


def verdict_of(run):
    return build_report(run.path).verdict


def device_trace(tmp_path, kernel_us: int, communication_us: int = 0):
    """A one-rank GPU trace of 4 profiler steps of STEP_US each (the last is left out): a compute
    kernel of `kernel_us`, then a collective of `communication_us` that no compute overlaps; the
    rest of each step the device waits."""
    builder = TraceBuilder()
    for step in range(4):
        start = step * STEP_US
        builder.step(step, start, STEP_US)
        builder.launch("ampere_sgemm_128x64_nn", start + 10, kernel_us)
        if communication_us:
            builder.launch("ncclKernel_AllReduce_RING", start + 10 + kernel_us, communication_us, stream=20)
    return builder.write(tmp_path / f"trace-{kernel_us}-{communication_us}.json", rank=0, world_size=1)


# ------------------------------------------------------------------ one bound each, on written streams
def test_input_bound_from_the_data_phase(write_cpu_run):
    verdict = verdict_of(write_cpu_run(step=lambda i: {"data_time_s": 0.08, "forward_time_s": 0.04}))
    assert verdict.bound == "input" and verdict.share_pct == pytest.approx(100 * 0.08 / 0.2)
    assert "DataLoader" in verdict.next_step  # the dataloader-bound finding's fix


def test_compute_bound_on_a_cpu_from_the_phases(write_cpu_run):
    verdict = verdict_of(write_cpu_run())
    assert verdict.bound == "compute" and verdict.share_pct > 100 - BOUND_MIN_SHARE_PCT
    assert "phase timings" in verdict.why


def test_host_bound_on_a_cpu_from_the_other_phase(write_cpu_run):
    """On a CPU nothing waits for launches: the why says host work outside the model; the loop's line holding
    it is named from enough stack samples, and only said to have too few from one or two."""
    def run(samples_every: int):
        return write_cpu_run(step=lambda i: {"forward_time_s": 0.03, "backward_time_s": 0.06, "other_time_s": 0.1},
                             stacks=lambda i: [{"time_unix_s": 1000.0 + i, "rank": 0, "step": i, "phase": "other",
                                                "function": "<module>", "file": "train.py", "line": 327}]
                             if i % samples_every == 0 else [])
    verdict = verdict_of(run(samples_every=1))
    assert verdict.bound == "host" and verdict.share_pct == pytest.approx(50)
    assert verdict.why.startswith("Host work outside the model's forward, backward and optimizer step: 50 %")
    assert "50 % in <module> (train.py:327) of the step" in verdict.why
    few = verdict_of(run(samples_every=9)).why  # steps 0, 9 and 18; the first is warm-up
    assert "2 stack sample(s) of it, too few to name the functions" in few and "train.py:327" not in few


def test_compute_and_host_bound_on_one_gpu_from_nvml(write_gpu_run):
    assert verdict_of(write_gpu_run()).bound == "compute"  # 97 % busy
    idle = verdict_of(write_gpu_run(sample=lambda i: {"gpu_util_pct": 30.0}))
    assert idle.bound == "host" and idle.share_pct == pytest.approx(70)


def test_communication_bound_from_a_device_trace(write_gpu_run, tmp_path):
    run = write_gpu_run(meta={"world_size": 2}, traces=[device_trace(tmp_path, kernel_us=300, communication_us=600)])
    verdict = verdict_of(run)
    assert verdict.bound == "communication" and verdict.share_pct == pytest.approx(60, abs=1)
    assert "trace" in verdict.why


def test_compute_and_host_bound_from_a_device_trace(write_gpu_run, tmp_path):
    busy = verdict_of(write_gpu_run(samples=False, traces=[device_trace(tmp_path, kernel_us=950)]))
    assert busy.bound == "compute" and busy.share_pct == pytest.approx(95, abs=1)
    waiting = verdict_of(write_gpu_run(samples=False, traces=[device_trace(tmp_path, kernel_us=200)]))
    assert waiting.bound == "host" and waiting.share_pct == pytest.approx(80, abs=1)


def test_memory_bound_on_an_oom(write_gpu_run):
    verdict = verdict_of(write_gpu_run(step=lambda i: {"mem_ooms": int(i >= 15)}))
    assert verdict.bound == "memory" and "memory-near-limit" in verdict.next_step


def test_numerics_bound_whatever_the_timings(write_cpu_run):
    run = write_cpu_run(step=lambda i: {"data_time_s": 0.1, "loss_finite": i < 15, "loss": 4.0 if i < 15 else None})
    verdict = verdict_of(run)
    assert verdict.bound == "numerics" and verdict.share_pct == pytest.approx(100 * 5 / 20)


# ------------------------------------------------------------------ a missing signal is named, not guessed
@pytest.mark.parametrize(("device", "meta", "step", "signal"), [
    ("cpu", {}, {"data_time_s": None, "forward_time_s": None, "backward_time_s": None}, "phases"),
    ("cpu", {"world_size": 2}, {}, "trace window"),  # collectives hide inside backward
    ("gpu", {}, {}, "trace window"),  # no trace, no NVML samples
])
def test_a_missing_signal_is_named_with_how_to_record_it(write_cpu_run, write_gpu_run, device, meta, step, signal):
    if device == "cpu":
        run = write_cpu_run(meta=meta, step=lambda i: step)
    else:
        run = write_gpu_run(meta=meta, step=lambda i: step, samples=False)
    verdict = verdict_of(run)
    assert verdict.bound is None and verdict.missing == signal
    assert HOW_TO_RECORD[signal] in verdict.next_step and signal in verdict.headline
    if device == "gpu":
        assert "sample_interval_s" in verdict.next_step  # NVML would do on one GPU


def test_a_measured_bound_needs_no_other_signal(write_cpu_run):
    verdict = verdict_of(write_cpu_run(meta={"world_size": 2}, step=lambda i: {"data_time_s": 0.1}))
    assert verdict.bound == "input"


# ------------------------------------------------------------------ real tiny runs
def test_verdicts_of_real_runs(recorded_runs, loop_runs):
    # the loader sleeps 500 ms a step against a few ms of work: far past any noise
    assert build_report(recorded_runs.path("data_delay")).verdict.bound == "input"
    assert build_report(loop_runs["nan_input"].path).verdict.bound == "numerics"


def test_a_loop_without_phases_says_how_to_time_them(tmp_path):
    import torch

    import gpuprof

    with gpuprof.profile(tmp_path / "bare", sample_interval_s=None) as prof:
        for _ in range(5):
            prof.step(loss=(torch.randn(32, 32) @ torch.randn(32, 32)).sum(), tokens=32)
    verdict = build_report(tmp_path / "bare").verdict
    assert verdict.missing == "phases" and "model=" in verdict.next_step


def test_the_report_holds_the_trace_tables_and_the_blames(recorded_runs, loop_runs):
    traced = build_report(recorded_runs.path("host_sync"))
    [window] = traced.trace_windows
    assert window.error is None and set(window.tables) == set(TABLE_NAMES)
    assert window.files == traced.run.trace_windows[window.name]
    nan = build_report(loop_runs["nan_input"].path)
    assert len(nan.blames) >= 1 and set(nan.blames["kind"]) == {"nonfinite"}
    first_step = int(nan.blames["step"].min())
    assert first_step in set(nan.blame_chain["step"]) and not nan.trace_windows


def test_reports_are_built_once_per_state_of_the_files(write_cpu_run):
    run = write_cpu_run()
    report = build_report(run.path)
    assert build_report(run.path) is report and build_report(str(run.path) + "/") is report
    meta = run.path / "meta.json"
    stat = meta.stat()
    os.utime(meta, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert build_report(run.path) is not report


def test_compare_takes_two_reports(write_cpu_run):
    slow_loader = build_report(write_cpu_run(step=lambda i: {"data_time_s": 0.1}).path)
    healthy = build_report(write_cpu_run().path)
    comparison = compare(healthy, slow_loader)
    assert comparison.a is healthy and comparison.b is slow_loader
    assert [finding.rule for finding in comparison.appeared] == ["dataloader-bound"]
    assert comparison.to_dict()["b"]["verdict"]["bound"] == "input"


def test_an_unreadable_trace_window_is_named_and_the_rest_reported(write_gpu_run, tmp_path):
    broken = tmp_path / "rank-0.pt.trace.json.gz"
    broken.write_bytes(b"\x1f\x8b not gzip")
    report = build_report(write_gpu_run(samples=False, traces=[broken]).path)
    [window] = report.trace_windows
    assert "corrupt gzip" in window.error and not window.tables
    assert report.verdict.missing == "trace window" and report.summary.n_steps == 20


SDPA_FUSED_LOOP = {"model": {"class": "GPT2LMHeadModel", "attn_implementation": "sdpa", "compiled": False},
                   "optimizer": {"class": "AdamW", "fused": True, "fused_supported": True}, "autocast_dtype": None}


def test_the_next_step_leaves_out_what_the_loop_already_does(write_cpu_run):
    """A compute-bound CPU loop with sdpa and a fused AdamW is told to compile, not to take what it has;
    compiled as well, it is told its usual levers are in place; without loop facts, the usual moves."""
    next_step = verdict_of(write_cpu_run(meta={"loop": SDPA_FUSED_LOOP})).next_step
    assert next_step.startswith("Make the compute cheaper: torch.compile(model);")
    assert not any(taken in next_step for taken in ("sdpa", "fused optimizer", "bf16"))
    compiled = {**SDPA_FUSED_LOOP, "model": {**SDPA_FUSED_LOOP["model"], "compiled": True}}
    assert verdict_of(write_cpu_run(meta={"loop": compiled})).next_step.startswith("The usual levers are in place")
    assert verdict_of(write_cpu_run(meta={"loop": {}})).next_step == verdict.NEXT_STEPS_WITHOUT_GPU["compute"]


def test_host_levers_and_measuring_findings(gpu_device):
    fp32_gpu = {"devices": [gpu_device], "compute_dtype": "fp32", "loop": SDPA_FUSED_LOOP}
    assert verdict.loop_levers("compute", fp32_gpu) == ["bf16 autocast (torch.autocast('cuda', dtype=torch.bfloat16))",
                                                         "torch.compile(model)"]
    compiled = {**fp32_gpu, "loop": {**SDPA_FUSED_LOOP, "model": {"compiled": True}}}
    host = verdict.loop_levers("host", compiled)
    assert any("reduce-overhead" in lever for lever in host) and not any("torch.compile(model) or" in lever for lever in host)
    warmup = Finding(rule="warmup-pollution", severity="info", title="", fix="Leave the first step out",
                     category="host")
    assert verdict.next_step("host", [warmup], compiled).startswith("Cut host work per step: CUDA graphs")
    on_cpu = {**compiled, "devices": [CPU_DEVICE]}  # nanoGPT compiled on a CPU: no CUDA graphs to capture
    assert verdict.next_step("host", [warmup], on_cpu) == \
        "Cut host work per step: no .item()/print of device values inside the step."
    eager_cpu = {"devices": [CPU_DEVICE], "loop": SDPA_FUSED_LOOP}
    assert verdict.loop_levers("host", eager_cpu)[0] == "torch.compile(model) to fuse many small operations"


def test_an_information_only_finding_is_the_next_step_only_once_the_usual_levers_are_taken():
    """A for-loop SGD at 1 % of the step (below unfused-optimizer's threshold: info) is not what to do first
    while the loop has not compiled; once it has, it is."""
    small = Finding(rule="unfused-optimizer", severity="info", title="", fix="torch.optim.SGD(..., fused=True)",
                    category="compute")
    loop = {**SDPA_FUSED_LOOP, "optimizer": {"class": "SGD", "fused": False, "fused_supported": True}}
    first = verdict.next_step("compute", [small], {"loop": loop})
    assert first.startswith("Make the compute cheaper: torch.compile(model);") and "fused" not in first, first
    compiled = {**loop, "model": {**loop["model"], "compiled": True}, "optimizer": SDPA_FUSED_LOOP["optimizer"]}
    assert verdict.next_step("compute", [small], {"loop": compiled}) == "torch.optim.SGD(..., fused=True) (finding unfused-optimizer)"
    assert verdict.next_step("compute", [replace(small, severity="warning")], {"loop": loop}).startswith("torch.optim.SGD")
