"""A run whose steps file holds what no recording makes, as a user meets it: `gpuprof analyze` and `gpuprof report`
refuse it in one line that names the file and what is wrong in it (exit code 2, nothing on stdout, no traceback),
since a verdict drawn from such rows would be false, and leave every file of the run as it was. A damaged rank of
two is left out and said, and the other analysed."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from cli.cli_helpers import refused_line

from gpuprof.cli import main
from gpuprof.report import build_report

TWO_RANKS = Path(__file__).resolve().parents[2] / "sample_runs" / "ddp-2rank"  # recorded under torchrun (gloo)
REFUSED = "No rank has readable steps to analyse: restore the file from a copy, or record the run again"


def at_row(frame: pd.DataFrame, row: int, **values) -> pd.DataFrame:
    frame = frame.copy()
    for column, value in values.items():
        frame[column] = frame[column].astype("float64")
        frame.loc[row, column] = value
    return frame


# name: (the steps table of the run's 3 steps, damaged; what the refusal says is wrong)
DAMAGES = {
    "step times as text": (lambda steps: steps.assign(step_time_s=[f"{v:.3f}s" for v in steps["step_time_s"]]),
                           "column step_time_s holds text values where numbers belong"),
    "a negative step time": (lambda steps: at_row(steps, 1, step_time_s=-0.5),
                             "step_time_s is negative, missing or not finite in 1 of 3 rows (step 1)"),
    "a step time missing": (lambda steps: at_row(steps, 2, step_time_s=np.nan),
                            "step_time_s is negative, missing or not finite in 1 of 3 rows (step 2)"),
    "negative tokens": (lambda steps: at_row(steps, 0, tokens=-64),
                        "tokens is negative, missing or not finite in 1 of 3 rows (step 0)"),
    "a step twice": (lambda steps: steps.iloc[[0, 1, 1, 2]].reset_index(drop=True),
                     "step 1 is there twice (row 3 of 4), where each step is recorded once, in order"),
    "steps out of order": (lambda steps: steps.iloc[::-1].reset_index(drop=True),
                           "step 1 comes after step 2 (row 2 of 3), where each step is recorded once, in order"),
    "a garbage row": (lambda steps: pd.concat([steps, steps.iloc[[0]].assign(step=-7)], ignore_index=True),
                      "step is missing, negative or not a whole number in 1 of 4 rows (row 4)"),
}


def damaged_copy(run_dir: Path, into: Path, damage, rank: int = 0, as_jsonl: bool = False) -> Path:
    """A copy of the run whose rank's steps file holds damage(its steps), as Parquet or as a killed run's JSON lines."""
    copy = into / run_dir.name
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("traces"))
    steps_file = copy / f"rank-{rank}" / "steps.parquet"
    steps = damage(pd.read_parquet(steps_file))
    if as_jsonl:
        steps_file.unlink()
        steps.to_json(steps_file.with_suffix(".jsonl"), orient="records", lines=True)
    else:
        steps.to_parquet(steps_file)
    return copy


def fingerprint(run_dir: Path) -> dict[str, str]:
    """Every file of the run and its bytes' hash."""
    return {str(path.relative_to(run_dir)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(run_dir.rglob("*")) if path.is_file()}


@pytest.mark.parametrize("damage", DAMAGES, ids=list(DAMAGES))
@pytest.mark.parametrize("command", ["analyze", "report"])
def test_a_steps_file_holding_garbage_is_refused_in_one_line_and_left_as_it_was(recorded, tmp_path, capsys, command,
                                                                                  damage):
    make, what = DAMAGES[damage]
    run_dir = damaged_copy(recorded, tmp_path, make)
    before = fingerprint(run_dir)
    output = ["-o", str(tmp_path / "report.html")] if command == "report" else []
    line = refused_line([command, str(run_dir), *output], capsys)
    assert line == f"gpuprof {command}: error: {run_dir}/rank-0/steps.parquet: {what}. {REFUSED}"
    assert fingerprint(run_dir) == before and not (tmp_path / "report.html").exists()


def test_a_killed_runs_steps_lines_holding_garbage_are_refused_the_same(recorded, tmp_path, capsys):
    make, what = DAMAGES["a negative step time"]
    run_dir = damaged_copy(recorded, tmp_path, make, as_jsonl=True)
    before = fingerprint(run_dir)
    line = refused_line(["analyze", str(run_dir)], capsys)
    assert line == f"gpuprof analyze: error: {run_dir}/rank-0/steps.jsonl: {what}. {REFUSED}"
    assert fingerprint(run_dir) == before


def test_a_rank_of_two_holding_garbage_is_left_out_and_the_other_analysed(tmp_path, capsys):
    run_dir = damaged_copy(TWO_RANKS, tmp_path, DAMAGES["steps out of order"][0], rank=1)
    before = fingerprint(run_dir)
    assert main(["analyze", str(run_dir)]) == 0
    out, err = capsys.readouterr()
    [said] = [line for line in err.splitlines() if "rank-1/steps.parquet" in line]
    assert said.startswith(f"gpuprof: {run_dir}/rank-1/steps.parquet: step ") and said.endswith(
        "where each step is recorded once, in order; rank 1 left out")
    report = build_report(run_dir)
    with pytest.warns(UserWarning, match="rank 1 left out"):
        assert sorted(report.run.steps["rank"].unique()) == [0]
    assert report.summary.damaged_ranks == [1]
    assert out.startswith("Verdict: ") and fingerprint(run_dir) == before
