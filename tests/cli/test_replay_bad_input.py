"""`gpuprof replay` given what is not a replay bundle: one line that says what the file is and what a bundle is,
exit code 2, never a traceback or torch's internals ("pop from empty list")."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from cli.cli_helpers import refused_line

from gpuprof.numerics.bundle import not_a_bundle

BUNDLE_IS = "a bundle is the file gpuprof saved with torch.save when a step went non-finite"


def refused(path, capsys) -> str:
    """The one line `gpuprof replay PATH` printed on refusing it, with no exception's name in it."""
    line = refused_line(["replay", str(path)], capsys)
    assert "Error:" not in line, line
    return line


@pytest.mark.parametrize("name,content,said", [
    ("steps.csv", "step,loss\n0,4.2\n", f"steps.csv is not a replay bundle but a text file: {BUNDLE_IS}"),
    ("notes.txt", "lr spike at step 8?\n", f"notes.txt is not a replay bundle but a text file: {BUNDLE_IS}"),
    ("blame.json", json.dumps({"step": 8, "module": "transformer.wte"}),
     f"blame.json is not a replay bundle but a JSON document: {BUNDLE_IS}"),
    ("step-8-rank-0.pt", "", "step-8-rank-0.pt is empty, not a replay bundle"),
])
def test_a_file_that_is_no_bundle_is_named_for_what_it_is(tmp_path, capsys, name, content, said):
    path = tmp_path / name
    path.write_text(content)
    assert f"{tmp_path}/{said}" in refused(path, capsys)


def test_a_missing_path_is_said_missing(tmp_path, capsys):
    assert refused(tmp_path / "step-8-rank-0.pt", capsys).endswith("step-8-rank-0.pt does not exist")


def test_a_zip_archive_or_a_torch_file_of_other_things_is_refused(tmp_path, capsys):
    import zipfile

    with zipfile.ZipFile(tmp_path / "logs.zip", "w") as archive:
        archive.writestr("train.log", "step 8 loss nan\n")
    assert "logs.zip is not a replay bundle but a zip archive of other files" in refused(tmp_path / "logs.zip", capsys)
    torch.save({"model": torch.zeros(2)}, tmp_path / "checkpoint.pt")  # what torch.save writes, not a bundle
    assert refused(tmp_path / "checkpoint.pt", capsys).endswith("checkpoint.pt is not a gpuprof replay bundle")


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory):
    """A real run of the reference workload whose embedding goes NaN at step 2: its bundle is written."""
    run_dir = tmp_path_factory.mktemp("nan") / "run"
    subprocess.run([sys.executable, "-m", "gpuprof", "train", "--model", "tiny", "--steps", "4", "--n-layer", "1",
                    "--seq-len", "32", "--batch-size", "2", "--sample-interval", "0", "--inject", "embedding-nan@2",
                    "--run-dir", str(run_dir)], check=True, capture_output=True, timeout=600)
    return run_dir


def test_a_run_folder_is_refused_with_the_bundles_it_holds(nan_run, capsys):
    [bundle] = sorted((nan_run / "numerics").glob("*.pt"))
    assert refused(nan_run, capsys).endswith(f"{nan_run} is a folder, not a replay bundle; the bundles in it: {bundle}")
    assert not_a_bundle(bundle) is None  # the real bundle passes the check and goes on to be replayed
