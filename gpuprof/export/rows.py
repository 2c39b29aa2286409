"""What every export takes from a run: one rank's rows of a stream (the columns are `schema.measured_columns`)."""

from __future__ import annotations

import pandas as pd


def of_rank(frame: pd.DataFrame, rank: int) -> pd.DataFrame:
    return frame[frame["rank"] == rank] if "rank" in frame and not frame.empty else frame
