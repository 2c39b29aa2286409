"""Downsampling for display: long timelines become a few thousand points before Plotly sees them.

A browser draws 2,000 points per line as fast as 20; it chokes on 100,000. Lines go through
LTTB (Largest-Triangle-Three-Buckets, Steinarsson 2013), which keeps spikes and dips that a
plain stride or mean would hide. Stacked areas and heatmaps are averaged per bucket instead,
because their series must share one x axis.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

MAX_POINTS = 2000


def lttb_indices(x: np.ndarray, y: np.ndarray, n_out: int) -> np.ndarray:
    """Indices of the `n_out` points of (x, y) that LTTB keeps; all of them when there are fewer."""
    n = len(x)
    if n <= n_out or n_out < 3:
        return np.arange(n)
    # Buckets 1..n_out-2 split the points between the first and the last, which are always kept.
    edges = np.append(np.linspace(1, n - 1, n_out - 1).astype(np.int64), n)
    counts = np.diff(edges)
    mean_x = np.add.reduceat(x, edges[:-1]) / counts
    mean_y = np.add.reduceat(y, edges[:-1]) / counts
    kept = np.empty(n_out, dtype=np.int64)
    kept[0], kept[-1] = 0, n - 1
    anchor = 0
    for bucket in range(n_out - 2):
        start, stop = edges[bucket], edges[bucket + 1]
        # The triangle's third corner: the next bucket's mean point (the last point for the last bucket).
        next_x, next_y = mean_x[bucket + 1], mean_y[bucket + 1]
        anchor_x, anchor_y = x[anchor], y[anchor]
        area = np.abs((anchor_x - next_x) * (y[start:stop] - anchor_y) - (anchor_x - x[start:stop]) * (next_y - anchor_y))
        anchor = start + int(area.argmax())
        kept[bucket + 1] = anchor
    return kept


def lttb(frame: pd.DataFrame, x: str, y: str, n_out: int = MAX_POINTS) -> pd.DataFrame:
    """The rows of `frame` that LTTB keeps for the line y(x); rows where either is missing are dropped."""
    finite = frame[[x, y]].dropna()
    finite = finite[np.isfinite(finite[y].to_numpy(dtype=float))]
    indices = lttb_indices(
        finite[x].to_numpy(dtype=float), finite[y].to_numpy(dtype=float), n_out
    )
    return finite.iloc[indices]


def bucket_mean(frame: pd.DataFrame, x: str, columns: list[str], n_out: int = MAX_POINTS) -> pd.DataFrame:
    """`frame` averaged over consecutive buckets so that at most `n_out` rows remain (x is the bucket mean)."""
    if len(frame) <= n_out:
        return frame[[x, *columns]]
    bucket = np.arange(len(frame)) // int(np.ceil(len(frame) / n_out))
    return frame[[x, *columns]].groupby(bucket).mean()
