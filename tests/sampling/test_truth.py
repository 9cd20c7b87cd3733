"""Closed-form learning coefficients (gradsketch.sampling._truth) against hand-derived values."""

from __future__ import annotations

import itertools

import pytest

from gradsketch.sampling import (
    deep_linear_learning_coefficient,
    normal_crossing_learning_coefficient,
    reduced_rank_learning_coefficient,
)


@pytest.mark.parametrize(
    ("powers", "lam"), [([1], 0.5), ([1, 1], 0.5), ([1, 2], 0.25), ([3, 1, 2], 1 / 6)]
)
def test_normal_crossing(powers, lam):
    assert normal_crossing_learning_coefficient(powers) == lam


# (M, H, N, r) -> lambda, worked by hand from Aoyagi & Watanabe's four cases.
RRR_CASES = [
    ((5, 3, 5, 0), 6.5),  # case 4, M+H+N+r odd: (2*3*10 - 0 - 9 + 1) / 8
    ((5, 4, 5, 0), 8.0),  # case 4, even: (2*4*10 - 0 - 16) / 8
    ((4, 3, 8, 0), 6.0),  # case 1 (M+H < N+r): H M / 2
    ((8, 3, 4, 0), 6.0),  # case 2 (N+H < M+r): H N / 2
    ((2, 5, 3, 0), 3.0),  # case 3 (M+N < H+r): M N / 2
    ((4, 2, 4, 2), 6.0),  # true rank = H: regular, H (M+N-H) / 2
]


@pytest.mark.parametrize(("mhnr", "lam"), RRR_CASES, ids=[str(c) for c, _ in RRR_CASES])
def test_reduced_rank_hand_cases(mhnr, lam):
    assert reduced_rank_learning_coefficient(*mhnr) == lam


def test_deep_linear_with_one_hidden_layer_is_reduced_rank_regression():
    """Aoyagi (2024) contains Aoyagi & Watanabe (2005): every (M, H, N, r) up to 7."""
    for m, h, n in itertools.product(range(1, 8), repeat=3):
        for r in range(min(m, h, n) + 1):
            assert deep_linear_learning_coefficient([m, h, n], r) == (
                reduced_rank_learning_coefficient(m, h, n, r)
            ), (m, h, n, r)


# widths, rank -> lambda, each derived without Aoyagi's formula (reason in the id).
DLN_CASES = [
    ([3, 4], 0, 6.0, "one-layer: regular, H1 H2 / 2"),
    ([4, 7], 2, 14.0, "one-layer at any truth: still H1 H2 / 2"),
    ([1, 1, 1], 0, 0.5, "(w1 w2)^2: normal crossing, 1 / 2"),
    ([1, 1, 1, 1, 1, 1], 0, 0.5, "(w1...w5)^2: normal crossing, 1 / 2"),
    ([3, 6, 5, 4], 3, 6.0, "full-rank 4x3 truth, submersion: 4 * 3 / 2"),
    ([4, 7, 7, 7, 4], 4, 8.0, "full-rank 4x4 truth, submersion: 16 / 2"),
    ([6, 4, 2, 4, 5], 2, 9.0, "rank-2 truth at the bottleneck: manifold dim 2 (6 + 5 - 2), / 2"),
    ([5, 5, 5], 5, 12.5, "invertible 5x5 truth: 25 / 2"),
]


@pytest.mark.parametrize(
    ("widths", "rank", "lam"),
    [c[:3] for c in DLN_CASES],
    ids=[c[3] for c in DLN_CASES],
)
def test_deep_linear_hand_cases(widths, rank, lam):
    assert deep_linear_learning_coefficient(widths, rank) == lam


def test_deep_linear_is_symmetric_in_reversal_and_bounded_by_half_the_dimension():
    """Transposing the network (x -> W^T ... ) keeps lambda; lambda <= d / 2 always."""
    for widths in ([2, 3, 4, 5], [7, 2, 9, 3, 4], [10, 10, 10, 10], [3, 8, 8, 8, 8, 2]):
        dim = sum(a * b for a, b in itertools.pairwise(widths))
        for r in range(min(widths) + 1):
            lam = deep_linear_learning_coefficient(widths, r)
            assert lam == deep_linear_learning_coefficient(widths[::-1], r)
            assert 0 < lam <= dim / 2


def test_deep_linear_increases_with_true_rank():
    widths = [8, 6, 7, 5, 9]
    values = [deep_linear_learning_coefficient(widths, r) for r in range(min(widths) + 1)]
    assert values == sorted(values) and len(set(values)) == len(values)


ERRORS = [
    (normal_crossing_learning_coefficient, ([],), "`powers` must be a non-empty"),
    (normal_crossing_learning_coefficient, ([1, 0],), r"`powers\[1\]` must be a positive int"),
    (reduced_rank_learning_coefficient, (0, 3, 5), "`M` must be a positive int, got 0"),
    (reduced_rank_learning_coefficient, (5, 3, 5, 4), r"`r` must be at most min\(M, H, N\) = 3"),
    (reduced_rank_learning_coefficient, (5, 3, 5, -1), "`r` must be a non-negative int"),
    (deep_linear_learning_coefficient, ([5],), "`widths` must list at least two"),
    (deep_linear_learning_coefficient, ([5, 2.0, 5],), r"`widths\[1\]` must be a positive int"),
    (deep_linear_learning_coefficient, ([5, 3, 5], 4), r"`rank` must be at most min\(widths\) = 3"),
    (deep_linear_learning_coefficient, ([5, 3, 5], True), "`rank` must be a non-negative int"),
]


@pytest.mark.parametrize(("fn", "args", "match"), ERRORS, ids=[e[2][:30] for e in ERRORS])
def test_errors(fn, args, match):
    with pytest.raises(ValueError, match=match):
        fn(*args)
