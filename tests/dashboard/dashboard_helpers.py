"""Readers of what a rendered dashboard page holds (imported by the dashboard tests)."""

from __future__ import annotations

import base64
import json
import os
import re
from pathlib import Path

import numpy as np

# Beside the checkout (/work/main -> /work/shared/traces), or where GPUPROF_SHARED_TRACES says (a worktree).
SHARED_TRACES = Path(os.environ.get("GPUPROF_SHARED_TRACES") or Path(__file__).resolve().parents[2].parent / "shared" / "traces")


def figures(app) -> list[dict]:
    """Every Plotly figure on the page, as the JSON spec Streamlit sends to the browser."""
    return [json.loads(element.proto.spec) for element in app.get("plotly_chart")]


def trace_named(app, name: str) -> dict:
    matches = [trace for figure in figures(app) for trace in figure["data"] if trace.get("name") == name]
    assert matches, f"no chart trace named {name!r}"
    return matches[0]


def values(trace: dict, axis: str) -> np.ndarray:
    """A trace's x, y or z values; Plotly sends numeric arrays base64-encoded (2-D ones with their shape)."""
    data = trace[axis]
    if isinstance(data, dict) and "bdata" in data:
        flat = np.frombuffer(base64.b64decode(data["bdata"]), dtype=np.dtype(data["dtype"]))
        return flat.reshape([int(n) for n in str(data["shape"]).split(",")]) if "shape" in data else flat
    return np.asarray(data)


def texts(elements) -> list[str]:
    return [str(element.value) for element in elements]


def column_config(element) -> dict:
    """A dataframe's column settings as Streamlit sends them: column -> {"label", "help", "type_config"}."""
    return json.loads(element.proto.columns)


def empty_cells(app) -> dict[str, list[str]]:
    """Each table's columns that miss a value: Streamlit draws a missing cell as a grey None on the grid's
    canvas, which the browser's text does not hold; a page shows "n/a" there instead."""
    frames = [element.value for element in app.dataframe]
    return {f"table {i}": [str(column) for column in frame.columns[frame.isna().any().to_numpy()]]
            for i, frame in enumerate(frames) if frame.isna().any().any()}


# What a reader must never see in a page's text or table cells: Python's None (a figure a run lacks reads n/a),
# markdown's backticks, a raw column or evidence name with its unit ending (not a keyword argument), an epoch time.
UNREADABLE = re.compile(r"\bNone\b|`|\b[a-z]+(?:_[a-z0-9]+)*_(?:s|us|pct|bytes)\b(?!=)|\b1[6-9]\d{8}(?:\.\d+)?\b")


def unreadable(text: str) -> list[str]:
    return sorted(set(UNREADABLE.findall(text)))
