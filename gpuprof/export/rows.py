"""What every export takes from a run: one rank's rows of a stream, and the columns of a stream that hold measures."""

from __future__ import annotations

import pandas as pd

from gpuprof.run import schema

# Columns that say where a row belongs rather than what was measured.
KEY_COLUMNS = {"step", "rank", "time_unix_s", "device_index"}


def numeric_columns(stream: str) -> list[str]:
    """The measured columns of `stream` a tracker can plot: its numbers and flags."""
    return [column for column in schema.STREAM_COLUMNS[stream]
            if column not in KEY_COLUMNS and schema.column_kind(stream, column) in ("number", "flag")]


def of_rank(frame: pd.DataFrame, rank: int) -> pd.DataFrame:
    return frame[frame["rank"] == rank] if "rank" in frame and not frame.empty else frame
