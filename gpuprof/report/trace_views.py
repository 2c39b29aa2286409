"""The trace analyzer's tables as people read them: one `TableView` (title, headers, text rows) per
table, for `gpuprof trace` and the dashboard. Only text comes out: presenters lay it out.

Times are microseconds in the tables; headers ending in "ms" show them in milliseconds."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from gpuprof.analysis.trace.tables import LAST_STEP_LEFT_OUT, TABLE_TITLES, VIEW_NEEDS, missing_note, missing_views
from gpuprof.report.format import MISSING, figure, fmt, table_number
from gpuprof.report.frames import FrameView, shown_values
from gpuprof.run.jsonable import json_safe

# The trace tables' titles and what each view needs come from the analyzer; presenters read them here.
__all__ = [
    "TABLE_TITLES", "VIEW_NEEDS", "missing_note", "missing_views", "TableView", "short_name", "cell",
    "plain_view", "diff_view", "steps_view", "syncs_view", "idle_view", "table_views", "overview_lines",
    "label_unit", "frame_view", "empty_tables_note", "empty_table_note", "steps_notes", "steps_note",
    "NAME_WIDTH", "VERBATIM_WIDTH", "VERBATIM_COLUMNS", "NOT_A_TEXT_TABLE", "OP_FIGURES", "KERNEL_FIELDS",
    "COLUMNS", "DEVICE_TABLES", "DIFF_TITLE", "SPECIAL_VIEWS", "NO_STEP_MARKERS",
]

NAME_WIDTH = 70
VERBATIM_WIDTH = 120
VERBATIM_COLUMNS = ("input_dims", "stack")
NOT_A_TEXT_TABLE = ("overview", "memory_timeline")


@dataclass(frozen=True)
class TableView:
    title: str
    headers: list[str]
    rows: list[list[str]]

    @property
    def numeric(self) -> list[bool]:
        """Per column: whether every cell is a number (presenters right-align those)."""
        return [all(_looks_numeric(row[position]) for row in self.rows) for position in range(len(self.headers))]


def short_name(name: str) -> str:
    """A kernel or op name without return type, template arguments and parameters."""
    text = str(name).removeprefix("void ").replace("(anonymous namespace)::", "")
    cut = min((i for i in (text.find("<"), text.find("(")) if i > 0), default=len(text))
    text = text[:cut]
    return text if len(text) <= NAME_WIDTH else text[: NAME_WIDTH - 1] + "…"


OP_FIGURES = [("count", "count"), ("total_us", "total ms"), ("self_us", "self ms"),
              ("device_total_us", "device total ms"), ("device_self_us", "device self ms")]
KERNEL_FIELDS = [("tensor_cores", "tensor cores"), ("blocks_per_sm", "blocks per SM"),
                 ("est_achieved_occupancy_pct", "est. achieved occupancy %")]
# Plain views: (column, header).
COLUMNS = {
    "overview": [("rank", "rank"), ("world_size", "world size"), ("file", "file"), ("events", "events"),
                 ("device_events", "device events"), ("has_device_activity", "device activity"),
                 ("profiler_steps", "profiler steps"), ("span_us", "span ms")],
    "temporal_breakdown": [("rank", "rank"), ("kernel_time_us", "kernel time ms"), ("idle_time_pct", "idle %"),
                           ("compute_time_pct", "compute %"), ("non_compute_time_pct", "non-compute %")],
    "kernel_type_breakdown": [("rank", "rank"), ("kernel_type", "kernel type"), ("time_us", "time ms"),
                              ("time_pct", "%")],
    "top_kernels": [("rank", "rank"), ("kernel_type", "type"), ("name", "kernel"), ("count", "count"),
                    ("total_us", "total ms"), ("mean_us", "mean µs"), ("max_us", "max µs"), ("total_pct", "%"),
                    *KERNEL_FIELDS],
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
    "top_cpu_ops": [("rank", "rank"), ("name", "op"), *OP_FIGURES],
    "cpu_ops_by_shape": [("rank", "rank"), ("name", "op"), ("input_dims", "input shapes"), *OP_FIGURES],
    "cpu_ops_by_stack": [("rank", "rank"), ("name", "op"), ("stack", "call stack (innermost first)"), *OP_FIGURES],
    "kernels_by_op": [("rank", "rank"), ("op", "op"), ("name", "kernel"), ("count", "count"),
                      ("total_us", "total ms"), ("mean_us", "mean µs"), *KERNEL_FIELDS],
    "memory_summary": [("rank", "rank"), ("device", "device"), ("allocations", "allocations"),
                       ("allocated_bytes", "allocated in all"), ("peak_allocated_bytes", "peak allocated"),
                       ("peak_at_us", "peak at ms"), ("peak_reserved_bytes", "peak reserved"),
                       ("end_allocated_bytes", "allocated at the end")],
    "memory_by_op": [("rank", "rank"), ("device", "device"), ("op", "op"), ("allocations", "allocations"),
                     ("allocated_bytes", "allocated"), ("frees", "frees"), ("freed_bytes", "freed"),
                     ("net_bytes", "net")],
    "module_times": [("rank", "rank"), ("module", "module"), ("calls", "calls"), ("total_us", "total ms"),
                     ("self_us", "self ms"), ("device_total_us", "device total ms"),
                     ("device_self_us", "device self ms")],
    "diff": [("kind", "kind"), ("name", "name"), ("count_a", "count A"), ("count_b", "count B"),
             ("count_diff", "count B−A"), ("total_us_a", "A ms"), ("total_us_b", "B ms"),
             ("total_us_diff", "B−A ms")],
}
# The tables only device (GPU) work fills, named as a reader of a CPU-only trace is told they are empty.
DEVICE_TABLES = {"kernel_type_breakdown": "kernel type", "top_kernels": "top kernel",
                 "temporal_breakdown": "temporal (idle/compute)", "idle_by_stream": "idle",
                 "comm_comp_overlap": "overlap", "launch_summary": "launch", "host_device_syncs": "sync",
                 "tensor_core_share": "tensor-core", "stragglers": "straggler", "kernels_by_op": "kernels-by-op"}
DIFF_TITLE = "Trace B against trace A, by kernel and op (largest change in time first)"


def cell(value, milliseconds: bool = False, *, as_bytes: bool = False, verbatim: bool = False) -> str:
    """`verbatim`: text shown as it is (but its length), not shortened as a kernel or op name."""
    value = json_safe(value)
    if value is None:
        return MISSING
    if isinstance(value, bool):
        return "yes" if value else "no"
    if as_bytes:
        return figure(value, "bytes")
    if verbatim:
        return value if len(value) <= VERBATIM_WIDTH else value[: VERBATIM_WIDTH - 1] + "…"
    if isinstance(value, (int, float)):
        return table_number(value, milliseconds)
    return short_name(value)


def _looks_numeric(text: str) -> bool:
    return text == MISSING or text.lstrip("-")[:1].isdigit()


def plain_view(key: str, table, title: str | None = None) -> TableView:
    columns = COLUMNS[key]
    rows = [[cell(row[c], h.endswith(" ms"), as_bytes=c.endswith("_bytes"), verbatim=c in VERBATIM_COLUMNS)
             for c, h in columns] for row in table.to_dict("records")]
    return TableView(title or TABLE_TITLES[key], [h for _, h in columns], rows)


def diff_view(table, top: int) -> TableView:
    """The `top` rows of a trace diff (gpuprof.analysis.trace.diff)."""
    return plain_view("diff", table.head(top), DIFF_TITLE)


def steps_view(table) -> TableView:
    """Mean over steps, one column per rank: "ms (share of step time)"."""
    means = table.groupby("rank").mean(numeric_only=True)
    categories = [c for c in table.columns if c.endswith("_us") and c not in ("start_us", "end_us")]
    rows = []
    for column in categories:
        cells = []
        for rank in means.index:
            value, total = means.loc[rank, column], means.loc[rank, "step_time_us"]
            share = f" ({fmt(100 * value / total, '{:.1f} %')})" if column != "step_time_us" and total else ""
            cells.append(fmt(value / 1000, "{:,.2f}") + share)
        rows.append([column.removesuffix("_us").replace("_", " "), *cells])
    steps = table.groupby("rank").size()
    headers = ["mean per step, ms"] + [f"rank {r} ({steps[r]} steps)" for r in means.index]
    return TableView(TABLE_TITLES["step_breakdown"], headers, rows)


def syncs_view(table) -> TableView:
    grouped = table.groupby(["rank", "sync_call", "cpu_op", "innermost_cpu_op"], dropna=False)["dur_us"]
    summary = grouped.agg(["count", "sum"]).reset_index().sort_values("sum", ascending=False)
    rows = [[cell(r["rank"]), str(r["sync_call"]), cell(r["cpu_op"]), cell(r["innermost_cpu_op"]), cell(r["count"]),
             cell(r["sum"])] for r in summary.to_dict("records")]
    return TableView(TABLE_TITLES["host_device_syncs"], ["rank", "call", "inside op", "innermost op", "count",
                                                         "total µs"], rows)


def idle_view(table) -> TableView:
    wide = table.pivot_table(index=["rank", "stream"], columns="idle_category", values="idle_time_us", aggfunc="sum")
    rows = [[cell(rank), cell(stream), *(cell(wide.loc[(rank, stream), c], True) for c in wide.columns)]
            for rank, stream in wide.index]
    return TableView(TABLE_TITLES["idle_by_stream"],
                     ["rank", "stream", *(f"{c.replace('_', ' ')} ms" for c in wide.columns)], rows)


SPECIAL_VIEWS = {"step_breakdown": steps_view, "host_device_syncs": syncs_view, "idle_by_stream": idle_view}


def table_views(tables: dict) -> list[TableView]:
    """Every non-empty table but the overview and the memory timeline (a chart's points), in report order."""
    views = []
    for key in TABLE_TITLES:
        table = tables.get(key)
        if key in NOT_A_TEXT_TABLE or table is None or table.empty:
            continue
        views.append(SPECIAL_VIEWS[key](table) if key in SPECIAL_VIEWS else plain_view(key, table))
    return views


def overview_lines(tables: dict) -> list[str]:
    """One line per rank: events, device events, profiler steps, span and file."""
    return [f"rank {row['rank']}: {row['events']:,} events, {row['device_events']:,} on the device, "
            f"{row['profiler_steps']} profiler steps, {row['span_us'] / 1000:,.1f} ms  ({row['file']})"
            for row in tables["overview"].to_dict("records")]


def label_unit(header: str) -> str:
    return next((unit for unit in ("ms", "µs", "%") if header.endswith(f" {unit}")), "")


def frame_view(key: str, table: pd.DataFrame) -> FrameView:
    """The table `key` with the columns and headers of its text view (COLUMNS), for the dashboard."""
    if key in SPECIAL_VIEWS:
        view = SPECIAL_VIEWS[key](table)
        return FrameView(view.title, pd.DataFrame(view.rows, columns=view.headers),
                         {h: h for h in view.headers}, {h: "" for h in view.headers})
    frame, labels, units = pd.DataFrame(index=table.index), {}, {}
    for column, header in COLUMNS[key]:
        unit = "bytes" if column.endswith("_bytes") else label_unit(header)
        values = table[column] / 1000 if unit == "ms" and column.endswith("_us") else table[column]
        name = column.removesuffix("_us") + "_ms" if unit == "ms" and column.endswith("_us") else column
        if column == "file":
            values = values.map(lambda path: Path(path).name)
        frame[name], labels[name], units[name] = shown_values(values, unit, cell), header, unit
    return FrameView(TABLE_TITLES[key], frame.reset_index(drop=True), labels, units)


def empty_tables_note(tables: dict, has_device_activity: bool) -> str:
    """One line naming the text tables with no rows (not those a missing profiler option explains)."""
    optional = {name for names, _, _ in VIEW_NEEDS.values() for name in names}
    empty = [key for key in TABLE_TITLES if key not in NOT_A_TEXT_TABLE and key not in optional
             and key in tables and tables[key].empty]
    if not empty:
        return ""
    device = [DEVICE_TABLES[key] for key in empty if key in DEVICE_TABLES]
    others = [TABLE_TITLES[key] for key in empty if key not in DEVICE_TABLES]
    lines = []
    if device and not has_device_activity:
        lines.append(f"This trace has no device activity (a CPU-only run): no GPU kernels, so the {', '.join(device)} "
                     "tables are empty; the CPU side is below")
    elif device:
        lines.append(f"Empty in this trace: the {', '.join(device)} tables")
    if others:
        lines.append(f"no rows in: {', '.join(others)}")
    return "; ".join(lines) + "."


def empty_table_note(key: str, has_device_activity: bool) -> str:
    """Why one table has no rows."""
    if key in DEVICE_TABLES and not has_device_activity:
        return (f"{TABLE_TITLES[key]}: empty, as the trace has no device activity (a CPU-only run): it is measured "
                "on the GPU's kernels and streams.")
    return f"{TABLE_TITLES[key]}: no rows in this trace."


NO_STEP_MARKERS = ("No ProfilerStep markers (torch.profiler.profile() without a schedule): the whole trace is "
                   "analysed as one step")


def steps_notes(profiler_steps: pd.Series, include_last_step: bool) -> list[str]:
    """What the analysis window covers, from each rank's profiler steps: a trace without markers is one step, whole;
    otherwise the last step is left out unless `include_last_step`."""
    if profiler_steps.eq(0).all():
        return [f"{NO_STEP_MARKERS}."]
    return [] if include_last_step else [f"{LAST_STEP_LEFT_OUT}; --include-last-step keeps it."]


def steps_note(overview: pd.DataFrame) -> str:
    """Why a window of N steps shows N-1 (the analyzer's default window), with the steps each rank keeps."""
    if overview["profiler_steps"].eq(0).all():
        return f"{NO_STEP_MARKERS}."
    kept = ", ".join(f"rank {rank}: {steps}" for rank, steps in zip(overview["rank"], overview["profiler_steps"]))
    return f"{LAST_STEP_LEFT_OUT}, unless the trace has only one; profiler steps analysed: {kept}."
