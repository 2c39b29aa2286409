"""`gpuprof trace PATH [--json]`: analyze any torch.profiler Chrome trace (file or per-rank directory)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gpuprof.analysis.trace.tables import TABLE_TITLES

SCHEMA = "gpuprof.trace"
SCHEMA_VERSION = 1
# The tables, in the report's order: name (in --json) -> title.
TABLES = TABLE_TITLES
NAME_WIDTH = 70
PIPED_WIDTH = 140


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "trace",
        help="analyze a torch.profiler trace (.json/.json.gz file or a directory of per-rank files)",
        description="Temporal, step, kernel, idle, overlap, launch, sync, tensor-core and cross-rank "
        "analysis of any PyTorch profiler Chrome trace. See docs/trace-analysis.md.",
    )
    parser.add_argument("path", type=Path, help="trace file, or directory with one trace file per rank")
    parser.add_argument("--json", action="store_true", help="print one JSON document (schema gpuprof.trace v1)")
    parser.add_argument("--include-last-step", action="store_true",
                        help="keep the last profiler step (left out by default, as HTA does)")
    parser.add_argument("--top", type=_positive_int, default=10,
                        help="rows in the top kernels / CPU ops tables (default 10)")
    parser.add_argument("--jobs", type=_positive_int, default=None,
                        help="ranks analysed at once, one process each (default: one per CPU core)")
    parser.add_argument("--scheduler", metavar="ADDRESS",
                        help="analyse the ranks on this Dask distributed cluster (tcp://host:8786); "
                        "its workers must see PATH (needs gpuprof[scale])")
    parser.set_defaults(func=run)


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def run(args: argparse.Namespace) -> int:
    from gpuprof.analysis.trace.ranks import analyze_ranks

    result = analyze_ranks(args.path, table_names=tuple(TABLES), jobs=args.jobs, scheduler=args.scheduler,
                           include_last_step=args.include_last_step, top=args.top)
    tables = result.tables
    notes = _notes(result, args.include_last_step)
    if args.json:
        document = to_document(result, args.path, tables, notes, args.include_last_step)
        json.dump(document, sys.stdout, sort_keys=True, indent=1, allow_nan=False)
        sys.stdout.write("\n")
    else:
        _print_report(args.path, tables, notes)
    return 0


def _notes(result, include_last_step: bool) -> list[str]:
    notes = [f"Rank file {item['file']} could not be read and is left out: {item['error']}" for item in result.unreadable]
    if result.missing_ranks:
        shown = ", ".join(map(str, result.missing_ranks[:20])) + (" ..." if len(result.missing_ranks) > 20 else "")
        notes.append(f"{len(result.missing_ranks)} rank(s) of the recorded world size have no readable trace here: {shown}")
    if not result.has_device_activity:
        notes.append("No device (GPU) activity in this trace: device analyses are empty; CPU side reported.")
    if not include_last_step:
        notes.append("The last profiler step is left out (as HTA does); --include-last-step keeps it.")
    if result.tables["overview"]["profiler_steps"].eq(0).all():
        notes.append("No ProfilerStep markers: the whole trace is one step (step -1).")
    return notes


def to_document(result, path, tables: dict, notes: list[str], include_last_step: bool) -> dict:
    from gpuprof.analysis.run.jsonable import json_safe

    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "path": str(path),
        "ranks": result.ranks,
        "missing_ranks": result.missing_ranks,
        "unreadable_files": result.unreadable,
        "has_device_activity": result.has_device_activity,
        "include_last_step": include_last_step,
        "notes": notes,
        "tables": {key: json_safe(table.to_dict("records")) for key, table in tables.items()},
    }


def short_name(name: str) -> str:
    """A kernel or op name without return type, template arguments and parameters."""
    text = str(name).removeprefix("void ").replace("(anonymous namespace)::", "")
    cut = min((i for i in (text.find("<"), text.find("(")) if i > 0), default=len(text))
    text = text[:cut]
    return text if len(text) <= NAME_WIDTH else text[: NAME_WIDTH - 1] + "…"


# Terminal views: (column, header); headers ending in "ms" show a µs column in milliseconds.
VIEWS = {
    "temporal_breakdown": [("rank", "rank"), ("kernel_time_us", "kernel time ms"), ("idle_time_pct", "idle %"),
                           ("compute_time_pct", "compute %"), ("non_compute_time_pct", "non-compute %")],
    "kernel_type_breakdown": [("rank", "rank"), ("kernel_type", "kernel type"), ("time_us", "time ms"),
                              ("time_pct", "%")],
    "top_kernels": [("rank", "rank"), ("kernel_type", "type"), ("name", "kernel"), ("count", "count"),
                    ("total_us", "total ms"), ("mean_us", "mean µs"), ("max_us", "max µs"), ("total_pct", "%")],
    "comm_comp_overlap": [("rank", "rank"), ("communication_time_us", "communication ms"),
                          ("comm_comp_overlap_pct", "overlapped by computation %")],
    "launch_summary": [("rank", "rank"), ("launches", "launches"), ("short_kernel_pct", "short kernels %"),
                       ("launch_delay_p50_us", "delay p50 µs"), ("launch_delay_p95_us", "delay p95 µs"),
                       ("long_launch_delays", "delays >100 µs"), ("cpu_launch_time_us", "launch calls ms")],
    "tensor_core_share": [("rank", "rank"), ("matmul_time_us", "matmul ms"), ("tensor_core_pct", "tensor-core %"),
                          ("top_non_tensor_core_kernel", "top kernel without tensor cores")],
    "rank_spread": [("rank", "rank"), ("steps", "steps"), ("step_time_mean_us", "mean ms"),
                    ("step_time_p50_us", "p50 ms"), ("step_time_max_us", "max ms"),
                    ("step_time_vs_median_pct", "vs median %")],
    "stragglers": [("rank", "rank"), ("work_per_step_us", "work/step ms"),
                   ("communication_per_step_us", "comm/step ms"), ("work_vs_median_pct", "work vs median %"),
                   ("communication_vs_median_pct", "comm vs median %"), ("straggler", "straggler")],
    "top_cpu_ops": [("rank", "rank"), ("name", "op"), ("count", "count"), ("total_us", "total ms"),
                    ("mean_us", "mean µs")],
}


def _cell(value, milliseconds: bool = False) -> str:
    from gpuprof.analysis.run.jsonable import json_safe

    value = json_safe(value)
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if milliseconds:
        return f"{value / 1000:,.3f}" if abs(value) < 1000 else f"{value / 1000:,.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.2f}"
    return short_name(value)


def _looks_numeric(cell: str) -> bool:
    return cell == "-" or cell.lstrip("-")[:1].isdigit()


def _rich_table(title: str, headers: list[str], rows: list[list[str]]):
    from rich.table import Table

    table = Table(title=title, title_justify="left", title_style="bold")
    for position, header in enumerate(headers):
        numeric = all(_looks_numeric(row[position]) for row in rows)
        table.add_column(header, justify="right" if numeric else "left")
    for row in rows:
        table.add_row(*row)
    return table


def _view(title: str, key: str, table):
    columns = VIEWS[key]
    rows = [[_cell(row[c], h.endswith(" ms")) for c, h in columns] for row in table.to_dict("records")]
    return _rich_table(title, [h for _, h in columns], rows)


def _steps_view(title: str, table):
    """Mean over steps, one column per rank: "ms (share of step time)"."""
    means = table.groupby("rank").mean(numeric_only=True)
    categories = [c for c in table.columns if c.endswith("_us") and c not in ("start_us", "end_us")]
    rows = []
    for column in categories:
        cells = []
        for rank in means.index:
            value, total = means.loc[rank, column], means.loc[rank, "step_time_us"]
            share = f" ({100 * value / total:.1f} %)" if column != "step_time_us" and total else ""
            cells.append(f"{value / 1000:,.2f}{share}")
        rows.append([column.removesuffix("_us").replace("_", " "), *cells])
    steps = table.groupby("rank").size()
    headers = ["mean per step, ms"] + [f"rank {r} ({steps[r]} steps)" for r in means.index]
    return _rich_table(title, headers, rows)


def _syncs_view(title: str, table):
    grouped = table.groupby(["rank", "sync_call", "cpu_op", "innermost_cpu_op"], dropna=False)["dur_us"]
    summary = grouped.agg(["count", "sum"]).reset_index().sort_values("sum", ascending=False)
    rows = [[_cell(r["rank"]), r["sync_call"], _cell(r["cpu_op"]), _cell(r["innermost_cpu_op"]), _cell(r["count"]),
             _cell(r["sum"])] for r in summary.to_dict("records")]
    return _rich_table(title, ["rank", "call", "inside op", "innermost op", "count", "total µs"], rows)


def _idle_view(title: str, table):
    wide = table.pivot_table(index=["rank", "stream"], columns="idle_category", values="idle_time_us", aggfunc="sum")
    rows = [[_cell(rank), _cell(stream), *(_cell(wide.loc[(rank, stream), c], True) for c in wide.columns)]
            for rank, stream in wide.index]
    return _rich_table(title, ["rank", "stream", *(f"{c.replace('_', ' ')} ms" for c in wide.columns)], rows)


SPECIAL_VIEWS = {"step_breakdown": _steps_view, "host_device_syncs": _syncs_view, "idle_by_stream": _idle_view}


def _print_report(path, tables: dict, notes: list[str]) -> None:
    from rich.console import Console

    # Piped or redirected output gets a width that fits the tables instead of rich's 80.
    console = Console() if sys.stdout.isatty() else Console(width=PIPED_WIDTH)
    overview = tables["overview"]
    console.print(f"[bold]gpuprof trace[/bold] {path}")
    for row in overview.to_dict("records"):
        console.print(
            f"  rank {row['rank']}: {row['events']:,} events, {row['device_events']:,} on the device, "
            f"{row['profiler_steps']} profiler steps, {row['span_us'] / 1000:,.1f} ms  ({row['file']})"
        )
    for note in notes:
        console.print(f"[yellow]{note}[/yellow]")
    for key, title in TABLES.items():
        table = tables[key]
        if key == "overview" or table.empty:
            continue
        view = SPECIAL_VIEWS.get(key)
        console.print()
        console.print(view(title, table) if view else _view(title, key, table))
