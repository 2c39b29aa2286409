"""`gpuprof tune` on a real public script, unmodified: karpathy/nanoGPT's train.py (tests/scripts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from script_corpus import NANOGPT_CONFIG, materialize, write_nanogpt_data

TUNE_TIMEOUT_S = 1500


@pytest.mark.slow
@pytest.mark.timeout(TUNE_TIMEOUT_S)
def test_nanogpt_gets_its_optimizer_fused_and_its_garbage_collector_frozen_in_trials_of_their_own(tmp_path):
    workdir = tmp_path / "work"
    workdir.mkdir()
    script = materialize("nanogpt", workdir)
    write_nanogpt_data(workdir / "data" / "corpus")
    sources = {path.name: path.read_bytes() for path in workdir.glob("*.py")}
    settings = {**NANOGPT_CONFIG, "out_dir": str(tmp_path / "out"), "max_iters": 10_000, "lr_decay_iters": 10_000}
    done = subprocess.run(
        [sys.executable, "-m", "gpuprof", "tune", "--json", "--steps", "6", "--only", "fused-optimizer,gc-freeze",
         "--out", str(tmp_path / "tune"), str(script), *(f"--{key}={value}" for key, value in settings.items())],
        capture_output=True, text=True, cwd=workdir, timeout=TUNE_TIMEOUT_S, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    trials = {trial["name"]: trial for trial in result["trials"]}
    fused, frozen = trials["fused-optimizer"], trials["gc-freeze"]
    for trial in (fused, frozen):
        assert trial["status"] == "measured" and trial["speedup"] is not None, trial
        assert trial["parity"]["status"] in ("identical", "within noise", "diverged"), trial["parity"]
    # nanoGPT builds its AdamW in model.py (configure_optimizers), fused only on CUDA: the edit goes there
    [edit] = fused["edits"]
    assert edit["kind"] == "keywords" and edit["call"] == "AdamW" and edit["file"].endswith("model.py")
    assert edit["keywords"] == {"fused": "True"}
    # once the model exists: before the line of train.py that builds the optimizer
    [freeze] = frozen["edits"]
    assert freeze["kind"] == "before" and freeze["file"] == str(script) and freeze["code"][1].startswith("gc.freeze()")
    assert "configure_optimizers" in script.read_text().splitlines()[freeze["line"] - 1]
    assert frozen["parity"]["status"] == "identical"  # same seed, same numbers
    assert {path.name: path.read_bytes() for path in workdir.glob("*.py")} == sources  # nothing written into them
