"""One stream file of a rank (`steps.parquet`, `events.jsonl`, ...) read and checked: every documented
column present, each holding its kind of value (gpuprof.run.schema), event details parsed. The reader
(`reader.py`) and the query engine (`query.py`) both read files through here."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from gpuprof.errors import DamagedFileError, RunFormatError
from gpuprof.run import schema
from gpuprof.run.jsonable import encodable


def read_stream(rank_dir: Path, stream: str) -> pd.DataFrame:
    """One rank's stream: Parquet when compacted, else its JSON lines, else empty. DamagedFileError for a file
    that cannot be read, or whose columns hold the wrong kind of value (text where step times belong)."""
    parquet = rank_dir / f"{stream}.parquet"
    if parquet.is_file():
        try:
            frame = pd.read_parquet(parquet)
        except Exception as error:  # noqa: BLE001 - any damage means the same: this file cannot be read
            raise DamagedFileError(f"{parquet}: unreadable ({error})") from None
        return checked(with_lists(frame, stream), stream, parquet)
    return read_jsonl_frame(rank_dir / f"{stream}.jsonl", stream)


def read_jsonl_frame(path: Path, stream: str) -> pd.DataFrame:
    records = read_jsonl(path) if path.is_file() else []
    return checked(pd.DataFrame.from_records(records), stream, path)


def checked(frame: pd.DataFrame, stream: str, path: Path) -> pd.DataFrame:
    """`frame` with every documented column and `details` parsed; DamagedFileError when a column holds the
    wrong kind of value."""
    problem = column_problem(stream, {column: _pandas_kind(frame[column]) for column in frame.columns})
    if problem is None:
        problem = row_problem(stream, frame)
    if problem is not None:
        raise DamagedFileError(f"{path}: {problem}")
    if "details" in frame:
        frame["details"] = [parse_details(d) for d in frame["details"]]
    return with_columns(frame, stream)


def with_lists(frame: pd.DataFrame, stream: str) -> pd.DataFrame:
    """The stream's list columns as lists (Parquet and DuckDB give numpy arrays; JSON lines give lists)."""
    for column in schema.LIST_COLUMNS.get(stream, {}):
        if column in frame:
            frame[column] = [list(v) if isinstance(v, (np.ndarray, list)) else None for v in frame[column]]
    return frame


def storable(frame: pd.DataFrame) -> pd.DataFrame:
    """A reader frame as Parquet and DuckDB take it: `details` as JSON text, a column of only nulls as float
    (not arrow's null type; the readers take it for null of any kind)."""
    if schema.DETAILS_COLUMN in frame:
        frame[schema.DETAILS_COLUMN] = [d if d is None or isinstance(d, str) else json.dumps(d, default=encodable)
                                        for d in frame[schema.DETAILS_COLUMN]]
    for column in frame.columns:
        if frame[column].isna().all():
            frame[column] = frame[column].astype("float64")
    return frame


def left_out(error: RunFormatError, rank: int, what: str = "") -> None:
    """Says that this rank's file (or only `what` of it) is not read (the report shows it in its notes)."""
    warnings.warn(f"gpuprof: {error}; rank {rank}{f' {what}' if what else ''} left out", stacklevel=3)


def refuse_without_readable_steps(damaged: list[DamagedFileError], readable: int) -> None:
    """RunFormatError when the run's steps files are all damaged (`damaged`, none of `readable` left): with no step
    to read there is no verdict to give, and one drawn from the rest would be false. The files stay as they are."""
    if damaged and not readable:
        more = f"; and {len(damaged) - 2} more rank(s)" if len(damaged) > 2 else ""
        shown = "; ".join(map(str, damaged[:2])) + more
        raise RunFormatError(f"{shown}. No rank has readable steps to analyse: restore the file from a copy, or "
                             "record the run again")


def column_problem(stream: str, kinds: dict[str, str]) -> str | None:
    """The first documented column whose values are of the wrong kind, for people; None when all fit.

    kinds: column -> "number", "flag", "text", "list", "object", "null" or "mixed" (gpuprof.run.schema says
    which each column holds). A flag may be stored as a number (a rank that never set it); details as text."""
    fits = {"number": {"number"}, "flag": {"flag", "number"}, "text": {"text"}, "list": {"list"},
            "details": {"text", "object"}}
    for column, kind in kinds.items():
        expected = schema.column_kind(stream, column)
        if expected is not None and kind != "null" and kind not in fits[expected]:
            return f"column {column} holds {kind} values where {expected}s belong"
    return None


def row_problem(stream: str, columns) -> str | None:
    """The first rows of a steps file that no recording makes (schema.REQUIRED_STEP_VALUES, STEP_AMOUNTS: a
    negative or missing step time, a step twice or out of order), with where, for people; None when all fit.
    `columns`: the file's columns by name (a DataFrame, or arrays) in its row order, already of their kinds
    (column_problem). In numpy: every run's every rank passes here when it is read."""
    if stream != "steps" or "step" not in columns:
        return None
    steps = _floats(columns["step"])
    if not len(steps):
        return None
    bad = ~(np.isfinite(steps) & (steps >= 0) & (steps == np.floor(steps)))
    if bad.any():
        return f"step is missing, negative or not a whole number in {_rows_text(bad)}"
    fallen = _fallen(steps, _floats(columns["rank"]) if "rank" in columns else None)
    if fallen.any():
        row = int(np.flatnonzero(fallen)[0])
        step, before = int(steps[row]), int(steps[row - 1])
        what = f"step {step} is there twice" if step == before else f"step {step} comes after step {before}"
        return f"{what} (row {row + 1} of {len(steps)}), where each step is recorded once, in order"
    for column in (*schema.REQUIRED_STEP_VALUES, *schema.STEP_AMOUNTS):
        if column not in columns:
            continue
        values = _floats(columns[column])
        missing = np.isnan(values)
        bad = (missing & (column in schema.REQUIRED_STEP_VALUES)) | (~missing & ~(np.isfinite(values) & (values >= 0)))
        if bad.any():
            return f"{column} is negative, missing or not finite in {_rows_text(bad, steps)}"
    return None


def _floats(values) -> np.ndarray:
    """A column as float64, NaN where it holds nothing or no number."""
    array = np.asarray(values)
    if array.dtype.kind in "fiub":
        return array.astype("float64", copy=False)
    return pd.to_numeric(pd.Series(array), errors="coerce").to_numpy(dtype="float64", na_value=np.nan)


def _fallen(steps: np.ndarray, ranks: np.ndarray | None) -> np.ndarray:
    """Where a step is not above the one before it of its rank."""
    if ranks is None or (ranks == ranks[0]).all():  # a rank's own file: one rank
        return np.concatenate([[False], np.diff(steps) <= 0])
    return (pd.Series(steps).groupby(ranks).diff() <= 0).to_numpy()


def _rows_text(bad: np.ndarray, steps: np.ndarray | None = None) -> str:
    """"2 of 8 rows (steps 2, 3)": the rows `bad` marks, by their steps where known, else by row number."""
    rows = np.flatnonzero(bad)
    where = [f"{int(steps[row])}" for row in rows[:3]] if steps is not None else [str(row + 1) for row in rows[:3]]
    more = ", ..." if len(rows) > 3 else ""
    noun = ("step" if steps is not None else "row") + ("s" if len(rows) > 1 else "")
    return f"{len(rows)} of {len(bad)} rows ({noun} {', '.join(where)}{more})"


def _pandas_kind(values: pd.Series) -> str:
    if values.isna().all():  # the writer stores a column of only nulls as float
        return "null"
    inferred = pd.api.types.infer_dtype(values, skipna=True)
    kind = {"floating": "number", "integer": "number", "mixed-integer-float": "number", "decimal": "number",
            "boolean": "flag", "string": "text", "empty": "null"}.get(inferred)
    if kind is not None:
        return kind
    present = [value for value in values if value is not None and not (isinstance(value, float) and value != value)]
    if all(isinstance(value, (list, np.ndarray)) for value in present):
        return "list"
    return "object" if all(isinstance(value, dict) for value in present) else "mixed"


def arrow_kind(kind) -> str:
    """A Parquet column's arrow type as column_problem's kinds."""
    import pyarrow as pa

    checks = [(pa.types.is_null, "null"), (pa.types.is_boolean, "flag"), (pa.types.is_integer, "number"),
              (pa.types.is_floating, "number"), (pa.types.is_string, "text"), (pa.types.is_large_string, "text"),
              (pa.types.is_list, "list"), (pa.types.is_large_list, "list")]
    return next((name for check, name in checks if check(kind)), "mixed")


def parse_details(value: Any) -> dict | None:
    """An event's details: a dict, stored as JSON text in Parquet; None when it is neither."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return value if isinstance(value, dict) else None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Records of a JSON lines file; a torn or corrupt line is skipped with a warning."""
    with open(path, "rb") as handle:
        lines = handle.read().split(b"\n")
    records, bad = [], []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            bad.append(number)
            continue
        if isinstance(record, dict):
            records.append(record)
        else:
            bad.append(number)
    if bad:
        where = "its torn last line" if bad == [len(lines)] else f"line(s) {bad[:5]}"
        warnings.warn(f"gpuprof: {path}: skipped {where} (run killed while writing?)", stacklevel=3)
    return records


def with_columns(frame: pd.DataFrame, stream: str) -> pd.DataFrame:
    """Every documented column is present (null where never written); extra columns are kept."""
    missing = [column for column in schema.STREAM_COLUMNS[stream] if column not in frame]
    if missing:
        frame = frame.assign(**{column: None for column in missing})
    extra = [column for column in frame.columns if column not in schema.STREAM_COLUMNS[stream]]
    return frame[[*schema.STREAM_COLUMNS[stream], *extra]]
