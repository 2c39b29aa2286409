"""`gpuprof dashboard` as a user runs it: a real server on localhost, loaded in headless Chromium
(driven over the DevTools protocol), stopped with Ctrl-C."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from gpuprof.diagnoses import diagnose
from gpuprof.run.reader import load_run

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1400,2400",
)
START_TIMEOUT_S = 60.0
RENDER_TIMEOUT_S = 180.0  # generous: the machine running the suite is shared and often loaded
URL_LINE = re.compile(r"^gpuprof dashboard on (.*): (http://\S+)")
MIN_CHARTS = 6


def start_dashboard(*args: str, cwd: Path | None = None) -> tuple[subprocess.Popen, str, str]:
    """`gpuprof dashboard ARGS` running; returns it, the folder it serves and its URL (as printed)."""
    server = subprocess.Popen([sys.executable, "-m", "gpuprof", "dashboard", *args],
                              stdout=subprocess.PIPE, text=True, cwd=cwd)
    deadline = time.monotonic() + START_TIMEOUT_S
    for line in server.stdout:
        match = URL_LINE.match(line)
        if match:
            return server, match.group(1), match.group(2)
        assert time.monotonic() < deadline, "no URL printed"
    raise AssertionError(f"gpuprof dashboard exited with {server.wait()} before printing its URL")


def stop_with_ctrl_c(server: subprocess.Popen) -> int:
    server.send_signal(signal.SIGINT)
    return server.wait(timeout=30)


def test_dashboard_serves_runs_on_localhost_and_stops_on_ctrl_c(sample_root, tmp_path):
    shutil.copytree(sample_root / "baseline", tmp_path / "runs" / "baseline")
    server, folder, url = start_dashboard(cwd=tmp_path)  # no folder given: ./runs
    try:
        assert folder == str(tmp_path / "runs")
        assert url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(f"{url}_stcore/health", timeout=10) as response:
            assert response.status == 200
        streamlit = psutil.Process(server.pid).children(recursive=True)
        listening = {c.laddr.ip for p in streamlit for c in p.net_connections("inet") if c.status == "LISTEN"}
        assert listening == {"127.0.0.1"}
    finally:
        returncode = stop_with_ctrl_c(server)
    assert returncode == 0
    assert not [p for p in streamlit if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


class DevTools:
    """The few Chrome DevTools protocol calls the test needs, over one page's websocket."""

    def __init__(self, socket):
        self.socket = socket
        self.next_id = 0

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        self.socket.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv(timeout=60))
            if message.get("id") == self.next_id:
                assert "error" not in message, message["error"]
                return message["result"]

    def evaluate(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")


def start_chromium(profile_dir: Path) -> tuple[subprocess.Popen, str]:
    """Headless Chromium with a fresh profile; returns it and its first page's DevTools websocket."""
    browser = subprocess.Popen(
        [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile_dir}", "--remote-debugging-port=0", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    for line in browser.stderr:
        match = re.search(r"DevTools listening on ws://([^/]+)/", line)
        if match:
            with urllib.request.urlopen(f"http://{match.group(1)}/json/list", timeout=10) as response:
                pages = [t for t in json.load(response) if t["type"] == "page"]
            return browser, pages[0]["webSocketDebuggerUrl"]
    raise AssertionError(f"chromium exited with {browser.wait()} before opening DevTools")


# A chart counts once Plotly has drawn its data: SVG traces (`.trace`) or a heatmap image (`.hm`).
PAGE_STATE = """JSON.stringify({
  charts: document.querySelectorAll('.js-plotly-plot').length,
  drawn: Array.from(document.querySelectorAll('.js-plotly-plot'))
    .filter(chart => chart.querySelector('.trace, .hm')).length,
  running: document.querySelectorAll('[data-testid="stStatusWidget"]').length,
  text: document.body.innerText})"""


def settled_screenshot(devtools: DevTools) -> bytes:
    """A screenshot once two in a row are identical: the page has finished painting."""
    previous = None
    deadline = time.monotonic() + RENDER_TIMEOUT_S
    while time.monotonic() < deadline:
        shot = base64.b64decode(devtools.call("Page.captureScreenshot", format="png")["data"])
        if shot == previous:
            return shot
        previous = shot
        time.sleep(0.5)
    raise AssertionError(f"the page kept changing for {RENDER_TIMEOUT_S} s")


def wait_for_page(devtools: DevTools, titles: list[str]) -> dict:
    """Waits until the page shows the charts and every finding title (the DOM, never a fixed sleep)."""
    deadline = time.monotonic() + RENDER_TIMEOUT_S
    state = {}
    while time.monotonic() < deadline:
        state = json.loads(devtools.evaluate(PAGE_STATE) or "{}")
        text = state.get("text", "")
        charts = state.get("charts", 0)
        if charts >= MIN_CHARTS and state["drawn"] == charts and not state["running"] and all(t in text for t in titles):
            return state
        time.sleep(0.25)
    raise AssertionError(f"page not rendered in {RENDER_TIMEOUT_S} s: {state.get('drawn')}/{state.get('charts')} charts, "
                         f"text starts {state.get('text', '')[:300]!r}")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (scripts/test.sh installs Debian's "
                    "`chromium` where it can: apt-get install -y chromium)")
def test_run_page_renders_diagnoses_and_charts_in_chromium(sample_root, tmp_path):
    from websockets.sync.client import connect

    findings = diagnose(load_run(sample_root / "slow-data"))
    titles = [finding.title for finding in findings]
    server, _, url = start_dashboard(str(sample_root))
    browser = None
    try:
        browser, websocket_url = start_chromium(tmp_path / "chromium-profile")
        with connect(websocket_url, max_size=None, open_timeout=30) as socket:
            devtools = DevTools(socket)
            devtools.call("Page.navigate", url=f"{url}?page=Run&run=slow-data")
            state = wait_for_page(devtools, titles)
            screenshot = settled_screenshot(devtools)
        assert "Diagnoses" in state["text"] and "Step time by phase" in state["text"]
    finally:
        if browser is not None:
            browser.terminate()
            browser.wait(timeout=30)
        assert stop_with_ctrl_c(server) == 0
    (tmp_path / "run_page.png").write_bytes(screenshot)
    from PIL import Image

    image = Image.open(io.BytesIO(screenshot)).convert("L")
    low, high = image.getextrema()
    assert high - low > 100, "the screenshot is blank"
