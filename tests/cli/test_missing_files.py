"""A run whose files were lost, as a user meets it: `gpuprof analyze` and `gpuprof report` name the missing file
and what the run's meta files say it should hold (one line, exit code 2), never "call prof.step()"; a rank folder
lost from a run of two is said and the other rank analysed; the dashboard's Runs page says the same, and names
the traces under its folder that it does not list, as `gpuprof trace DIR` names those a folder's spans leave out."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from browser import chromium_page, needs_browser, rendered  # tests/dashboard's real browser (conftest.py)
from cli.cli_helpers import refused_line
from dashboard_helpers import unreadable

from gpuprof.cli import main
from gpuprof.report import build_report

REPO = Path(__file__).resolve().parents[2]
TWO_RANKS = REPO / "sample_runs" / "ddp-2rank"  # recorded by scripts/make_sample_runs.py under torchrun (gloo)
LOOP_BLAMED = "prof.step()"


def copy_without(run_dir: Path, into: Path, *lost: str) -> Path:
    """A copy of the run in `into` with the files or folders `lost` (relative to the run) deleted."""
    copy = into / run_dir.name
    shutil.copytree(run_dir, copy)
    for relative in lost:
        path = copy / relative
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return copy


def refused(command: list[str], capsys) -> str:
    """The one line the command printed on refusing, which blames no loop."""
    line = refused_line(command, capsys)
    assert LOOP_BLAMED not in line
    return line


@pytest.mark.parametrize("command", ["analyze", "report"])
def test_a_deleted_steps_file_is_named_with_what_the_rank_meta_says(recorded, tmp_path, capsys, command):
    run_dir = copy_without(recorded, tmp_path, "rank-0/steps.parquet")
    output = ["-o", str(tmp_path / "report.html")] if command == "report" else []
    line = refused([command, str(run_dir), *output], capsys)
    assert line.startswith(f"gpuprof {command}: error: {run_dir}/rank-0/steps.parquet is missing: "
                           "rank-0/meta.json says rank 0 of 1 finished after "), line
    assert "so this file should hold its step records" in line and line.endswith("or record the run again")
    assert not (tmp_path / "report.html").exists()


def test_a_deleted_run_meta_is_named_not_taken_for_a_folder_that_is_no_run(recorded, tmp_path, capsys):
    run_dir = copy_without(recorded, tmp_path, "meta.json")
    line = refused(["analyze", str(run_dir)], capsys)
    assert line.startswith(f"gpuprof analyze: error: {run_dir}/meta.json is missing: rank-0/meta.json says rank 0 "
                           "of 1 finished after "), line
    assert "not a gpuprof run directory" not in line


def test_a_lost_rank_folder_of_two_is_said_and_the_other_rank_analysed(tmp_path, capsys):
    run_dir = copy_without(TWO_RANKS, tmp_path, "rank-1")
    assert main(["analyze", str(run_dir)]) == 0
    out, err = capsys.readouterr()
    assert err.strip() == (f"gpuprof: {run_dir}/rank-1/ is missing: meta.json says the run had 2 rank(s) and "
                           "finished, so this folder should hold rank 1's meta and records (lost, or that rank never "
                           "started recording)")
    report = build_report(run_dir)
    assert report.summary.n_steps > 0 and report.summary.missing_ranks == [1]
    assert out.startswith("Verdict: ") and LOOP_BLAMED not in out


def test_every_rank_lost_names_each_missing_file(tmp_path, capsys):
    run_dir = copy_without(TWO_RANKS, tmp_path, "rank-0/steps.parquet", "rank-1")
    line = refused(["analyze", str(run_dir)], capsys)
    assert (f"{run_dir}/rank-0/steps.parquet is missing: rank-0/meta.json says rank 0 of 2 finished after " in line
            and f"; {run_dir}/rank-1/ is missing: meta.json says the run had 2 rank(s)" in line
            and line.endswith("Restore them from a copy, or record the run again")), line


def export_trace(path: Path) -> Path:
    """A real trace of a matmul, as torch.profiler's export_chrome_trace writes it (named as the user chose)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        torch.randn(64, 64) @ torch.randn(64, 64)
    profile.export_chrome_trace(str(path))
    return path


def plugin_folder_with_a_stray(folder: Path) -> Path:
    """Two spans of one worker as tensorboard_trace_handler writes them, and an exported trace put beside them."""
    schedule = torch.profiler.schedule(wait=0, warmup=0, active=1, repeat=2)
    handler = torch.profiler.tensorboard_trace_handler(str(folder), worker_name="worker")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule,
                                on_trace_ready=handler) as profile:
        for _ in range(3):
            torch.randn(64, 64) @ torch.randn(64, 64)
            profile.step()
    export_trace(folder / "exported.json")
    return folder


def test_a_trace_folder_names_the_file_its_spans_leave_out(tmp_path, capsys):
    folder = plugin_folder_with_a_stray(tmp_path / "plugin")
    assert main(["trace", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "2 trace windows (profiler spans) in this folder" in out  # the stray is no third worker of one window
    assert "Left out: exported.json (not named WORKER.TIMESTAMP.pt.trace.json[.gz]" in out
    assert "exported.json)" not in out.split("Left out")[0]  # no rank read it


@pytest.fixture
def folder_with_lost_files(recorded, tmp_path) -> Path:
    """A runs folder as a user may hand it to the dashboard: a run whose steps file was deleted, one whose
    meta.json was, a trace written by export_chrome_trace (no tensorboard_trace_handler name) beside a JSON file
    that is no trace, and a tensorboard_trace_handler folder with such a trace put in it."""
    root = tmp_path / "runs"
    copy_without(recorded, root / "no-steps", "rank-0/steps.parquet")
    copy_without(recorded, root / "no-meta", "meta.json")
    (root / "exported").mkdir()
    export_trace(root / "exported" / "matmul.json")
    (root / "exported" / "config.json").write_text('{"lr": 0.001}')
    plugin_folder_with_a_stray(root / "plugin")
    return root


@pytest.mark.slow  # a real browser against a real server
@needs_browser
def test_the_runs_page_names_the_lost_files_and_the_traces_it_does_not_list(folder_with_lost_files, start_dashboard):
    server = start_dashboard(str(folder_with_lost_files))
    started = server.process.stdout.readline()  # the line after its URL, where it was started
    assert started.startswith("note: 1 trace file(s) not listed: exported/matmul.json. Only gpuprof runs"), started
    with chromium_page() as page:
        page.goto(f"{server.url}?page=Runs")
        text = rendered(page, 0, 1, ["steps.parquet is missing", "meta.json is missing", "not listed"])["text"]
    assert server.ctrl_c() == 0
    assert "no-steps/tiny/rank-0/steps.parquet is missing: rank-0/meta.json says rank 0 of 1 finished" in text
    assert "no-meta/tiny/meta.json is missing: rank-0/meta.json says rank 0 of 1 finished" in text
    assert "1 trace file(s) not listed: exported/matmul.json." in text and "config.json" not in text
    assert "plugin: Left out: exported.json (not named WORKER.TIMESTAMP.pt.trace.json[.gz]" in text
    assert LOOP_BLAMED not in text and not unreadable(text)
