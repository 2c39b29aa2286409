"""`gpuprof tune` on unmodified scripts: real child processes, real trials, measured on this (loaded) machine.

The children run with one torch thread: on 2 cores shared with other jobs, more threads only add noise."""

from __future__ import annotations

import ast
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gpuprof
from gpuprof.tune.edits import apply_edits

HERE = Path(__file__).parent
TUNE_TIMEOUT_S = 1200


def gpuprof_tune(*args) -> dict:
    done = subprocess.run([sys.executable, "-m", "gpuprof", "tune", "--json", *map(str, args)], capture_output=True,
                          text=True, timeout=TUNE_TIMEOUT_S, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def trials_of(result: dict) -> dict:
    return {trial["name"]: trial for trial in result["trials"]}


@pytest.mark.slow
@pytest.mark.timeout(TUNE_TIMEOUT_S)
def test_a_loader_in_the_main_process_over_a_slow_dataset_gets_workers_measured_beside_the_estimate(tmp_path):
    script = HERE / "slow_loader.py"
    source = script.read_text()
    result = gpuprof_tune("--steps", 15, "--out", tmp_path / "tune", "--html", tmp_path / "tune.html", script,
                          "--steps", 60)
    assert result["baseline"]["verdict"].startswith("Bound by input")
    loader = trials_of(result)["loader-workers"]
    assert loader["status"] == "measured" and loader["rule"] == "dataloader-bound"
    assert loader["speedup"]["point"] >= 1.5 and loader["speedup"]["low"] > 1, loader["speedup"]
    assert loader["estimate"] > 1 and loader["effect"] == "faster"
    assert loader["parity"]["status"] == "identical"  # the same batches in the same order, from the workers
    assert result["winner"] == "loader-workers" and result["conclusion"].startswith("loader-workers: ")
    assert script.read_text() == source  # nothing written into the script
    changed = apply_edits(source, loader["edits"])[0]
    assert result["diff"].startswith("--- a/") and "+" in result["diff"]
    call = next(node for node in ast.walk(ast.parse(changed)) if isinstance(node, ast.Call)
                and getattr(node.func, "attr", None) == "DataLoader")
    keywords = {keyword.arg: ast.literal_eval(keyword.value) for keyword in call.keywords if keyword.arg != "generator"}
    assert keywords["num_workers"] >= 1 and keywords["persistent_workers"] is True
    assert (tmp_path / "tune" / "baseline" / "meta.json").is_file()  # every trial's run is kept
    page = (tmp_path / "tune.html").read_text()
    assert "<td>loader-workers</td>" in page and "num_workers=" in page


@pytest.mark.slow
@pytest.mark.timeout(TUNE_TIMEOUT_S)
def test_a_script_with_nothing_to_fix_reports_no_gain_outside_the_noise(tmp_path):
    script = HERE / "clean_loop.py"
    # no --steps: a pilot of 20 says how many steps a ±5 % interval on the mean step time takes
    result = gpuprof_tune("--out", tmp_path / "plain", script, "--steps", 1000)
    interval = result["baseline_step_time_s"]
    assert interval["low"] <= interval["point"] <= interval["high"]
    assert (tmp_path / "plain" / "pilot" / "meta.json").is_file()
    if result["steps"] > 20:  # the pilot fell short: the baseline was run again for that many steps
        assert result["baseline"]["run_dir"] == str(tmp_path / "plain" / "baseline")
        assert result["baseline"]["measured_steps"] >= 0.75 * result["steps"]  # warm-up left out
    assert result["winner"] is None and result["diff"] == ""
    assert all(trial["effect"] != "faster" for trial in result["trials"])
    # a knob that changes nothing on a CPU, measured anyway: its trial is within the noise
    # windows of ~4 s: bursts of other load on the machine average out within each run
    forced = gpuprof_tune("--steps", 100, "--only", "tf32", "--out", tmp_path / "tf32", script, "--steps", 200)
    tf32 = trials_of(forced)["tf32"]
    assert tf32["status"] == "measured" and tf32["speedup"] is not None
    assert tf32["effect"] == "within noise" and forced["winner"] is None
    assert forced["conclusion"] == "No knob gained outside the noise (1 measured)"


@pytest.mark.slow
@pytest.mark.timeout(TUNE_TIMEOUT_S)
# not on purpose: gpuprof's gradient-norm collector cannot read sparse gradients and switches itself off
@pytest.mark.capture_may_switch_off
def test_a_trial_that_fails_is_reported_and_the_next_one_runs(tmp_path):
    result = gpuprof_tune("--steps", 5, "--only", "fused-optimizer,gc-freeze", "--out", tmp_path / "tune",
                          HERE / "sparse_sgd.py", "--steps", 40)
    fused, frozen = trials_of(result)["fused-optimizer"], trials_of(result)["gc-freeze"]
    assert fused["status"] == "failed" and "sparse" in fused["error"]
    assert fused["speedup"] is None
    assert frozen["status"] == "measured" and frozen["parity"]["status"] == "identical"


@pytest.mark.slow
@pytest.mark.timeout(TUNE_TIMEOUT_S)
def test_under_torchrun_every_rank_runs_the_same_trials_as_one_world(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                "--master_port", str(port), "-m"]
    done = subprocess.run(
        [*torchrun, "gpuprof", "tune", "--json", "--steps", "4", "--only", "gc-freeze", "--out", str(tmp_path / "tune"),
         str(HERE / "ddp_mlp.py"), "--steps", "100"],
        capture_output=True, text=True, timeout=TUNE_TIMEOUT_S, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)  # rank 0 alone prints
    trial = trials_of(result)["gc-freeze"]
    assert trial["status"] == "measured" and trial["speedup"] is not None
    assert (tmp_path / "tune" / "baseline.log").is_file() and (tmp_path / "tune" / "baseline.rank1.log").is_file()
    for name in ("baseline", "gc-freeze", "baseline-after-gc-freeze"):
        run = gpuprof.load_run(tmp_path / "tune" / name)
        assert run.meta["model"]["wrapper"] == "DistributedDataParallel"
        assert sorted(run.steps["rank"].unique()) == [0, 1]


@pytest.mark.slow
@pytest.mark.timeout(TUNE_TIMEOUT_S)
def test_the_model_knobs_change_the_model_gpuprof_run_finds_and_record_their_edits(tmp_path):
    script = HERE / "slow_loader.py"
    done = subprocess.run(
        [sys.executable, "-m", "gpuprof", "run", "--run-dir", str(tmp_path / "run"), "--max-steps", "3",
         "--knob", "sdpa-attention", "--knob", "compile", "--knob", "expandable-segments", "--knob", "bf16-autocast",
         str(script), "--item-delay-ms", "0", "--attention", "eager", "--steps", "50"],
        capture_output=True, text=True, timeout=TUNE_TIMEOUT_S, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "done: loss" not in done.stdout  # stopped after 3 recorded steps, as finished
    run = gpuprof.load_run(tmp_path / "run")
    assert run.meta["status"] == "finished" and len(run.steps) == 3
    model = run.meta["loop"]["model"]
    assert model["attn_implementation"] == "sdpa" and model["compiled"]  # read after the knobs changed it
    knobs = run.meta["config"]["knobs"]
    assert [edit["code"][0] for edit in knobs["sdpa-attention"]][0].startswith('model.set_attn_implementation("sdpa")')
    assert knobs["compile"] == [{"kind": "before", "file": str(script), "line": knobs["compile"][0]["line"],
                                 "code": ["model.compile()"]}]
    assert "optimizer = torch.optim.AdamW(" in script.read_text().splitlines()[knobs["compile"][0]["line"] - 1]
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():  # a CPU with bf16 instructions
        assert knobs["bf16-autocast"][0]["code"] == [
            "model.forward = torch.autocast('cpu', dtype=torch.bfloat16)(model.forward)"]
    else:  # emulated bf16 is slower than fp32: the knob leaves the model as it is
        assert knobs["bf16-autocast"] == []
    [env] = knobs["expandable-segments"]
    assert env["kind"] == "top" and 'os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"' in env["code"][1]
