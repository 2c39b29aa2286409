"""`gpuprof compare --gate` on real runs of the reference workload, on this loaded machine.

Every step sleeps 100 ms in the data loader around a one-block tiny GPT-2 with fused AdamW and
SDPA (the fewest ops per step): ~100 ms steps on an idle machine, ~300 ms at load 30 on 2 cores,
where the compute's share of the CPUs swings from step to step. The two runs of the same loop and the one with 40 ms of host work per step are
recorded side by side, so they see the same load from other jobs. The tiny GPT-2's own two
blocks are another model size."""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from html import unescape as html_unescape
from pathlib import Path

import numpy as np
import pytest
from processes import gpuprof_cli

from gpuprof.cli import main

# recording four runs on a loaded 2-core machine takes minutes, and the first test waits for it
pytestmark = [pytest.mark.timeout(1500), pytest.mark.slow]
SAMPLE_RUNS = Path(__file__).resolve().parents[2] / "sample_runs"
TRAIN_TIMEOUT_S = 900  # four runs recorded at once on a loaded machine
STEPS = 300  # at load 30 the steps drift together in blocks of ~13: fewer tell 40 ms from the noise too seldom
VOCAB_SIZE = 256
TRAIN = ("--steps", str(STEPS), "--model", "tiny", "--fused-adamw", "--attention", "sdpa", "--batch-size", "1",
         "--seq-len", "8", "--device", "cpu", "--vocab-size", str(VOCAB_SIZE), "--grad-accum", "1",
         "--num-workers", "0", "--data-delay-ms", "100")
RUNS = {
    "same": ("--n-layer", "1"),
    "again": ("--n-layer", "1"),
    "host_work": ("--n-layer", "1", "--host-work-ms", "40"),
}
OTHER_SIZE = ("--n-layer", "2", "--steps", "6", *TRAIN[2:])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare-runs")
    tokens = root / "tokens.bin"
    np.random.default_rng(0).integers(0, VOCAB_SIZE, 50_000, dtype=np.uint16).tofile(tokens)

    def record(name: str, args: tuple) -> None:
        result = gpuprof_cli("train", *args, "--data", tokens, "--run-dir", root / name, timeout=TRAIN_TIMEOUT_S)
        assert result.returncode == 0, f"recording {name} failed:\n{result.stderr[-3000:]}"

    with ThreadPoolExecutor(len(RUNS)) as pool:
        list(pool.map(lambda item: record(*item), ((name, (*args, *TRAIN)) for name, args in RUNS.items())))
    record("other_size", OTHER_SIZE)  # after them: its timing does not matter, its load would
    return root


def compare(capsys, *args) -> tuple[int, str, str]:
    """`gpuprof compare ARGS` through the CLI's entry in this process: exit code, stdout, stderr. (A fresh
    interpreter per comparison would only repeat its start-up; test_another_model_size_is_not_comparable and
    test_a_folder_without_runs_is_bad_input run the command in a real process.)"""
    capsys.readouterr()
    try:
        code = main(["compare", *map(str, args)])
    except SystemExit as exit:  # argparse's errors leave through sys.exit, as in `python -m gpuprof`
        code = exit.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def gate(capsys, a, b, *extra) -> tuple[int, dict]:
    code, stdout, stderr = compare(capsys, a, b, "--gate", "--json", *extra)
    assert code in (0, 3, 4, 5), stderr
    document = json.loads(stdout)
    assert document["gate"]["exit_code"] == code
    return code, document


def test_the_same_loop_run_twice_is_not_a_regression(runs, capsys):
    code, document = gate(capsys, runs / "same", runs / "again")
    assert code != 3, document["conclusion"]
    assert code == 0 or document["gate"]["steps_needed"] > document["a"]["measured_steps"], document["gate"]
    assert "host load" not in [difference["term"] for difference in document["contract"]["differences"]]  # side by side
    assert document["contract"]["comparable"] and document["numerics"]["text"] == "numerics unchanged"
    step_time = document["figures"][0]
    assert step_time["name"] == "Step time, mean" and step_time["change"]["low"] <= 1.05


def test_40_ms_of_host_work_per_step_is_slower_beyond_the_noise(runs, capsys):
    """At load 30 the steps are ~300 ms, not 100: 40 ms is a 13 % slowdown whose interval lies above
    1 but not always past 1.05 (measured: 1.13× (1.03–1.22×) at 400 steps, docs/compare.md). The gate
    then says regression (3), or too noisy (5) with the steps that would tell, never a pass."""
    code, document = gate(capsys, runs / "same", runs / "host_work")
    step_time = document["figures"][0]
    assert step_time["change"]["low"] > 1 and step_time["call"] == "A better", document["conclusion"]
    assert document["conclusion"].startswith("B is ") and " slower (95 % CI " in document["conclusion"]
    assert step_time["b"]["point"] - step_time["a"]["point"] > 0.02  # the 40 ms, give or take the load
    assert code == 3 or (code == 5 and document["gate"]["steps_needed"] > document["a"]["measured_steps"]), \
        document["gate"]


def test_a_slowdown_past_the_threshold_is_a_regression(runs, tmp_path, capsys):
    markdown = tmp_path / "comment.md"
    code, document = gate(capsys, runs / "same", runs / "host_work", "--max-regression-pct", "0", "--markdown", markdown)
    assert code == 3, document["gate"]
    assert "past the 0 % threshold" in document["gate"]["reason"]
    text = markdown.read_text()
    assert text.startswith(f"### {document['conclusion']}") and "**Gate: regression** (exit 3)" in text
    assert "| Step time, mean |" in text


def test_a_baseline_folder_pools_its_runs(runs, tmp_path, capsys):
    baseline = tmp_path / "baseline"
    baseline.mkdir()
    for name in ("same", "again"):
        (baseline / name).symlink_to(runs / name)
    code, document = gate(capsys, baseline, runs / "host_work", "--max-regression-pct", "0")
    assert code == 3 and len(document["a"]["runs"]) == 2 and document["a"]["pooling"] == "pooled"
    assert document["a"]["measured_steps"] > STEPS  # both runs' steps
    code, document = gate(capsys, baseline, runs / "host_work", "--baseline", "median", "--max-regression-pct", "0")
    assert code == 3 and document["a"]["pooling"] == "median" and document["a"]["measured_steps"] < STEPS


def test_a_faster_b_passes(capsys):
    """The recorded sample runs: optimized is faster than baseline, far beyond its noise."""
    code, document = gate(capsys, SAMPLE_RUNS / "baseline", SAMPLE_RUNS / "optimized")
    assert code == 0 and document["conclusion"].startswith("B is ") and " faster (95 % CI " in document["conclusion"]
    precision = [d for d in document["contract"]["differences"] if d["term"] == "precision"]
    assert precision == [{"term": "precision", "group": "workload", "a": "fp32", "b": "bf16", "blocks": False}]


def test_another_model_size_is_not_comparable(runs, capsys):
    code, document = gate(capsys, runs / "same", runs / "other_size")
    assert code == 4
    blocking = {difference["term"] for difference in document["contract"]["differences"] if difference["blocks"]}
    assert {"parameters", "parameter shapes"} <= blocking
    assert document["conclusion"].startswith("A and B are not comparable: parameters: A ")
    text = gpuprof_cli("compare", runs / "same", runs / "other_size", "--gate")
    assert text.returncode == 4
    assert "parameter shapes: A " in text.stdout and "(blocks the comparison)" in text.stdout


def test_the_text_leads_with_the_conclusion_and_shows_distributions(runs, tmp_path, capsys):
    html = tmp_path / "compare.html"
    code, stdout, stderr = compare(capsys, runs / "same", runs / "host_work", "--html", html)
    assert code == 0, stderr  # without --gate, compare only reports
    lines = stdout.splitlines()
    assert lines[0].startswith("B is ") and "numerics unchanged" in lines[0]
    assert "Measured step times:" in stdout and any(line.startswith("  B |") for line in lines)
    assert "None" not in stdout and "ratio_b_over_a" not in stdout
    page = html.read_text()
    assert lines[0] in html_unescape(page) and "Comparability contract" in page and "plotly" in page


@pytest.mark.parametrize("args", [("--max-regression-pct", "-1"), ("--baseline", "mean")])
def test_bad_gate_input_is_one_line_and_exit_2(runs, args, capsys):
    code, stdout, stderr = compare(capsys, runs / "same", runs / "again", "--gate", *args)
    assert code == 2 and stdout == ""
    assert len(stderr.strip().splitlines()) == 1 or "usage" in stderr


def test_a_folder_without_runs_is_bad_input(tmp_path, runs):
    result = gpuprof_cli("compare", tmp_path, runs / "same", "--gate")
    assert result.returncode == 2 and "neither a run nor a folder of runs" in result.stderr
