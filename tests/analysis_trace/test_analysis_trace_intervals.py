"""Interval arithmetic: hand-computed cases and properties against a brute-force unit grid."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuprof.analysis import intervals

GRID = 40
interval_sets = st.lists(
    st.tuples(st.integers(0, GRID), st.integers(0, GRID)).map(lambda t: (min(t), max(t))), max_size=12
).map(lambda rows: np.array(rows, dtype=np.int64).reshape(-1, 2))


def covered(intervals_array) -> np.ndarray:
    """Brute force: which unit cells [t, t+1) of the grid the set covers."""
    cells = np.zeros(GRID, dtype=bool)
    for start, end in intervals_array:
        cells[start:end] = True
    return cells


def test_merge_joins_overlapping_and_touching_and_drops_empty():
    merged = intervals.merge([[5, 8], [0, 2], [1, 3], [3, 4], [10, 10], [7, 9]])
    assert merged.tolist() == [[0, 4], [5, 9]]


def test_set_operations_on_a_hand_computed_case():
    a = [[0, 10], [20, 30]]
    b = [[5, 25]]
    assert intervals.intersect(a, b).tolist() == [[5, 10], [20, 25]]
    assert intervals.subtract(a, b).tolist() == [[0, 5], [25, 30]]
    assert intervals.union(a, b).tolist() == [[0, 30]]
    assert intervals.total_length(a) == 20


def test_membership_segments_label_each_piece_by_the_sets_covering_it():
    segments, masks = intervals.membership_segments([[[0, 10]], [[5, 15]], [[12, 20]]])
    assert segments.tolist() == [[0, 5], [5, 10], [10, 12], [12, 15], [15, 20]]
    assert masks.tolist() == [0b001, 0b011, 0b010, 0b110, 0b100]


def test_overlap_per_window_counts_partial_intervals():
    lengths = intervals.overlap_per_window([[0, 10], [20, 30]], [[5, 25], [0, 100], [40, 50], [8, 9]])
    assert lengths.tolist() == [10, 20, 0, 1]


def test_float_intervals_and_empty_inputs():
    assert intervals.total_length(np.array([[0.5, 1.25], [1.0, 2.0]])) == pytest.approx(1.5)
    assert intervals.merge(np.empty((0, 2))).shape == (0, 2)
    assert intervals.intersect([], [[0, 1]]).shape == (0, 2)
    assert intervals.overlap_per_window([], [[0, 5]]).tolist() == [0]


def test_bad_shape_is_rejected():
    with pytest.raises(ValueError):
        intervals.merge([[1, 2, 3]])


@settings(max_examples=200, deadline=None)
@given(interval_sets, interval_sets)
def test_operations_match_brute_force(a, b):
    ca, cb = covered(a), covered(b)
    assert np.array_equal(covered(intervals.merge(a)), ca)
    assert np.array_equal(covered(intervals.union(a, b)), ca | cb)
    assert np.array_equal(covered(intervals.intersect(a, b)), ca & cb)
    assert np.array_equal(covered(intervals.subtract(a, b)), ca & ~cb)
    assert intervals.total_length(a) == ca.sum()


@settings(max_examples=200, deadline=None)
@given(interval_sets)
def test_merged_sets_are_sorted_disjoint_and_non_touching(a):
    merged = intervals.merge(a)
    assert np.all(merged[:, 1] > merged[:, 0])
    assert np.all(merged[1:, 0] > merged[:-1, 1])


@settings(max_examples=200, deadline=None)
@given(interval_sets, interval_sets)
def test_overlap_per_window_matches_brute_force(a, windows):
    cells = covered(a)
    expected = [cells[start:end].sum() for start, end in windows]
    assert intervals.overlap_per_window(a, windows).tolist() == expected
