"""Fixtures of the dashboard tests: the sample runs, an AppTest opener, and real servers that always stop
(`start_dashboard`, from dashboard_servers)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock

from dashboard_servers import start_dashboard  # noqa: F401 - a fixture of these tests

from gpuprof.dashboard import APP_PATH, RUNS_DIR_ENV

SAMPLE_NAMES = ("baseline", "optimized", "nan", "slow-data", "ddp-2rank", "tune")
REPO = Path(__file__).resolve().parents[2]
REPO_SAMPLE_RUNS = REPO / "sample_runs"
FALLBACK_STEPS = 8


@pytest.fixture(scope="session")
def sample_root(tmp_path_factory) -> Path:
    """sample_runs/ from the repo, or the same runs recorded now when it is missing or incomplete."""
    if complete(REPO_SAMPLE_RUNS):
        return REPO_SAMPLE_RUNS
    # Under xdist every worker has its own base temp folder inside one for the session: record once there.
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    out = shared / "dashboard_sample_runs"
    with FileLock(str(shared / "dashboard_sample_runs.lock")):
        if not complete(out):
            subprocess.run(
                [sys.executable, str(REPO / "scripts" / "make_sample_runs.py"), "--out", str(out),
                 "--steps", str(FALLBACK_STEPS)],
                check=True, cwd=REPO,
            )
    return out


def complete(root: Path) -> bool:
    return all((root / name / ("tune.json" if name == "tune" else "meta.json")).is_file() for name in SAMPLE_NAMES)


@pytest.fixture
def open_page(monkeypatch):
    """open_page(root, page, runs=()) -> an AppTest that has rendered `page` with `runs` selected."""
    from streamlit.testing.v1 import AppTest

    def open_(root: Path, page: str, runs: tuple[str, ...] = ()):
        monkeypatch.setenv(RUNS_DIR_ENV, str(root))
        app = AppTest.from_file(str(APP_PATH), default_timeout=120)
        app.query_params["page"] = page
        if runs:
            app.query_params["run"] = list(runs)
        app.run()
        assert not app.exception, [e.value for e in app.exception]
        return app

    return open_


@pytest.fixture(scope="session")
def traced_root(tmp_path_factory) -> Path:
    """A folder with one run of a tiny GPT-2 loop recorded by gpuprof.profile with a trace window
    (steps 2-3): the real capture path, whatever flags `gpuprof train` offers."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import gpuprof

    root = tmp_path_factory.mktemp("traced")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with gpuprof.profile(root / "traced", model=model, optimizer=optimizer, trace_steps=range(2, 4),
                         sample_interval_s=None) as prof:
        for _ in range(5):
            with prof.phase("data"):
                tokens = torch.randint(0, 256, (4, 32))
            with prof.phase("forward"):
                loss = model(input_ids=tokens, labels=tokens).loss
            with prof.phase("backward"):
                loss.backward()
            with prof.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad()
            prof.step(loss=loss, tokens=tokens.numel())
    return root


@pytest.fixture(scope="session")
def many_ranks_root(tmp_path_factory) -> Path:
    """A folder with one finished 64-rank x 200-step run synthesised by benchmarks/scale.py
    (straggler: rank 21)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from scale import synthesise

    root = tmp_path_factory.mktemp("many_ranks")
    synthesise(root / "wide", n_ranks=64, n_steps=200, system_hz=2.0)
    return root


@pytest.fixture(scope="session")
def snapshot_root(tmp_path_factory) -> Path:
    """A folder with one run of a tiny GPT-2 loop with a trace window (steps 1-2) and two memory
    snapshots written where capture writes them: one named by an `oom` event, as on an
    out-of-memory error, and one on demand without allocation history. The snapshots are torch's
    own format, converted by torch from a profile (no CUDA here)."""
    import pickle

    from gpt2_runs import record, training_step_snapshot

    def snapshot(prof, model, optimizer, tokens) -> None:
        if prof.step_index not in (3, 4):
            return
        taken = training_step_snapshot(model, optimizer, tokens)
        path = prof.writer.snapshot_path(prof.step_index)
        if prof.step_index == 4:
            taken["device_traces"] = [[] for _ in taken["device_traces"]]
        path.write_bytes(pickle.dumps(taken))
        if prof.step_index == 3:
            prof.event("oom", "out of memory (a test's stand-in)", severity="critical", step=prof.step_index,
                       snapshot=prof.writer.relative(path))

    root = tmp_path_factory.mktemp("snapshots")
    # the snapshots' own profiler runs after the trace window: two profilers at once crash torch
    record(root / "snap", steps=5, trace_steps=range(1, 3), before_step=snapshot)
    return root
