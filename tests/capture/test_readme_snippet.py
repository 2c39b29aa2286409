"""The README's "Instrument your own loop" snippet, run as a user pastes it: it records, and prints nothing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import gpuprof

README = Path(__file__).resolve().parents[2] / "README.md"
SNIPPET = re.compile(r"## Instrument your own loop\n\n```python\n(.*?)```", re.S)


def test_the_readmes_snippet_records_its_steps_and_trace_and_prints_nothing(tmp_path):
    snippet = SNIPPET.search(README.read_text()).group(1)
    (tmp_path / "snippet.py").write_text(snippet)
    done = subprocess.run([sys.executable, "snippet.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # no transformers warning, no kineto start/stop lines, no notice of a GPU this machine lacks
    assert done.stdout == "" and done.stderr == ""
    run = gpuprof.load_run(tmp_path / "runs" / "exp1")
    assert run.steps["step"].tolist() == list(range(20))  # 160 sequences in batches of 8
    assert run.steps["loss"].notna().all() and run.trace_files
