"""Bad input and live runs: each case gets a clear message and the rest of the dashboard keeps working."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from dashboard_helpers import texts, trace_named, values

import gpuprof
from gpuprof.dashboard import RUNS_DIR_ENV
from gpuprof.run.reader import load_run

POLL_TIMEOUT_S = 120.0  # a bound, not a wait: polling ends as soon as the steps are there


def test_empty_folder_says_how_to_record_a_run(tmp_path, open_page):
    app = open_page(tmp_path, "Runs")
    assert any(text.startswith(f"No runs under {tmp_path}") for text in texts(app.info))
    assert not app.dataframe


def test_missing_folder_is_one_clear_error(tmp_path, open_page):
    app = open_page(tmp_path / "nope", "Runs")
    assert texts(app.error) == [f"runs folder {tmp_path / 'nope'} does not exist or is not a folder"]


@pytest.mark.parametrize(
    ("meta_text", "message"),
    [
        ("{not json", "corrupt meta file"),
        (json.dumps({"format": "gpuprof-run", "format_version": 99}), "written by a newer gpuprof"),
    ],
)
def test_unreadable_run_is_named_and_the_others_still_show(sample_root, tmp_path, open_page, meta_text, message):
    shutil.copytree(sample_root / "baseline", tmp_path / "good")
    (tmp_path / "broken" / "rank-0").mkdir(parents=True)
    (tmp_path / "broken" / "meta.json").write_text(meta_text)
    app = open_page(tmp_path, "Runs")
    assert app.dataframe[0].value["run"].tolist() == ["good"]
    warnings = texts(app.warning)
    assert len(warnings) == 1 and warnings[0].startswith("`broken` cannot be shown") and message in warnings[0]
    app = open_page(tmp_path, "Run", ("good",))
    assert not app.error and app.get("plotly_chart")


def test_run_outside_the_folder_cannot_be_selected_from_the_url(sample_root, tmp_path, open_page):
    shutil.copytree(sample_root / "baseline", tmp_path / "inside" / "baseline")
    shutil.copytree(sample_root / "optimized", tmp_path / "outside")
    app = open_page(tmp_path / "inside", "Run", ("../outside",))
    assert app.sidebar.multiselect[0].options == ["baseline"]
    assert app.sidebar.multiselect[0].value == ["baseline"]
    assert app.header[0].value == "Run `baseline`"


def test_unreadable_trace_gets_a_message_and_the_page_stays(tmp_path, open_page):
    app = open_page(tmp_path, "Trace")
    app.file_uploader[0].upload("broken.json.gz", b"\x1f\x8b not really gzip").run()
    assert not app.exception
    assert texts(app.error) == ["broken.json.gz: truncated or corrupt gzip file (Error -3 while decompressing data: "
                                "unknown compression method)"]  # in its own name, not the private folder's path
    app.file_uploader[0].upload("list.json", b"[1, 2, 3]").run()
    assert texts(app.error) == ["list.json: not a torch.profiler trace (Expected `object`, got `int` - at `$[0]`)"]
    assert not app.get("download_button")  # nothing to download that is not a trace
    assert app.header[0].value == "Trace · uploaded `list.json`"


def test_half_written_run_shows_what_was_written(tmp_path, open_page):
    """A run killed mid-write: status still `running`, JSON lines only, a torn last line."""
    script = (
        "import sys, time, gpuprof\n"
        "prof = gpuprof.profile(sys.argv[1], sample_interval_s=None).__enter__()\n"
        "for step in range(4):\n"
        "    prof.step(loss=3.0 - step / 10, tokens=64)\n"
        "time.sleep(1.5)\n"  # the writer flushes at least once a second
        "print('ready', flush=True)\n"
        "time.sleep(120)\n"
    )
    run_dir = tmp_path / "killed"
    writer = subprocess.Popen([sys.executable, "-c", script, str(run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "ready"
    finally:
        writer.kill()
        writer.wait()
    with open(run_dir / "rank-0" / "steps.jsonl", "ab") as steps:
        steps.write(b'{"step": 4, "rank": 0, "time_un')
    with pytest.warns(UserWarning, match="torn last line"):
        written = load_run(run_dir).steps
    app = open_page(tmp_path, "Runs")
    row = app.dataframe[0].value.iloc[0]
    assert row["run"] == "killed" and row["steps"] == len(written) == 4
    app = open_page(tmp_path, "Run", ("killed",))
    np.testing.assert_allclose(values(trace_named(app, "loss"), "y"), written["loss"])
    assert not app.exception
    # its process is gone without closing: the one error shown is the verdict saying the rank was killed
    (error,) = app.error
    assert "rank 0 stopped after step 3 with no traceback" in error.value


def _steps_recorded(run_dir, at_least: int) -> int:
    deadline = time.monotonic() + POLL_TIMEOUT_S
    while time.monotonic() < deadline:
        recorded = len(load_run(run_dir).steps)
        if recorded >= at_least:
            return recorded
        time.sleep(0.2)
    raise AssertionError(f"{run_dir}: fewer than {at_least} steps after {POLL_TIMEOUT_S} s")


def test_live_run_refreshes_without_losing_selections(tmp_path, monkeypatch):
    from streamlit.testing.v1 import AppTest

    from gpuprof.dashboard import APP_PATH

    monkeypatch.setenv(RUNS_DIR_ENV, str(tmp_path))
    with gpuprof.profile(tmp_path / "live", sample_interval_s=None) as prof:
        for step in range(3):
            prof.step(loss=torch.tensor(2.0 - step / 10), tokens=64)
        _steps_recorded(tmp_path / "live", 3)
        app = AppTest.from_file(str(APP_PATH), default_timeout=120)
        app.query_params["page"] = "Run"
        app.run()
        app.sidebar.number_input(key="refresh_s").set_value(2.0).run()
        assert any(text == "Live: refreshing every 2 s." for text in texts(app.caption))
        assert len(values(trace_named(app, "loss"), "y")) == 3
        for step in range(3, 7):
            prof.step(loss=torch.tensor(2.0 - step / 10), tokens=64)
        recorded = _steps_recorded(tmp_path / "live", 7)
        app.run()
        assert len(values(trace_named(app, "loss"), "y")) == recorded
        assert app.sidebar.radio(key="page").value == "Run"
        assert app.sidebar.multiselect(key="selected_runs").value == ["live"]
        assert app.sidebar.number_input(key="refresh_s").value == 2.0
    app.run()
    assert not any(text.startswith("Live:") for text in texts(app.caption))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{tmp}/nope"], "runs folder {tmp}/nope does not exist or is not a folder"),
        (["{tmp}", "--port", "70000"], "--port must be between 1 and 65535, got 70000"),
        (["{tmp}", "--refresh-s", "0.2"], "--refresh-s must be at least 1, got 0.2"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    result = subprocess.run([sys.executable, "-m", "gpuprof", "dashboard", *(a.format(tmp=tmp_path) for a in args)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip() == f"gpuprof dashboard: error: {message.format(tmp=tmp_path)}"


def test_a_rule_that_raises_is_said_on_the_run_page(sample_root, tmp_path, open_page):
    from gpuprof.diagnoses import rule
    from gpuprof.diagnoses.registry import RULES

    @rule("test-always-fails", "host")
    def always_fails(ctx):
        raise RuntimeError("boom")

    try:
        shutil.copytree(sample_root / "baseline", tmp_path / "baseline")
        app = open_page(tmp_path, "Run", ("baseline",))
    finally:
        RULES.pop("test-always-fails")
    said = [text for text in texts(app.warning) + texts(app.info) if "failed: RuntimeError: boom" in text]
    assert len(said) == 2, said  # the note, and the verdict's why
    assert any(text.startswith("rule test-always-fails failed") for text in said), said
