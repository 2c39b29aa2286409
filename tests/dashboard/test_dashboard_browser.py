"""`gpuprof dashboard` as a user runs it: a real server on localhost, every page loaded in Debian's
headless Chromium driven by Playwright, stopped with Ctrl-C."""

from __future__ import annotations

import io
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from urllib.parse import urlencode

import psutil
import pytest
from browser import chromium_page, needs_browser, rendered
from dashboard_helpers import unreadable
from dashboard_servers import ctrl_c_as_at_a_terminal

from gpuprof.diagnoses import diagnose
from gpuprof.run.reader import load_run

pytestmark = pytest.mark.slow  # a real browser against a real server

def test_dashboard_serves_runs_on_localhost_and_stops_on_ctrl_c(sample_root, tmp_path, start_dashboard):
    shutil.copytree(sample_root / "baseline", tmp_path / "runs" / "baseline")
    server = start_dashboard(cwd=tmp_path)  # no folder given: ./runs
    assert server.folder == str(tmp_path / "runs")
    assert server.url.startswith("http://127.0.0.1:")
    with urllib.request.urlopen(f"{server.url}_stcore/health", timeout=60) as response:
        assert response.status == 200
    streamlit = psutil.Process(server.pid).children(recursive=True)
    listening = {c.laddr.ip for p in streamlit for c in p.net_connections("inet") if c.status == "LISTEN"}
    assert listening == {"127.0.0.1"}
    assert server.ctrl_c() == 0
    assert not [p for p in streamlit if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


# What a page must show once rendered: runs selected in the URL, charts drawn (at least), tables, and texts.
PAGES = (
    ("Runs", (), 0, 1, ["Recorded on", "plain trace", "cpu · tiny baseline", "Bound by input"]),  # runs beside plain traces
    ("Run", ("slow-data",), 6, 0, ["Diagnoses", "Step time by phase"]),
    ("Numerics", ("nan",), 1, 0, ["Numerics"]),
    ("Trace", ("snap",), 1, 3, ["Timeline of a step", "no device activity"]),  # empty tables named, not drawn
    ("Memory", ("snap",), 1, 1, ["Allocated", "Allocation timeline", "Largest live allocations"]),
    ("Distributed", ("ddp-2rank",), 1, 1, ["Distributed"]),
    ("Compare", ("baseline", "optimized"), 3, 2, ["Speedup", "95 % CI", "Comparability contract", "Measured step times"]),
    ("Tune", (), 1, 1, ["Measured speedup against the estimate", "Each trial's run"]),
)
def browser_root(sample_root: Path, snapshot_root: Path, plugin_traces: dict, views_trace: Path, folder: Path) -> Path:
    """The sample runs, a run with a trace window and memory snapshots, and plain traces (one recorded with
    every option of the plugin's views), in one folder."""
    for run in (*(sample_root / name for name in ("baseline", "optimized", "nan", "slow-data", "ddp-2rank", "tune")),
                snapshot_root / "snap", plugin_traces["no_workers"], plugin_traces["workers"], views_trace):
        shutil.copytree(run, folder / run.name)
    return folder


# The pages of plain traces (their Runs page is the folder's, above): (page, runs, charts, tables, texts).
TRACE_PAGES = (
    ("Run", ("no_workers",), 1, 0, ["Bound by input", "waiting for the next batch", "only a gpuprof run records"]),
    ("Trace", ("no_workers",), 1, 3, ["Step time breakdown", "Timeline of a step", "last profiler step is left out"]),
    ("Distributed", ("workers",), 0, 0, ["single process"]),
    ("Compare", ("no_workers", "workers"), 2, 1, ["Bound by input", "Step time breakdown"]),
    ("Memory", ("views",), 1, 2, ["Memory over time", "Memory allocated by operator", "aten::addmm"]),
)


# One server and one browser for both lists of pages: each start costs a loaded machine seconds of CPU.
@needs_browser
def test_every_page_of_runs_and_of_plain_traces_renders_its_charts_and_tables_in_chromium(
        sample_root, snapshot_root, plugin_traces, views_trace, tmp_path, start_dashboard):
    titles = [finding.title for finding in diagnose(load_run(sample_root / "slow-data"))]
    server = start_dashboard(str(browser_root(sample_root, snapshot_root, plugin_traces, views_trace,
                                              tmp_path / "runs")))
    url = server.url
    with chromium_page() as page:
        shown = {}
        for name, runs, charts, tables, texts in PAGES:
            page.goto(f"{url}?{urlencode({'page': name, 'run': runs}, doseq=True)}")
            shown[name] = rendered(page, charts, tables, texts + (titles if name == "Run" else []))
            if name == "Run":
                screenshot = page.screenshot()
            if name == "Trace":  # the step breakdown's link opens the step's timeline in a new tab
                with page.context.expect_page() as opened:
                    page.get_by_role("link", name=re.compile(r"^step \d+$")).first.click()
                timeline = opened.value
                shown["Timeline"] = rendered(timeline, 1, 1, ["Drew ", "Longest intervals drawn"])
                timeline.close()
        for name, runs, charts, tables, texts in TRACE_PAGES:
            page.goto(f"{url}?{urlencode({'page': name, 'run': runs}, doseq=True)}")
            shown[f"plain traces: {name}"] = rendered(page, charts, tables, texts)
    assert server.ctrl_c() == 0
    assert {name: state["failures"] for name, state in shown.items()} == dict.fromkeys(shown, 0)
    assert set(shown) == {"Runs", "Run", "Numerics", "Trace", "Timeline", "Memory", "Distributed", "Compare", "Tune",
                          *(f"plain traces: {name}" for name, *_ in TRACE_PAGES)}
    runs_text = shown["Runs"]["text"]
    assert "no_workers" in runs_text and "workers" in runs_text and "baseline" in runs_text
    assert {name: unreadable(state["text"]) for name, state in shown.items()} == dict.fromkeys(shown, [])
    (tmp_path / "run_page.png").write_bytes(screenshot)
    from PIL import Image

    image = Image.open(io.BytesIO(screenshot)).convert("L")
    low, high = image.getextrema()
    assert high - low > 100, "the screenshot is blank"


WAITS_FOR_CTRL_C = """


def test_serves_until_interrupted(start_dashboard, tmp_path):
    server = start_dashboard(str(tmp_path))
    print("SERVER", server.pid, flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "sigkill"])
def test_servers_stop_when_pytest_is_stopped_by_ctrl_c_or_killed(tmp_path, stop_signal):
    """The servers run in their own process group, where a Ctrl-C at pytest's terminal does not reach them:
    pytest's teardown (or its exit) kills them; a pytest killed outright takes them with it too."""
    (tmp_path / "test_inner.py").write_text(WAITS_FOR_CTRL_C)
    here = str(Path(__file__).parent)
    inner = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "dashboard_servers", "-p", "no:cacheprovider",
                              "-s", "-q", "test_inner.py"], cwd=tmp_path, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])},
                             start_new_session=True,  # the terminal's foreground group, in this test
                             preexec_fn=ctrl_c_as_at_a_terminal)
    try:
        pid = next(int(line.split()[1]) for line in inner.stdout if line.startswith("SERVER"))
        server = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        assert os.getpgid(pid) != inner.pid  # a Ctrl-C to pytest's group does not reach the server...
        os.killpg(inner.pid, stop_signal)
        inner.wait(timeout=120)
        gone, alive = psutil.wait_procs(server, timeout=60)
        assert not alive, alive  # ...and yet it stopped
    finally:
        if inner.poll() is None:
            os.killpg(inner.pid, signal.SIGKILL)
            inner.wait()
