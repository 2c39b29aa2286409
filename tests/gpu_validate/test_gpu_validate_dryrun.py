"""benchmarks/gpu_validate.py as a CPU dry run (tiny GPT-2, few steps): every section runs, and
what results.json says agrees with the runs it recorded."""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

import gpuprof
from gpuprof.analysis.run import summarize

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_validate.py"
STEPS = 5  # the fewest with which the run summary leaves out a warm-up step

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-validate")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), "--device", "cpu", "--model", "tiny", "--steps", str(STEPS),
         "--skip-compile"],
        capture_output=True, text=True, timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out, json.loads((out / "results.json").read_text()), done.stdout


def test_every_section_ran_or_says_why_not(dry_run):
    _, results, stdout = dry_run
    statuses = {name: record["status"] for name, record in results["sections"].items()}
    assert statuses == {"environment": "ok", "overhead": "ok", "overhead_small_step": "ok", "sync_debug": "skipped",
                        "forensics": "ok", "forensics_any_loop": "ok", "trace": "ok", "memory": "skipped",
                        "reference": "ok", "analyze": "ok", "reference_compiled": "skipped"}
    assert "CUDA only" in results["sections"]["sync_debug"]["note"]
    assert "CUDA only" in results["sections"]["memory"]["note"]
    assert results["runtime_s"] >= sum(record["duration_s"] for record in results["sections"].values())
    printed = stdout.rstrip().splitlines()
    assert printed[-1].startswith("| optimized_compiled | skipped")  # the table comes last
    assert any(line.startswith("| forensics_any_loop | ok |") for line in printed)


def test_environment_measures_the_cpu(dry_run):
    environment = dry_run[1]["sections"]["environment"]
    assert environment["torch"] == torch.__version__
    for key in ("fp32_matmul_gflop_per_s", "bf16_matmul_gflop_per_s", "memcpy_gb_per_s"):
        assert environment[key] > 0


def test_reference_figures_are_the_recorded_runs_summaries(dry_run):
    reference = dry_run[1]["sections"]["reference"]
    variants = reference["variants"]
    assert set(variants) == {"baseline", "optimized"}
    summaries = {}
    for name in ("baseline", "optimized"):
        recorded = variants[name]
        assert recorded["status"] == "ok", recorded.get("error")
        summary = summarize(gpuprof.load_run(recorded["run_dir"])).to_dict()
        summaries[name] = summary
        assert summary["n_steps"] == STEPS and recorded["measured_steps"] == STEPS - recorded["warmup"]["n_steps"] > 0
        for key in ("step_time_p50_s", "tokens_per_s", "mfu", "peak_mem_allocated_bytes"):
            assert recorded[key] == summary[key], key
        assert recorded["step_time_p50_s"] > 0 and recorded["tokens_per_s"] > 0
        assert recorded["system_samples"] > 0 and "proc_rss_bytes" in recorded["sampled_columns"]
    assert (variants["baseline"]["attention"], variants["baseline"]["fused_adamw"]) == ("eager", False)
    assert (variants["optimized"]["attention"], variants["optimized"]["fused_adamw"]) == ("sdpa", True)
    ratio = reference["ratios_vs_baseline"]["optimized"]
    expected = summaries["optimized"]["step_time_p50_s"] / summaries["baseline"]["step_time_p50_s"]
    assert ratio["step_time_p50_s"] == pytest.approx(expected, rel=1e-3)


def test_overhead_is_the_median_of_interleaved_pairs(dry_run):
    out, results, _ = dry_run
    overhead = results["sections"]["overhead"]
    loops = overhead["loops"]
    assert list(loops)[:3] == ["loss outside, no clipping", "loss outside, clip_grad_norm_", "labels=, phases marked"]
    for loop in loops.values():
        # from the recorded ratios: recomputing them from step times rounded to 1e-6 s adds an error
        # that grows with the ratio, which a loaded machine pushes past the tolerance
        assert loop["ratio_median"] == pytest.approx(statistics.median(loop["ratios"]), abs=1e-5)
        assert loop["overhead_pct"] == pytest.approx(100 * (loop["ratio_median"] - 1), abs=1e-3)
        assert loop["ratio_p10"] <= loop["ratio_median"] <= loop["ratio_p90"]
    assert loops["loss outside, no clipping, keep_state off"]["options"] == {"numerics": {"keep_state": False}}
    assert loops["loss outside, no clipping, keep_state every_step"]["options"] == {
        "numerics": {"keep_state": "every_step"}}
    # the headline is the least flattering loop with every default on
    defaults = {name: loops[name]["overhead_pct"] for name in list(loops)[:3]}
    assert overhead["headline_loop"] == max(defaults, key=defaults.get)
    assert overhead["overhead_pct"] == defaults[overhead["headline_loop"]]
    assert overhead["within_target"] == (overhead["overhead_pct"] <= overhead["target_pct"])
    captured = sorted((out / "runs" / "overhead").iterdir())
    assert len(captured) == sum(loop["pairs"] for loop in loops.values())
    for run_dir in captured:  # each captured block: one warm-up step plus the timed ones
        assert len(gpuprof.load_run(run_dir).steps) == 1 + overhead["steps_per_block"]
    small = results["sections"]["overhead_small_step"]
    assert small["ratio_median"] == pytest.approx(statistics.median(small["ratios"]), abs=1e-5)
    assert "loss outside the model, no clipping" in small["loop"]


def test_overhead_reports_the_pairs_and_the_memory_capture_adds(dry_run):
    results = dry_run[1]
    host_bytes = psutil.virtual_memory().total
    for name, loop in results["overhead"].items():  # the headline view: every loop, "small step" too
        assert loop["pairs"] == len(loop["ratios"]) >= 2, name
        assert loop["memory_measured"] == "process rss" and loop["memory_total_bytes"] == host_bytes
        added_pct = 100 * loop["peak_memory_added_bytes"] / host_bytes
        assert loop["peak_memory_added_pct"] == pytest.approx(added_pct, abs=1e-6)  # written to 6 decimals
        assert abs(loop["peak_memory_added_bytes"]) < 2**30  # a tiny model's capture: MiBs, not GiBs
    assert results["overhead"]["small step"]["ratio_median"] > 0
    assert "| memory added |" in (dry_run[0] / "results.md").read_text()


def test_a_gpu_run_measures_30_pairs_and_arms_sync_debug_after_warm_up(monkeypatch):
    """What the CUDA plan asks for (the dry run's tiny plan keeps the pairs few to stay short)."""
    spec = importlib.util.spec_from_file_location("gpu_validate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    plan = module.PLANS["gpt2"]
    assert plan.overhead_reps >= 30 and plan.small_step_pairs >= 30
    assert module.SYNC_WARMUP_STEPS >= 1


def test_forensics_blames_the_injected_faults(dry_run):
    faults = dry_run[1]["sections"]["forensics"]["faults"]
    assert set(faults) == {"attn-overflow", "embedding-nan"}
    for fault in faults.values():
        assert fault["matches_expected"] and fault["replay_same_blame"], fault["blame_text"]
        events = gpuprof.load_run(fault["run_dir"]).events
        recorded = events[events["kind"] == "nonfinite"].iloc[0]
        assert (int(recorded["step"]), recorded["details"]["phase"]) == (fault["blame"]["step"], fault["blame"]["phase"])
    assert faults["attn-overflow"]["blame"]["op"] == "aten::bmm"
    assert faults["embedding-nan"]["blame"]["tensor"] == "transformer.wte.weight"


def test_forensics_blames_the_faults_in_a_user_loop(dry_run):
    faults = dry_run[1]["sections"]["forensics_any_loop"]["faults"]
    assert set(faults) == {"attn-overflow", "ignored-labels", "sqrt-zero", "lr-spike"}
    for fault in faults.values():
        assert fault["status"] == "ok" and fault["matches_expected"], fault.get("blame_text")
        assert fault["keep_state"] == "when_bad, decided on the host"  # on a GPU: "on the device"
        placement = fault["state_placement"]
        assert (placement["what"], placement["measured"]) == ("state", True)
        assert fault["blame"]["kept_state"] == "the whole state in host memory"  # on a GPU: "in device memory"
        assert fault.get("replay_same_blame") is not False, fault.get("replay_output")
    assert faults["ignored-labels"]["blame"]["op"] == "aten::nll_loss_forward"
    assert faults["sqrt-zero"]["blame"]["module"] == "transformer.h.1.mlp"
    assert "replay_same_blame" not in faults["sqrt-zero"]  # its gate module is the loop's own: not rebuilt


def test_trace_and_analyze_cover_the_recorded_runs(dry_run):
    out, results, _ = dry_run
    sections = results["sections"]
    trace = sections["trace"]
    assert Path(trace["window"]).is_dir() and trace["profiler_steps"] >= 1 and trace["top"]
    assert json.loads((out / "trace.json").read_text())["schema"] == "gpuprof.trace"
    analyzed = sections["analyze"]["runs"]
    assert set(analyzed) == {path.parent.name for path in (out / "runs").glob("*/meta.json")}
    for name in ("baseline", "optimized"):
        assert analyzed[name]["tokens_per_s"] == sections["reference"]["variants"][name]["tokens_per_s"]
        assert (out / "analyze" / f"{name}.txt").read_text().startswith("Verdict: ")


def test_headline_views_are_read_from_the_sections(dry_run):
    results = dry_run[1]
    sections = results["sections"]
    assert results["device"] == sections["environment"]["device_name"] == "cpu"
    assert {name: view["run"] for name, view in results["variants"].items()} == sections["reference"]["variants"]
    assert results["overhead"]["small step"] == sections["overhead_small_step"]
    assert set(results["overhead"]) - {"small step"} == set(sections["overhead"]["loops"])
    assert set(results["nan"]) == {f"{name}: {fault}" for name in ("forensics", "forensics_any_loop")
                                   for fault in sections[name]["faults"]}
    assert all(view["matches_expected"] for view in results["nan"].values())
