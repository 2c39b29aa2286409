"""Tables for interactive grids (the dashboard's): numbers kept sortable, in the unit their readable
header names, and text "n/a" where a column misses a value. The trace tables' views are
`trace_views.frame_view`; `units_view` reads any frame whose column names end in their unit."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from gpuprof.report.format import MISSING, figure, known

# Column-name endings and what a reader sees: (ending, header ending, unit, scale). Rates first: "_per_s" is no duration.
UNIT_ENDINGS = (("_per_s", "/s", "", 1), ("_s", " ms", "ms", 1e3), ("_us", " ms", "ms", 1e-3),
                ("_pct", " %", "%", 1), ("_bytes", "", "bytes", 1))
FRACTIONS = {"mfu": "MFU %"}


@dataclass(frozen=True)
class FrameView:
    """`frame`: the figures in the unit of each column's label; `units`: column -> "ms", "µs", "%",
    "bytes" (shown as text) or ""."""

    title: str
    frame: pd.DataFrame
    labels: dict[str, str]
    units: dict[str, str]


def shown_values(values: pd.Series, unit: str, text=str) -> pd.Series:
    """Bytes as binary-prefixed text; a column with a missing value as text with "n/a" there."""
    if unit == "bytes":
        return values.map(lambda value: figure(value, "bytes"))
    if values.map(known).all():
        return values
    return values.map(lambda value: text(value) if known(value) else MISSING)


def units_view(frame: pd.DataFrame, title: str = "") -> FrameView:
    """`frame` with readable headers ("step_time_p50_s" -> "step time p50 ms"), seconds and µs in ms."""
    shown, labels, units = pd.DataFrame(index=frame.index), {}, {}
    for column in frame.columns:
        ending, header_end, unit, scale = next(
            (item for item in UNIT_ENDINGS if column.endswith(item[0])), ("", "", "", 1))
        values, label = frame[column], FRACTIONS.get(column)
        if label:
            values, unit = values * 100, "%"
        name = column.removesuffix(ending) + ("_ms" if unit == "ms" else ending)
        values = values * scale if scale != 1 else values
        shown[name] = shown_values(values, unit, lambda value: figure(value))
        labels[name] = label or column.removesuffix(ending).replace("_", " ") + header_end
        units[name] = unit
    return FrameView(title, shown.reset_index(drop=True), labels, units)
