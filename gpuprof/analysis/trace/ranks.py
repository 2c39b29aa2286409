"""Rank-parallel trace analysis: each rank's file analysed alone, in a worker; the results merged.

    result = analyze_ranks("traces/", jobs=8)                      # local processes
    result = analyze_ranks("traces/", scheduler="tcp://host:8786")  # a Dask distributed cluster
    result.tables["stragglers"], result.missing_ranks, result.unreadable

A worker holds one rank's trace in memory at a time and returns only its tables (per-rank rows,
a few kilobytes), so a job of hundreds of ranks is analysed in the memory of one rank per worker.
Every per-rank table is the one `TraceAnalysis` computes for that rank; times are moved onto the
clock of the earliest rank, as a whole-trace load does. The cross-rank tables (`rank_spread`,
`stragglers`) are computed from the merged step breakdowns. A rank file that cannot be read is
reported in `unreadable` and the others are analysed; ranks the world size promises but no file
holds are in `missing_ranks`.
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context

import pandas as pd

from gpuprof.analysis.trace import across_ranks
from gpuprof.errors import GpuprofError, TraceFormatError

# Tables computed from all ranks' step breakdowns, after the merge.
CROSS_RANK_TABLES = {
    "rank_spread": across_ranks.rank_spread,
    "stragglers": across_ranks.stragglers,
}
LIMITED_TABLES = ("top_kernels", "top_cpu_ops", "cpu_ops_by_shape", "cpu_ops_by_stack", "kernels_by_op",
                  "memory_by_op", "module_times")
# Columns holding a time on the trace's clock (not a duration): shifted onto the earliest rank's.
TIME_COLUMNS = ("start_us", "end_us", "ts_us")


@dataclass
class RankResults:
    tables: dict[str, pd.DataFrame]
    ranks: list[int]
    has_device_activity: bool
    missing_ranks: list[int] = field(default_factory=list)
    unreadable: list[dict] = field(default_factory=list)
    # What analyze_ranks' `per_rank` returned for each readable rank.
    extras: dict = field(default_factory=dict)


def default_jobs(n_files: int) -> int:
    return max(1, min(n_files, os.cpu_count() or 1))


def analyze_rank_file(file: str, position: int, n_files: int, include_last_step: bool, table_names: tuple,
                      top: int, per_rank=None) -> dict:
    """One rank's tables (the worker's task), and `per_rank(analysis)` when given (a module-level function:
    it travels to the worker by name); a file that cannot be read comes back as an error, not a raise."""
    from gpuprof.analysis.trace.analysis import TraceAnalysis

    try:
        analysis = TraceAnalysis([file], include_last_step=include_last_step,
                                 fallback_rank=position if n_files > 1 else 0)
        tables = analysis_tables(analysis, table_names, top)
    except (GpuprofError, OSError, EOFError, ValueError) as error:
        return {"file": file, "error": str(error)}
    return {
        "file": file,
        "rank": analysis.ranks[0],
        "base_ts_us": analysis.trace.base_ts_us,
        "has_device_activity": analysis.has_device_activity,
        "tables": tables,
        "extra": per_rank(analysis) if per_rank is not None else None,
    }


def analysis_tables(analysis, table_names, top: int) -> dict[str, pd.DataFrame]:
    """The named `TraceAnalysis` tables (method names); `top` rows for the top-N ones."""
    return {name: getattr(analysis, name)(top) if name in LIMITED_TABLES else getattr(analysis, name)()
            for name in table_names}


def analyze_ranks(path, *, table_names: tuple, jobs: int | None = None, scheduler: str | None = None,
                  include_last_step: bool = False, top: int = 10, per_rank=None) -> RankResults:
    """Every rank's tables, analysed `jobs` files at a time (or on the Dask cluster at `scheduler`), merged;
    `per_rank(analysis)`, run beside them on each rank's analysis, lands in `RankResults.extras`."""
    from gpuprof.analysis.trace.loader import trace_files

    files = [str(file) for file in trace_files(path)]
    per_rank_tables = [name for name in table_names if name not in CROSS_RANK_TABLES]
    if "step_breakdown" not in per_rank_tables:
        per_rank_tables.append("step_breakdown")
    tasks = [(file, position, len(files), include_last_step, tuple(per_rank_tables), top, per_rank)
             for position, file in enumerate(files)]
    if scheduler:
        results = _on_dask(scheduler, tasks)
    else:
        results = _on_processes(tasks, jobs or default_jobs(len(files)))
    return _merge(results, table_names)


def _on_processes(tasks: list[tuple], jobs: int) -> list[dict]:
    if jobs <= 1 or len(tasks) <= 1:
        return [analyze_rank_file(*task) for task in tasks]
    # forkserver, not fork: a forked child of a threaded parent (BLAS, Arrow pools) can deadlock;
    # the server imports the analyzer once, so each worker starts without paying for the imports.
    context = get_context("forkserver")
    context.set_forkserver_preload(["gpuprof.analysis.trace.analysis"])
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        return list(pool.map(analyze_rank_file, *zip(*tasks)))


def _on_dask(scheduler: str, tasks: list[tuple]) -> list[dict]:
    try:
        from distributed import Client
    except ImportError:
        raise GpuprofError("--scheduler needs Dask: pip install 'gpuprof[scale]'") from None
    try:
        client = Client(scheduler, timeout="20s")
    except (OSError, TimeoutError, ValueError) as error:
        raise GpuprofError(f"cannot reach the Dask scheduler at {scheduler} ({error})") from None
    with client:
        futures = client.map(analyze_rank_file, *zip(*tasks), pure=False)
        return client.gather(futures)


def _merge(results: list[dict], table_names: tuple) -> RankResults:
    readable = [r for r in results if "error" not in r]
    unreadable = [{"file": r["file"], "error": r["error"]} for r in results if "error" in r]
    if not readable:
        raise TraceFormatError(unreadable[0]["error"] if unreadable else "no trace files given")
    _check_unique_ranks(readable)
    base_ts_us = min(r["base_ts_us"] for r in readable)
    readable.sort(key=lambda r: r["rank"])
    tables = {}
    for name in table_names:
        if name in CROSS_RANK_TABLES:
            continue
        frames = [_shifted(r["tables"][name], r["base_ts_us"] - base_ts_us) for r in readable]
        frames = [frame for frame in frames if not frame.empty]
        tables[name] = pd.concat(frames, ignore_index=True) if frames else readable[0]["tables"][name]
    steps = pd.concat([r["tables"]["step_breakdown"] for r in readable], ignore_index=True)
    for name, compute in CROSS_RANK_TABLES.items():
        if name in table_names:
            tables[name] = compute(steps)
    ranks = [r["rank"] for r in readable]
    return RankResults(
        tables={name: tables[name] for name in table_names},
        ranks=ranks,
        has_device_activity=any(r["has_device_activity"] for r in readable),
        missing_ranks=_missing(ranks, tables.get("overview")),
        unreadable=unreadable,
        extras={r["rank"]: r["extra"] for r in readable},
    )


def _check_unique_ranks(readable: list[dict]) -> None:
    seen: dict[int, str] = {}
    for result in readable:
        if result["rank"] in seen:
            raise TraceFormatError(
                f"two trace files for rank {result['rank']} ({seen[result['rank']]}, {result['file']}): "
                "pass one file, or a directory with one file per rank"
            )
        seen[result["rank"]] = result["file"]


def _shifted(table: pd.DataFrame, offset_us: int) -> pd.DataFrame:
    columns = [c for c in TIME_COLUMNS if c in table.columns]
    if not offset_us or not columns or table.empty:
        return table
    return table.assign(**{c: table[c] + offset_us for c in columns})


def _missing(ranks: list[int], overview: pd.DataFrame | None) -> list[int]:
    """Ranks below the world size the traces recorded that no readable file holds."""
    world = pd.to_numeric(overview["world_size"], errors="coerce").max() if overview is not None else None
    if world is None or pd.isna(world):
        return []
    present = set(ranks)
    return [rank for rank in range(int(world)) if rank not in present]
