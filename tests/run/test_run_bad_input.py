"""Bad input, deep: run directories whose files parse but hold the wrong things. Every field read from
meta.json and the rank files is checked once, in the reader: a bad meta field is one line and exit 2
from the CLI; a damaged rank file is left out and said, and a run with no readable steps left is refused
in one line (tests/cli/test_bad_run_files.py). Hypothesis fuzzes the fields: wrong types, missing keys, future
format versions."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpuprof
from gpuprof.cli import main
from gpuprof.report import build_report
from gpuprof.run import schema

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "sample_runs"
# Each example analyses a whole run (a few seconds on a loaded CPU): few examples, the same ones every run.
FUZZ = settings(max_examples=20, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # capsys is read out each time
# Fields of meta.json the analysis reads, as paths into it (a number indexes a list).
META_FIELDS = [("world_size",), ("devices",), ("devices", 0), ("devices", 0, "kind"), ("devices", 0, "name"),
               ("devices", 0, "total_memory_bytes"), ("model",), ("model", "n_params"), ("model", "flops_per_token"),
               ("model", "seq_len"), ("loop",), ("loop", "model", "compiled"), ("loop", "optimizer"),
               ("loop", "optimizer", "fused"), ("loop", "loader", "num_workers"), ("loop", "torch"),
               ("loop", "autocast_dtype"), ("config",), ("compute_dtype",), ("peak_flops_per_s",), ("status",),
               ("start_unix_s",), ("name",), ("options",), ("distributed",), ("format_version",), ("format",)]
ANY_JSON = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=False), st.text(max_size=4),
                     st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


def copy_run(name: str, into: Path) -> Path:
    """A sample run without its traces (the trace analyzer has bad-input tests of its own)."""
    target = into / name
    shutil.copytree(SAMPLE / name, target, ignore=shutil.ignore_patterns("traces"))
    return target


def analyze(run_dir: Path, capsys) -> tuple[int, list[str], str]:
    """(exit code, stderr lines, stdout) of `gpuprof analyze RUN`; any exception fails the test."""
    code = main(["analyze", str(run_dir)])
    out, err = capsys.readouterr()
    return code, err.strip().splitlines(), out


def set_at(document: dict, path: tuple, value) -> bool:
    """Sets (or, for the `delete` marker, removes) the field at `path`; False when the path is not there."""
    *parents, last = path
    for key in parents:
        try:
            document = document[key]
        except (KeyError, IndexError, TypeError):
            return False
    if isinstance(document, dict) and value is DELETE:
        return document.pop(last, DELETE) is not DELETE
    if isinstance(document, list) and not (isinstance(last, int) and last < len(document)):
        return False
    if isinstance(document, list) and value is DELETE:
        del document[last]
        return True
    if isinstance(document, (dict, list)):
        document[last] = value
        return True
    return False


DELETE = object()


@pytest.mark.parametrize("field,value,said", [
    ("world_size", "two", "world_size: expected int, got str"),
    ("world_size", 0, "world_size: expected int >= 1"),
    ("devices", "gpu", "devices: expected array, got str"),
    ("model", {"n_params": "124M"}, "model.n_params: expected int, got str"),
    ("loop", {"optimizer": {"fused": "yes"}}, "loop.optimizer.fused: expected bool, got str"),
    ("format_version", 2, "written by a newer gpuprof"),
    ("format_version", "1", "format_version is '1'"),
])
def test_a_bad_meta_field_is_one_line_and_exit_2(tmp_path, capsys, field, value, said):
    run_dir = copy_run("baseline", tmp_path)
    meta = json.loads((run_dir / "meta.json").read_text())
    (run_dir / "meta.json").write_text(json.dumps({**meta, field: value}))
    code, err, _ = analyze(run_dir, capsys)
    assert code == 2 and len(err) == 1 and said in err[0], err


def test_a_bad_rank_meta_field_is_one_line(tmp_path):
    run_dir = copy_run("baseline", tmp_path)
    path = run_dir / "rank-0" / "meta.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "rank": "zero"}))
    with pytest.warns(UserWarning, match="rank: expected int, got str.*rank 0 meta.json left out"):
        assert gpuprof.load_run(run_dir).rank_meta == {}


@FUZZ
@given(field=st.sampled_from(META_FIELDS), value=st.one_of(st.just(DELETE), ANY_JSON))
def test_fuzzed_meta_is_read_or_refused_in_one_line(capsys, field, value):
    with tempfile.TemporaryDirectory() as folder:
        run_dir = copy_run("baseline", Path(folder))
        meta = json.loads((run_dir / "meta.json").read_text())
        set_at(meta, field, value)
        (run_dir / "meta.json").write_text(json.dumps(meta))
        code, err, out = analyze(run_dir, capsys)
        assert code in (0, 2), (field, value)
        if code == 2:
            assert len(err) == 1 and err[0].startswith("gpuprof analyze: error: "), err
        else:
            assert out.startswith("Verdict: ")


def test_a_damaged_rank_of_two_is_left_out_and_the_other_analysed(tmp_path, capsys):
    run_dir = copy_run("ddp-2rank", tmp_path)
    (run_dir / "rank-1" / "steps.parquet").write_bytes(b"PAR1 not really")
    code, err, _ = analyze(run_dir, capsys)
    assert code == 0 and any("rank-1/steps.parquet: unreadable" in line and "rank 1 left out" in line for line in err)
    report = build_report(run_dir)
    assert report.summary.n_steps > 0 and report.summary.missing_ranks == [1] == report.summary.damaged_ranks
    assert report.verdict.missing != "readable steps"


@pytest.mark.parametrize("damage", ["not json {", '{"status": 3, "rank": "one"}', "[]"])
def test_a_damaged_rank_meta_leaves_that_ranks_meta_out_and_the_run_analysed(tmp_path, capsys, damage):
    run_dir = copy_run("ddp-2rank", tmp_path)
    (run_dir / "rank-1" / "meta.json").write_text(damage)
    code, err, out = analyze(run_dir, capsys)
    assert code == 0 and out.startswith("Verdict: ")
    assert any("rank-1/meta.json: corrupt meta file" in line and "rank 1 meta.json left out" in line for line in err), err
    report = build_report(run_dir)
    assert sorted(report.run.steps["rank"].unique()) == [0, 1]  # its records still count
    assert 1 not in report.run.rank_meta and 0 in report.run.rank_meta


COLUMN_VALUES = st.one_of(st.text(min_size=1, max_size=4), st.lists(st.integers(), min_size=1, max_size=2),
                          st.dictionaries(st.text(max_size=2), st.integers(), min_size=1, max_size=1))


@settings(FUZZ, max_examples=12)
@given(stream=st.sampled_from(["steps", "events", "layers", "system"]), data=st.data(),
       as_jsonl=st.booleans())
def test_fuzzed_rank_files_are_read_or_left_out_and_said(capsys, stream, data, as_jsonl):
    with tempfile.TemporaryDirectory() as folder:
        run_dir = copy_run("baseline", Path(folder))
        rank_dir = run_dir / "rank-0"
        frame = pd.read_parquet(rank_dir / f"{stream}.parquet")
        column = data.draw(st.sampled_from([c for c in schema.STREAM_COLUMNS[stream] if c in frame]), label="column")
        value = data.draw(COLUMN_VALUES, label="value")
        frame[column] = [value] * len(frame)
        (rank_dir / f"{stream}.parquet").unlink()
        if as_jsonl:
            frame.to_json(rank_dir / f"{stream}.jsonl", orient="records", lines=True, default_handler=str)
        else:
            try:
                frame.to_parquet(rank_dir / f"{stream}.parquet")
            except Exception:  # noqa: BLE001 - pyarrow cannot store this mix: nothing for the reader to read
                return
        code, err, out = analyze(run_dir, capsys)
        if stream == "steps" and code == 2:  # its one steps file unreadable: no verdict (tests/cli/test_bad_run_files.py)
            assert len(err) == 1 and "No rank has readable steps" in err[0], err
            return
        assert code == 0, err
        assert out.startswith("Verdict: ")
