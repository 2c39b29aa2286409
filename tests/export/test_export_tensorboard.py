"""`gpuprof export RUN --to tensorboard`: what TensorBoard's own reader finds in the files is what the run recorded."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from processes import gpuprof_cli
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import gpuprof
from gpuprof.run.schema import measured_columns

SAMPLE = Path(__file__).resolve().parents[2] / "sample_runs" / "ddp-2rank"


def read_back(folder: Path) -> EventAccumulator:
    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


@pytest.fixture
def run_copy(tmp_path) -> Path:
    return Path(shutil.copytree(SAMPLE, tmp_path / "ddp-2rank"))


def test_every_step_of_every_rank_reads_back_once_with_its_values_and_the_verdict(run_copy):
    done = gpuprof_cli("export", str(run_copy), "--to", "tensorboard")
    assert done.returncode == 0, done.stderr
    out = run_copy / "exports" / "tensorboard"
    assert f"tensorboard --logdir {out}" in done.stdout
    gpuprof_cli("export", str(run_copy))  # again: replaces, never appends
    run = gpuprof.load_run(run_copy)
    for rank in run.ranks:
        steps = run.steps[run.steps["rank"] == rank]
        accumulator = read_back(out / f"rank-{rank}")
        tags = accumulator.Tags()
        exported = [column for column in measured_columns("steps") if steps[column].notna().any()]
        assert {"steps/step_time_s", "steps/loss", "steps/grad_norm"} <= set(tags["scalars"])
        for column in exported:
            scalars = accumulator.Scalars(f"steps/{column}")
            assert [s.step for s in scalars] == steps.loc[steps[column].notna(), "step"].tolist()  # once each
            np.testing.assert_allclose([s.value for s in scalars], steps[column].dropna().astype(float), rtol=1e-6)
        system = run.system[run.system["rank"] == rank]
        if system["host_cpu_pct"].notna().any():
            assert len(accumulator.Scalars("system/host_cpu_pct")) == system["host_cpu_pct"].notna().sum()
        texts = {tag: accumulator.Tensors(tag) for tag in tags["tensors"]}
        verdict = texts["verdict/text_summary"][0].tensor_proto.string_val[0].decode()
        assert gpuprof.report.build_report(run_copy).verdict.headline in verdict


def test_a_folder_gpuprof_did_not_write_is_refused_and_left_as_it_was(run_copy, tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    done = gpuprof_cli("export", str(run_copy), "--out", str(theirs))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "was not written by gpuprof export" in done.stderr
    assert [path.name for path in theirs.iterdir()] == ["notes.txt"]


def test_a_path_that_is_no_run_is_one_line_and_exit_2(tmp_path):
    done = gpuprof_cli("export", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.strip() == f"gpuprof export: error: {tmp_path} is not a gpuprof run directory (no meta.json)"
