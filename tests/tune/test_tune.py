"""`gpuprof tune` on unmodified scripts: real child processes, real trials, measured on this (loaded) machine:
a knob that helps, and the knobs' edits.

The children run with one torch thread: on 2 cores shared with other jobs, more threads only add noise."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest
import torch
from tune_cli import HERE, TUNE_TIMEOUT_S, gpuprof_tune, trials_of

import gpuprof
from gpuprof.tune.edits import apply_edits
from gpuprof.run.tune_result import RESULT_FILE, read_result


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
    envelope = ("schema", "schema_version")
    assert read_result(tmp_path / "tune" / RESULT_FILE) == {k: v for k, v in result.items() if k not in envelope}
    page = (tmp_path / "tune.html").read_text()
    assert "<td>loader-workers</td>" in page and "num_workers=" in page


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
