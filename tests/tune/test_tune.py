"""`gpuprof tune` on unmodified scripts: real child processes, real trials, measured on this (loaded) machine.

The children run with one torch thread: on 2 cores shared with other jobs, more threads only add noise."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
    result = gpuprof_tune("--steps", 15, "--out", tmp_path / "tune", script, "--steps", 60)
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


@pytest.mark.slow
@pytest.mark.timeout(TUNE_TIMEOUT_S)
def test_a_script_with_nothing_to_fix_reports_no_gain_outside_the_noise(tmp_path):
    script = HERE / "clean_loop.py"
    result = gpuprof_tune("--steps", 12, "--out", tmp_path / "plain", script, "--steps", 40)
    assert result["winner"] is None and result["diff"] == ""
    assert all(trial["effect"] != "faster" for trial in result["trials"])
    # a knob that changes nothing on a CPU, measured anyway: its trial is within the noise
    forced = gpuprof_tune("--steps", 12, "--only", "tf32", "--out", tmp_path / "tf32", script, "--steps", 40)
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
