"""LTTB and bucket averaging: what a long timeline keeps when it is drawn with a few thousand points."""

from __future__ import annotations

import numpy as np
import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuprof.dashboard.downsample import bucket_mean, lttb, lttb_indices


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 3000), n_out=st.integers(3, 500), seed=st.integers(0, 2**16))
def test_lttb_keeps_ends_in_order_and_at_most_n_out(n, n_out, seed):
    rng = np.random.default_rng(seed)
    x = np.cumsum(rng.uniform(0.1, 2.0, n))
    y = rng.normal(size=n)
    kept = lttb_indices(x, y, n_out)
    assert len(kept) == min(n, n_out)
    assert np.all(np.diff(kept) > 0)
    if n:
        assert kept[0] == 0 and kept[-1] == n - 1


def test_lttb_keeps_a_single_spike_that_a_stride_would_miss():
    y = np.zeros(100_000)
    y[54_321] = 50.0
    x = np.arange(len(y), dtype=float)
    kept = lttb_indices(x, y, 1000)
    assert 54_321 in kept
    assert 54_321 not in np.arange(0, len(y), len(y) // 1000)


def test_lttb_frame_drops_missing_and_non_finite_points():
    frame = pd.DataFrame({"step": range(6), "loss": [1.0, np.nan, 2.0, np.inf, 3.0, None]})
    kept = lttb(frame, "step", "loss", 100)
    assert kept["step"].tolist() == [0, 2, 4]


def test_bucket_mean_averages_consecutive_rows_and_keeps_short_frames():
    frame = pd.DataFrame({"step": np.arange(1000), "a": np.arange(1000) * 2.0})
    averaged = bucket_mean(frame, "step", ["a"], 10)
    assert len(averaged) == 10
    np.testing.assert_allclose(averaged["step"], np.arange(49.5, 1000, 100))
    np.testing.assert_allclose(averaged["a"], averaged["step"] * 2)
    assert bucket_mean(frame.head(5), "step", ["a"], 10).equals(frame.head(5))
