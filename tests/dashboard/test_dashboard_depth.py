"""The Timeline and Memory pages, the Trace page's links into the timeline, and the default folder,
on runs recorded by gpuprof.profile: what the pages draw is what the analysis layer returns."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import numpy as np
import pytest
from dashboard_helpers import column_config, figures, texts, values

from gpuprof.analysis.memory_snapshot import read_snapshot
from gpuprof.analysis.trace import TraceAnalysis
from gpuprof.analysis.trace.loader import load_trace
from gpuprof.analysis.trace.timeline import step_timeline
from gpuprof.dashboard import APP_PATH, RUNS_DIR_ENV
from gpuprof.dashboard.charts import PHASE_COLORS
from gpuprof.dashboard.views import memory, timeline
from gpuprof.report.format import GIB, figure
from gpuprof.report.page_views import snapshot_hint
from gpuprof.run.reader import load_run

LINK = re.compile(r"\[step (\d+)\]\((\?[^)]*)\)")


def timeline_links(app) -> list[str]:
    markdown = next(text for text in texts(app.markdown) if text.startswith("**Timeline of a step**"))
    return [url for _, url in LINK.findall(markdown)]


def open_link(root: Path, url: str, monkeypatch):
    """The app as a browser following `url` (?page=...&run=...) opens it: a fresh session."""
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv(RUNS_DIR_ENV, str(root))
    app = AppTest.from_file(str(APP_PATH), default_timeout=120)
    for key, value in parse_qs(urlparse(url).query).items():
        app.query_params[key] = value
    app.run()
    assert not app.exception and not app.error, [e.value for e in app.exception]
    return app


def test_trace_page_links_each_step_to_its_timeline(traced_root, open_page):
    app = open_page(traced_root, "Trace", ("traced",))
    window = load_run(traced_root / "traced").trace_files[0].parent.name
    analysed = TraceAnalysis(load_run(traced_root / "traced").trace_files).step_breakdown()["step"].tolist()
    assert [parse_qs(urlparse(url).query) for url in timeline_links(app)] == [
        {"page": ["Timeline"], "run": ["traced"], "window": [window], "rank": ["0"], "step": [str(step)]}
        for step in analysed]


def test_timeline_page_draws_the_step_the_link_names(traced_root, open_page, monkeypatch):
    run = load_run(traced_root / "traced")
    app = open_page(traced_root, "Timeline", ("traced",))
    assert [box.value for box in app.selectbox] == ["steps-2-3", 0, 2]  # the window's first step by default
    app = open_link(traced_root, timeline.timeline_url("traced", "steps-2-3", 0, 3), monkeypatch)
    assert [box.value for box in app.selectbox] == ["steps-2-3", 0, 3]
    expected = step_timeline(load_trace(run.trace_files), 3, 0)
    bars = [trace for trace in figures(app)[0]["data"] if trace["type"] == "bar"]
    assert sum(len(values(bar, "base")) for bar in bars) == len(expected.intervals)
    drawn_ms = np.sort(np.concatenate([values(bar, "x") for bar in bars]))
    np.testing.assert_allclose(drawn_ms, np.sort(expected.intervals["dur_us"].to_numpy()) / 1e3)
    labels = {label for bar in bars for label in bar["text"]}
    assert labels == set(expected.intervals["name"])  # each bar carries its name (shown where it fits)
    assert f"Drew {len(expected.intervals):,} intervals for {expected.events:,} events" in " ".join(texts(app.caption))
    assert {bar["name"] for bar in bars} >= {"cpu_op", "user_annotation"}
    phases = {bar["name"]: bar["marker"]["color"] for bar in bars if bar["name"].startswith("phase: ")}
    assert {"phase: forward", "phase: backward"} <= set(phases)  # each phase in the colour the phase charts give it
    assert all(color == PHASE_COLORS[name.removeprefix("phase: ")] for name, color in phases.items())


def test_timeline_and_memory_pages_say_how_to_record(sample_root, tmp_path, open_page):
    shutil.copytree(sample_root / "baseline", tmp_path / "bare")
    shutil.rmtree(tmp_path / "bare" / "traces", ignore_errors=True)
    assert texts(open_page(tmp_path, "Timeline", ("bare",)).info) == [timeline.RECORD_HINT]
    memory_lines = texts(open_page(tmp_path, "Memory", ("bare",)).info)
    assert memory_lines == [snapshot_hint(load_run(tmp_path / "bare").meta)]
    assert "recorded only on a CUDA device, and this run ran on the CPU" in memory_lines[0]  # a CPU run, said once
    (tmp_path / "empty").mkdir()
    for page in ("Timeline", "Memory"):
        assert any("Select" in text for text in texts(open_page(tmp_path / "empty", page).info))


def test_memory_page_shows_the_oom_snapshot_timeline_and_largest_allocations(snapshot_root, open_page):
    run = load_run(snapshot_root / "snap")
    oom_file, on_demand_file = run.snapshot_files
    app = open_page(snapshot_root, "Memory", ("snap",))
    box = app.selectbox(key="memory_snapshot")
    assert box.options == [
        f"{oom_file.name} · out of memory", f"{on_demand_file.name} · on demand"]
    expected = read_snapshot(oom_file)
    metrics = {metric.label: metric.value for metric in app.metric}
    assert metrics == {"Allocated": figure(expected.allocated_bytes, "bytes"),
                       "Reserved": figure(expected.reserved_bytes, "bytes"), "Segments": f"{expected.segments:,}"}
    allocated = next(trace for trace in figures(app)[0]["data"] if trace["name"] == "allocated · device 0")
    assert values(allocated, "y")[-1] * GIB == pytest.approx(expected.allocated_bytes)
    assert values(allocated, "y").max() * GIB == pytest.approx(expected.timeline["allocated_bytes"].max())
    top, labels = app.dataframe[0].value, {name: config.get("label") for name, config in column_config(app.dataframe[0]).items()}
    assert top["size_bytes"].tolist() == [figure(size, "bytes") for size in expected.top_allocations["size_bytes"]]
    assert top["top_frame"].tolist() == expected.top_allocations["top_frame"].fillna("n/a").tolist()
    assert labels["size_bytes"] == "size" and labels["requested_bytes"] == "requested"  # not raw column names

    box.select_index(1).run()
    assert not app.exception and not app.get("plotly_chart")
    assert texts(app.info) == [memory.HISTORY_HINT]
    assert app.dataframe[0].value["size_bytes"].tolist() == [
        figure(size, "bytes") for size in read_snapshot(on_demand_file).top_allocations["size_bytes"]]


def test_dashboard_without_a_folder_or_runs_dir_is_one_line_and_exit_2(tmp_path):
    result = subprocess.run([sys.executable, "-m", "gpuprof", "dashboard"], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "gpuprof dashboard: error: no ./runs folder here: name a folder of runs (gpuprof dashboard RUNS_DIR), "
        "or record a run first (gpuprof train and gpuprof run record into ./runs)"]
