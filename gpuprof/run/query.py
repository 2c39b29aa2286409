"""Out-of-core queries over a run's record streams: DuckDB over the ranks' Parquet files.

`run.steps` and friends hold every row of every rank in pandas; at hundreds of ranks that is
gigabytes. The analysis, the diagnoses and the dashboard ask this module instead: DuckDB reads
the per-rank files of a stream as one table, in parallel and within `MEMORY_LIMIT`, and only the
small answers (per-rank and per-step aggregates, quantiles, one rank's rows, downsampled grids)
come back as pandas.

    query = run.query
    query.aggregate("steps", {"p50_s": quantile("step_time_s", 0.5)}, by="rank", where=[since_step(5)])

Callers never write SQL: columns, aggregates and filters are built by the functions below.
Every stream is seen with all its documented columns (null where never written), float NaN read
as null (pandas' dropna semantics) and the boolean flags as booleans, whatever each rank's file
stored. A rank whose file cannot be read is left out with a warning and listed in
`missing_ranks`, with the ranks of the world that wrote nothing.
"""

from __future__ import annotations

import os
import re
import tempfile
import threading
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

import pandas as pd

from gpuprof.errors import DamagedFileError
from gpuprof.run import schema
from gpuprof.run.streams import (
    arrow_kind, column_problem, left_out, parse_details, read_jsonl_frame, refuse_without_readable_steps,
    row_problem, storable, with_lists,
)

# DuckDB's own budget; the process adds Python, pandas and the answers on top.
MEMORY_LIMIT = os.environ.get("GPUPROF_QUERY_MEMORY", "512MB")
THREADS = max(1, min(os.cpu_count() or 1, 8))
# Exact quantiles hold every value of a group in memory: above this many rows per query they
# are estimated from a uniform sample of ESTIMATE_SAMPLE_ROWS rows (DuckDB reservoir_quantile;
# the estimate's rank is within about 0.3 % of the quantile's, at 95 % confidence).
EXACT_QUANTILE_MAX_ROWS = 8_000_000
ESTIMATE_SAMPLE_ROWS = 100_000
# Holistic per-rank aggregates (quantiles) hold every value of their column: they are computed over
# batches of ranks holding about this many values in all (rows x quantiles asked).
RANK_BATCH_VALUES = 12_000_000
# The SQL type of a documented column nobody wrote, by what it holds (gpuprof.run.schema.column_kind).
SQL_TYPES = {"number": "DOUBLE", "flag": "BOOLEAN", "text": "VARCHAR", "details": "VARCHAR"}


def _ident(name: str) -> str:
    if not isinstance(name, str) or '"' in name:
        raise ValueError(f"not a column name: {name!r}")
    return f'"{name}"'


@dataclass(frozen=True)
class Expr:
    """A per-row value: a column, or a sum of columns (see `row_total`)."""

    sql: str


@dataclass(frozen=True)
class Agg:
    """An aggregate over the rows of a group that `condition` keeps (all when empty); `holistic` ones
    (quantiles) need all of its values. `call` is one aggregate function call unless `composite`."""

    call: str
    holistic: bool = False
    value_sql: str = ""
    q: float = 0.0
    condition: str = ""
    composite: bool = False

    @property
    def sql(self) -> str:
        return self.call + _filter_clause(self.condition)


def _filter_clause(condition: str) -> str:
    return f" FILTER (WHERE {condition})" if condition else ""


@dataclass(frozen=True)
class Filter:
    sql: str


def _value(column: str | Expr) -> str:
    return column.sql if isinstance(column, Expr) else _ident(column)


def row_total(*columns: str) -> Expr:
    """Sum of the columns per row, null when all are null (pandas' `sum(min_count=1)`)."""
    idents = [_ident(c) for c in columns]
    known = " OR ".join(f"{c} IS NOT NULL" for c in idents)
    return Expr(f"(CASE WHEN {known} THEN {' + '.join(f'coalesce({c}, 0)' for c in idents)} END)")


def difference(a: str, b: str) -> Expr:
    return Expr(f"({_ident(a)} - {_ident(b)})")


def finite_only(column: str) -> Expr:
    """The column where finite, else null (infinities left out)."""
    return Expr(f"(CASE WHEN isfinite({_ident(column)}) THEN {_ident(column)} END)")


def ratio(a: str | Expr, b: str | Expr) -> Expr:
    return Expr(f"({_value(a)} / nullif({_value(b)}, 0))")


def maximum(column: str | Expr) -> Agg:
    return Agg(f"max({_value(column)})")


def minimum(column: str | Expr) -> Agg:
    return Agg(f"min({_value(column)})")


def total(column: str | Expr) -> Agg:
    return Agg(f"sum({_value(column)})")


def mean(column: str | Expr) -> Agg:
    return Agg(f"avg({_value(column)})")


def count(column: str | Expr | None = None) -> Agg:
    """Rows with a value in `column` (every row when None)."""
    return Agg(f"count({_value(column)})" if column is not None else "count(*)")


def count_where(condition: Filter) -> Agg:
    return Agg("count(*)", condition=condition.sql)


def steps_where(condition: Filter) -> Agg:
    """The steps with a row that `condition` keeps, each once however many ranks it holds."""
    return Agg(f"count(DISTINCT {_ident('step')})", condition=condition.sql)


def weighted_mean(value: str, weight: str) -> Agg:
    """sum(value * weight) / sum(weight) over rows where both are known; null when the weights sum to 0."""
    v, w = _ident(value), _ident(weight)
    both = f"{v} IS NOT NULL AND {w} IS NOT NULL"
    return Agg(f"(sum({v} * {w}) FILTER (WHERE {both}) / nullif(sum({w}) FILTER (WHERE {both}), 0))", composite=True)


def first(column: str) -> Agg:
    """The first known value in the stream's order (steps: by step, then rank); streams, never sorts."""
    return Agg(f"arg_min({_ident(column)}, {{order}})", condition=f"{_ident(column)} IS NOT NULL")


def last(column: str) -> Agg:
    return Agg(f"arg_max({_ident(column)}, {{order}})", condition=f"{_ident(column)} IS NOT NULL")


def quantile(column: str | Expr, q: float, where: Filter | None = None) -> Agg:
    """The q-quantile (0-1), interpolated linearly as numpy's percentile; nulls ignored."""
    value = _value(column)
    return Agg(f"quantile_cont({value}, {float(q)!r})", holistic=True, value_sql=value, q=q,
               condition=where.sql if where else "")


def within(aggregate: Agg, rows: Filter) -> Agg:
    """The aggregate over only the `rows` of its group: aggregates of different rows in one scan."""
    if aggregate.composite:
        raise ValueError(f"not one aggregate call: {aggregate.call}")
    condition = f"({rows.sql}) AND ({aggregate.condition})" if aggregate.condition else rows.sql
    return replace(aggregate, condition=condition)


def since_step(step: int) -> Filter:
    return Filter(f'"step" >= {int(step)}')


def at_step(step: int) -> Filter:
    return Filter(f'"step" = {int(step)}')


def since_time(unix_s: float) -> Filter:
    return Filter(f'"time_unix_s" >= {float(unix_s)!r}')


def device_rows() -> Filter:
    """System samples of a device (not the host-only rows)."""
    return Filter('"device_index" IS NOT NULL')


def is_false(flag: str) -> Filter:
    return Filter(f"{_ident(flag)} = false")


def is_true(flag: str) -> Filter:
    return Filter(f"{_ident(flag)} = true")


def any_false(*flags: str) -> Filter:
    return Filter("(" + " OR ".join(is_false(flag).sql for flag in flags) + ")")


def list_contains_any(column: str, substrings: tuple[str, ...]) -> Filter:
    """A list column holding an entry that contains one of `substrings` (case-insensitive)."""
    pattern = "|".join(re.escape(s.lower()) for s in substrings).replace("'", "''")
    # CASE, not AND: only rows with an entry (few) pay for the regular expression.
    return Filter(f"CASE WHEN len({_ident(column)}) > 0 THEN "
                  f"regexp_matches(lower(array_to_string({_ident(column)}, ' ')), '{pattern}') ELSE false END")


def kind_is(*kinds: str) -> Filter:
    """Events of one of `kinds`."""
    listed = ", ".join("'" + kind.replace("'", "''") + "'" for kind in kinds)
    return Filter(f'"kind" IN ({listed})')


def negate(condition: Filter) -> Filter:
    return Filter(f"NOT ({condition.sql})")


def _where(filters) -> str:
    filters = [f for f in filters or () if f is not None]
    return " WHERE " + " AND ".join(f"({f.sql})" for f in filters) if filters else ""


class RunQuery:
    """Aggregates over one run's streams; `run.query` is the run's (see the module doc)."""

    def __init__(self, run):
        self.run = run
        self._lock = threading.Lock()
        self._described: dict[tuple, dict[str, str]] = {}
        self._damaged: dict[str, list[int]] = {}  # stream -> ranks whose file was left out
        self._errors: dict[str, list[DamagedFileError]] = {}  # stream -> why, in the same order

    @cached_property
    def _connection(self):
        import duckdb

        spill = Path(tempfile.gettempdir()) / "gpuprof-duckdb"
        spill.mkdir(exist_ok=True)
        connection = duckdb.connect(config={
            "memory_limit": MEMORY_LIMIT, "threads": THREADS, "temp_directory": str(spill),
            "preserve_insertion_order": False,
        })
        connection.execute("SET enable_progress_bar = false")
        connection.execute("SET parquet_metadata_cache = true")  # every query reads the same footers
        return connection

    # --- sources -----------------------------------------------------------------------
    @cached_property
    def _files(self) -> dict[str, dict[int, Path]]:
        """Readable Parquet file per rank and stream; unreadable ones warned about once."""
        files: dict[str, dict[int, Path]] = {stream: {} for stream in schema.STREAMS}
        self._rows: dict[str, dict[int, int]] = {stream: {} for stream in schema.STREAMS}
        for rank in self.run.ranks:
            rank_dir = self.run.path / schema.rank_dir_name(rank)
            for stream in schema.STREAMS:
                path = rank_dir / f"{stream}.parquet"
                if not path.is_file():
                    continue
                try:
                    self._rows[stream][rank] = _checked_parquet(path, stream)
                except DamagedFileError as error:
                    self._left_out(stream, rank, error)
                    continue
                files[stream][rank] = path
        return files

    def _left_out(self, stream: str, rank: int, error: DamagedFileError) -> None:
        self._damaged.setdefault(stream, []).append(rank)
        self._errors.setdefault(stream, []).append(error)
        left_out(error, rank)

    @property
    def damaged_ranks(self) -> list[int]:
        """Ranks whose steps file is there but cannot be read (left out, with a warning)."""
        self._jsonl_frames  # noqa: B018
        return sorted(self._damaged.get("steps", []))

    @cached_property
    def _jsonl_frames(self) -> dict[str, pd.DataFrame]:
        """Streams of ranks not compacted (a live or killed run), read by the reader: small by nature."""

        frames = {}
        for stream in schema.STREAMS:
            parts = []
            for rank in self.run.ranks:
                path = self.run.path / schema.rank_dir_name(rank) / f"{stream}.jsonl"
                if rank not in self._files[stream] and path.is_file():
                    try:
                        parts.append(read_jsonl_frame(path, stream))
                    except DamagedFileError as error:
                        self._left_out(stream, rank, error)
            if stream == "steps":
                refuse_without_readable_steps(self._errors.get(stream, []), len(self._files[stream]) + len(parts))
            parts = [p for p in parts if not p.empty]
            if parts:
                frame = pd.concat(parts, ignore_index=True)
                self._rows[stream].update(frame.groupby("rank").size().astype(int).to_dict())
                frames[stream] = storable(frame)
        return frames

    @property
    def ranks_with_steps(self) -> list[int]:
        self._jsonl_frames  # noqa: B018
        return sorted(rank for rank, rows in self._rows["steps"].items() if rows)

    @property
    def missing_ranks(self) -> list[int]:
        """Ranks of the world (meta world_size) that left no readable step."""
        world = int(self.run.meta.get("world_size") or 1)
        present = set(self.ranks_with_steps)
        return [rank for rank in range(max(world, max(present, default=-1) + 1)) if rank not in present]

    def rows(self, stream: str, ranks=None) -> int:
        """Rows of the stream (of `ranks`), from the files' footers."""
        self._jsonl_frames  # noqa: B018
        counts = self._rows[stream]
        return sum(counts.get(rank, 0) for rank in (counts if ranks is None else ranks))

    def _source(self, stream: str, ranks=None) -> str:
        """A FROM clause: the stream of `ranks` (all when None) with every documented column."""
        files = [str(path) for rank, path in sorted(self._files[stream].items()) if ranks is None or rank in ranks]
        jsonl = self._jsonl_frames.get(stream)
        parts = []
        if files:
            listed = ", ".join("'" + f.replace("'", "''") + "'" for f in files)
            parts.append(f"SELECT * FROM read_parquet([{listed}], union_by_name = true)")
        if jsonl is not None:
            name = f"jsonl_{stream}"
            self._connection.register(name, jsonl)
            rank_filter = f" WHERE rank IN ({', '.join(map(str, ranks)) or 'NULL'})" if ranks is not None else ""
            parts.append(f"SELECT * FROM {name}{rank_filter}")
        if not parts:
            columns = ", ".join(f"NULL::{_empty_type(stream, c)} AS {_ident(c)}" for c in schema.STREAM_COLUMNS[stream])
            return f"(SELECT {columns} WHERE false)"
        union = " UNION ALL BY NAME ".join(parts)
        key = (stream, None if ranks is None else tuple(sorted(ranks)))
        if key not in self._described:
            self._described[key] = self._types(union)
        types = self._described[key]
        return f"(SELECT {', '.join(_projection(stream, types))} FROM ({union}))"

    def _types(self, union: str) -> dict[str, str]:
        described = self._execute(f"DESCRIBE {union}").fetchall()
        return {name: kind for name, kind, *_ in described}

    def _execute(self, sql: str):
        with self._lock:
            return self._connection.execute(sql)

    def _frame(self, sql: str) -> pd.DataFrame:
        with self._lock:
            return self._connection.execute(sql).fetch_df()

    # --- answers -----------------------------------------------------------------------
    def frame(self, stream: str, columns=None, *, where=(), limit: int | None = None, ranks=None) -> pd.DataFrame:
        """Rows of a stream as pandas, in the stream's order: for small selections (one rank, bad steps)."""
        selected = ", ".join(_ident(c) for c in columns) if columns else "*"
        order = ", ".join(_ident(k) for k in schema.SORT_KEYS[stream])
        tail = f" LIMIT {int(limit)}" if limit is not None else ""
        frame = self._frame(f"SELECT {selected} FROM {self._source(stream, ranks)}{_where(where)} ORDER BY {order}{tail}")
        return _as_reader_frame(frame, stream)

    def per_step_last(self, column: str) -> pd.DataFrame:
        """Per step where more than one rank has the list `column` (times, one per event every rank has in the same
        order): over the step's events, the rank furthest above that event's median (`rank`), by how much
        (`above_median`), at which event (`event`, from 0) and how many ranks had it."""
        values = _ident(column)
        items = (f"SELECT step, rank, unnest({values}) AS value, unnest(range(len({values}))) AS event "
                 f"FROM {self._source('steps')} WHERE {values} IS NOT NULL")
        medians = "SELECT step, event, median(value) AS median, count(*) AS ranks FROM items GROUP BY step, event HAVING count(*) > 1"
        return self._frame(f"WITH items AS ({items}), medians AS ({medians}) "
                           "SELECT step, arg_max(rank, value - median) AS rank, max(value - median) AS above_median, "
                           "arg_max(event, value - median) AS event, max(ranks) AS ranks "
                           "FROM items JOIN medians USING (step, event) GROUP BY step ORDER BY step")

    def rank_frame(self, stream: str, rank: int, columns=None) -> pd.DataFrame:
        """One rank's rows (reads only that rank's file)."""
        return self.frame(stream, columns, ranks=[rank])

    def aggregate(self, stream: str, aggregates: dict[str, Agg], *, by: str | None = None, where=()) -> pd.DataFrame:
        """One row of `aggregates` (or one per value of `by`, in order), over the rows `where` keeps."""
        if by == "rank" and any(a.holistic for a in aggregates.values()):
            return self._per_rank_batches(stream, aggregates, where)
        return self._aggregate(stream, aggregates, by, where, self.rows(stream))

    def _aggregate(self, stream, aggregates, by, where, rows, ranks=None) -> pd.DataFrame:
        order = "{" + ", ".join(f"'{k}': {_ident(k)}" for k in schema.SORT_KEYS[stream]) + "}"  # a struct sorts by its fields
        selected = [f"{_exact_or_estimate(a, rows)} AS {_ident(name)}".replace("{order}", order)
                    for name, a in aggregates.items()]
        if by:
            selected.insert(0, _ident(by))
        group = f" GROUP BY {_ident(by)} ORDER BY {_ident(by)}" if by else ""
        return self._frame(f"SELECT {', '.join(selected)} FROM {self._source(stream, ranks)}{_where(where)}{group}")

    def _per_rank_batches(self, stream, aggregates, where) -> pd.DataFrame:
        """Per-rank quantiles exactly, a batch of ranks at a time, so memory holds one batch's values."""
        self._jsonl_frames  # noqa: B018 - counts the rows of uncompacted ranks too
        ranks = sorted(self._rows[stream])
        batch_max_rows = RANK_BATCH_VALUES // sum(a.holistic for a in aggregates.values())
        batches, batch, batch_rows = [], [], 0
        for rank in ranks:
            batch_rows += self._rows[stream].get(rank, 0)
            if batch and batch_rows > batch_max_rows:
                batches.append(batch)
                batch, batch_rows = [], self._rows[stream].get(rank, 0)
            batch.append(rank)
        if batch or not batches:
            batches.append(batch)
        frames = [self._aggregate(stream, aggregates, "rank", where, self.rows(stream, b), b) for b in batches]
        return pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]

    def list_value_counts(self, stream: str, column: str, where=()) -> pd.Series:
        """How many rows hold each entry of a list column, most frequent first."""
        frame = self._frame(
            f"SELECT CAST(entry AS VARCHAR) AS entry, count(*) AS n FROM (SELECT unnest({_ident(column)}) AS entry "
            f"FROM {self._source(stream)}{_where(where)}) GROUP BY entry ORDER BY n DESC, entry"
        )
        return pd.Series(frame["n"].to_numpy(), index=frame["entry"].to_numpy(), dtype="int64")

    def step_series(self, column: str | Expr, how: str = "max", where=()) -> pd.Series:
        """One value per step across ranks (`how`: max, min, mean, sum), indexed by step."""
        functions = {"max": maximum, "min": minimum, "mean": mean, "sum": total}
        frame = self._aggregate("steps", {"value": functions[how](column)}, "step", where, 0)
        return pd.Series(frame["value"].to_numpy(dtype=float), index=frame["step"].to_numpy(), dtype=float)

    def grid(self, stream: str, values: dict[str, tuple[str | Expr, str | Expr]], *,
             max_ranks: int, max_steps: int, where=()) -> pd.DataFrame:
        """A rank x step grid, downsampled to at most max_ranks x max_steps cells.

        `values`: name -> (numerator, denominator) columns; each cell holds sum(numerator) /
        sum(denominator) over its rows (denominator None: the mean of the numerator). Columns:
        rank_first, rank_last, step_first, step_last, then the values."""
        bounds = self._frame(f'SELECT min("rank") AS r0, max("rank") AS r1, min(step) AS s0, max(step) AS s1 '
                             f"FROM {self._source(stream)}{_where(where)}").iloc[0]
        if pd.isna(bounds["r0"]):
            return pd.DataFrame(columns=["rank_first", "rank_last", "step_first", "step_last", *values])
        rank_width = max(1, -(-(int(bounds["r1"]) - int(bounds["r0"]) + 1) // max_ranks))
        step_width = max(1, -(-(int(bounds["s1"]) - int(bounds["s0"]) + 1) // max_steps))
        cells = []
        for name, (numerator, denominator) in values.items():
            if denominator is None:
                cells.append(f"avg({_value(numerator)}) AS {_ident(name)}")
            else:
                cells.append(f"sum({_value(numerator)}) / nullif(sum({_value(denominator)}), 0) AS {_ident(name)}")
        rank_bucket = f'("rank" - {int(bounds["r0"])}) // {rank_width}'
        step_bucket = f"(step - {int(bounds['s0'])}) // {step_width}"
        return self._frame(
            f'SELECT min("rank") AS rank_first, max("rank") AS rank_last, min(step) AS step_first, '
            f"max(step) AS step_last, {', '.join(cells)} FROM {self._source(stream)}{_where(where)} "
            f"GROUP BY {rank_bucket}, {step_bucket} ORDER BY rank_first, step_first"
        )


def _checked_parquet(path: Path, stream: str) -> int:
    """The rows of a rank's Parquet file, from its footer; DamagedFileError when it cannot be read or a column
    holds the wrong kind of value."""
    import pyarrow.parquet as pq

    try:
        metadata = pq.read_metadata(path)
        kinds = {field.name: arrow_kind(field.type) for field in metadata.schema.to_arrow_schema()}
        for column, kind in kinds.items():  # the writer stores a column of only nulls as float
            if kind == "number" and schema.column_kind(stream, column) not in (None, "number", "flag"):
                values = pq.read_table(path, columns=[column]).column(column)
                kinds[column] = "null" if values.null_count == len(values) else kind
    except Exception as error:  # noqa: BLE001 - any damage means the same: this file cannot be read
        raise DamagedFileError(f"{path}: unreadable ({error})") from None
    problem = column_problem(stream, kinds)
    if problem is None and stream == "steps":  # its rows too: a step's few numbers, read alone
        columns = [c for c in ("step", "rank", *schema.REQUIRED_STEP_VALUES, *schema.STEP_AMOUNTS) if c in kinds]
        table = pq.read_table(path, columns=columns)
        problem = row_problem(stream, {name: table.column(name).to_numpy(zero_copy_only=False) for name in columns})
    if problem is not None:
        raise DamagedFileError(f"{path}: {problem}")
    return metadata.num_rows


def _exact_or_estimate(aggregate: Agg, rows: int) -> str:
    return _approx(aggregate) if aggregate.holistic and rows > EXACT_QUANTILE_MAX_ROWS else aggregate.sql


def _approx(aggregate: Agg) -> str:
    return (f"reservoir_quantile({aggregate.value_sql}, {aggregate.q!r}, {ESTIMATE_SAMPLE_ROWS})"
            + _filter_clause(aggregate.condition))


def _empty_type(stream: str, column: str) -> str:
    kind = schema.column_kind(stream, column)
    return f"{SQL_TYPES[schema.LIST_COLUMNS[stream][column]]}[]" if kind == "list" else SQL_TYPES[kind]


def _projection(stream: str, types: dict[str, str]) -> list[str]:
    """Every documented column (typed null when absent), then the extras; NaN -> null, flags -> bool."""
    flags = schema.FLAG_COLUMNS.get(stream, ())
    columns = [*schema.STREAM_COLUMNS[stream], *(c for c in types if c not in schema.STREAM_COLUMNS[stream])]
    selected = []
    for column in columns:
        name, kind = _ident(column), types.get(column)
        if column in schema.LIST_COLUMNS.get(stream, {}) and not (kind or "").endswith("[]"):
            selected.append(f"NULL::{_empty_type(stream, column)} AS {name}")
        elif kind is None:
            selected.append(f"NULL::{_empty_type(stream, column)} AS {name}")
        elif column in flags and kind != "BOOLEAN":
            selected.append(f"TRY_CAST({name} AS BOOLEAN) AS {name}")
        elif kind in ("DOUBLE", "FLOAT"):
            selected.append(f"(CASE WHEN isnan({name}) THEN NULL ELSE {name} END) AS {name}")
        else:
            selected.append(name)
    return selected


def _as_reader_frame(frame: pd.DataFrame, stream: str) -> pd.DataFrame:
    """The rows as the reader gives them: `details` parsed, list columns as lists."""
    if "details" in frame:
        frame["details"] = [parse_details(d) for d in frame["details"]]
    return with_lists(frame, stream)
