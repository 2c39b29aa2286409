"""Running `gpuprof tune` as a user would, for the tune tests (a module of its own: the tests are split
over files so that the suite's two workers share them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
TUNE_TIMEOUT_S = 1200


def gpuprof_tune(*args) -> dict:
    done = subprocess.run([sys.executable, "-m", "gpuprof", "tune", "--json", *map(str, args)], capture_output=True,
                          text=True, timeout=TUNE_TIMEOUT_S, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def trials_of(result: dict) -> dict:
    return {trial["name"]: trial for trial in result["trials"]}
