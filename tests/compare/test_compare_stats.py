"""The statistic every comparison rests on (gpuprof.analysis.run.stats), on synthetic step times
whose true mean ratio is known: autocorrelated like real steps (AR(1)), so a bootstrap that
ignored the autocorrelation would be caught covering too little."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuprof.analysis.run import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import compare_coverage  # noqa: E402 - benchmarks/ is not a package; its AR(1) runs are these tests' too


def ar1(rng, n: int, phi: float, mean: float, cv: float) -> np.ndarray:
    """n steps of mean `mean` whose noise (sd `cv` * mean) has lag-one autocorrelation `phi`."""
    return compare_coverage.ar1(rng, n, phi, mean, cv * mean)


REPLICATES = 50


@settings(max_examples=6, deadline=None, derandomize=True)
@given(phi=st.floats(0.0, 0.5), n=st.integers(100, 300), true_speedup=st.floats(0.5, 2.0),
       cv=st.floats(0.02, 0.2), seed=st.integers(0, 2**16))
def test_speedup_interval_covers_the_true_ratio(phi, n, true_speedup, cv, seed):
    rng = np.random.default_rng(seed)
    mean_a_s = 0.1
    hits = 0
    for replicate in range(REPLICATES):
        a = ar1(rng, n, phi, mean_a_s, cv)
        b = ar1(rng, n, phi, mean_a_s / true_speedup, cv)
        interval = stats.speedup_interval(a, b, seed=replicate)
        assert interval.low <= interval.point <= interval.high
        assert interval.point == pytest.approx(a.mean() / b.mean())
        hits += interval.contains(true_speedup)
    # nominal 95 %; the percentile bootstrap of 100-300 autocorrelated steps reaches 89-96 % (docs/compare.md)
    assert hits / REPLICATES >= 0.8


def test_autocorrelated_steps_get_longer_blocks_and_wider_intervals():
    rng = np.random.default_rng(7)
    independent = ar1(rng, 400, 0.0, 0.1, 0.1)
    correlated = ar1(rng, 400, 0.8, 0.1, 0.1)
    assert stats.block_length(independent) <= 2
    assert stats.block_length(correlated) >= 6
    # a bootstrap of single steps would give both the same width; blocks see the correlation
    assert stats.mean_interval(correlated).half_width > 2 * stats.mean_interval(independent).half_width


@settings(max_examples=10, deadline=None, derandomize=True)
@given(scale=st.floats(1e-3, 1e3), seed=st.integers(0, 2**16))
def test_speedup_does_not_depend_on_the_unit(scale, seed):
    rng = np.random.default_rng(seed)
    a, b = ar1(rng, 120, 0.3, 0.1, 0.1), ar1(rng, 120, 0.3, 0.12, 0.1)
    plain, scaled = stats.speedup_interval(a, b), stats.speedup_interval(a * scale, b * scale)
    assert (scaled.point, scaled.low, scaled.high) == pytest.approx((plain.point, plain.low, plain.high))


@settings(max_examples=6, deadline=None, derandomize=True)
@given(phi=st.floats(0.0, 0.6), cv=st.floats(0.05, 0.3), target=st.sampled_from([0.01, 0.02, 0.05]),
       seed=st.integers(0, 2**16))
def test_steps_needed_gives_the_asked_half_width(phi, cv, target, seed):
    rng = np.random.default_rng(seed)
    pilot = ar1(rng, 200, phi, 0.1, cv)
    needed = stats.steps_needed(pilot, target)
    longer = ar1(rng, needed, phi, 0.1, cv)
    interval = stats.mean_interval(longer)
    if needed > 10:  # below that the run is already precise enough and the figure is the floor
        assert target / 2 < interval.half_width / interval.point < 2 * target


def test_too_few_steps_is_bad_input():
    with pytest.raises(stats.TooFewStepsError, match="too few"):
        stats.speedup_interval([0.1, 0.1], [0.1, 0.1, 0.1])


def test_identical_steps_give_a_point_interval():
    interval = stats.speedup_interval([0.1] * 20, [0.05] * 20)
    assert (interval.low, interval.point, interval.high) == pytest.approx((2.0, 2.0, 2.0))


@settings(max_examples=8, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), noise=st.floats(0.0, 0.05))
def test_loss_curves_within_their_noise_do_not_diverge(seed, noise):
    rng = np.random.default_rng(seed)
    steps = np.arange(200)
    curve = 5.5 * np.exp(-steps / 80) + 2.0
    a = curve + rng.normal(0, noise, 200)
    b = curve + rng.normal(0, noise, 200)
    assert not stats.loss_diverges(a, b)
    assert not stats.loss_diverges(a, a)
    assert stats.loss_shift_interval(a, a).point == 0


@settings(max_examples=8, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), shift=st.floats(0.03, 0.5))
def test_a_loss_curve_that_goes_up_diverges(seed, shift):
    rng = np.random.default_rng(seed)
    steps = np.arange(200)
    a = 5.5 * np.exp(-steps / 80) + 2.0 + rng.normal(0, 0.03, 200)
    b = a * np.where(steps > 120, 1 + shift, 1.0) + rng.normal(0, 0.03, 200)
    assert stats.loss_diverges(a, b)
    assert not stats.loss_diverges(b, a)  # B learning better is no regression
