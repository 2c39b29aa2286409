"""The Distributed page of a run that hung and was killed: the hang first, its stack, the ranks' timeline."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dashboard_helpers import trace_named, values

from gpuprof.report import build_report

HUNG_LOOP = """
import sys, time, torch
import gpuprof

def wait_for_the_lock():
    time.sleep(3600)

model = torch.nn.Linear(8, 8)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
with gpuprof.profile(sys.argv[1], model=model, optimizer=optimizer, numerics=False, hang_timeout_s=2) as prof:
    for step in range(10):
        if step == 3:
            wait_for_the_lock()
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        prof.step()
"""
BOUND_S = 240


@pytest.fixture(scope="module")
def hung_root(tmp_path_factory) -> Path:
    """A run whose loop hung at step 3 and was killed (SIGKILL) once its hang event was on disk."""
    root = tmp_path_factory.mktemp("hung")
    job = subprocess.Popen([sys.executable, "-c", HUNG_LOOP, str(root / "hung")])
    try:
        deadline = time.monotonic() + BOUND_S
        events = root / "hung" / "rank-0" / "events.jsonl"
        while time.monotonic() < deadline and job.poll() is None:
            if events.is_file() and any(json.loads(line)["kind"] == "hang" for line in events.read_text().splitlines()):
                break
            time.sleep(0.5)
    finally:
        job.kill()
        job.wait(timeout=60)
    return root


def test_the_page_of_a_hung_run_shows_the_hang_its_stack_and_the_ranks_timeline(hung_root, open_page):
    report = build_report(hung_root / "hung")
    assert report.verdict.bound == "failure" and report.rank_outcomes["status"].tolist() == ["incomplete"]
    [hang] = report.hangs.to_dict(orient="records")
    app = open_page(hung_root, "Distributed", ("hung",))
    assert any(hang["message"] in error.value for error in app.error)
    assert hang["message"].startswith("rank 0 is at step 3 (data) in wait_for_the_lock (<string>:")
    [stack] = [expander for expander in app.expander if expander.label == "Stack of rank 0 (hang 1)"]
    assert "wait_for_the_lock" in stack.code[0].value
    assert trace_named(app, "hang")["text"] == [hang["message"]]
    assert trace_named(app, "last seen: incomplete")["y"] == ["rank 0"]
    assert len(values(trace_named(app, "data"), "x")) >= 1  # the heartbeats of the stalled step
