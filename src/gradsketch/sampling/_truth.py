"""Closed-form learning coefficients: the ground truth the LLC estimator is calibrated on.

Three families of models whose real log canonical threshold (RLCT, the
learning coefficient ``lambda``) is known exactly:

* the normal crossing ``K(w) = prod_i w_i^(2 k_i)`` at ``w = 0``:
  ``lambda = 1 / (2 max_i k_i)``;
* reduced-rank regression ``x -> B A x`` (Aoyagi & Watanabe 2005);
* deep linear networks ``x -> W_L ... W_1 x`` (Aoyagi 2024), which contain
  reduced-rank regression as the one-hidden-layer case.

Each is an exact integer/rational computation (returned as a float), so the
tests can compare the functions to hand-derived values with ``==``.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "deep_linear_learning_coefficient",
    "normal_crossing_learning_coefficient",
    "reduced_rank_learning_coefficient",
]


def _check_int(name: str, value: object, *, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        kind = "non-negative" if low == 0 else "positive"
        raise ValueError(f"`{name}` must be a {kind} int, got {value!r}.")
    return value


def normal_crossing_learning_coefficient(powers: Sequence[int]) -> float:
    """``lambda = 1 / (2 max_i k_i)`` of ``K(w) = prod_i w_i^(2 k_i)`` at ``w = 0``.

    Watanabe, "Algebraic Geometry and Statistical Learning Theory" (2009),
    Section 2.4: the RLCT of a monomial is ``min_i (h_i + 1) / (2 k_i)`` for a
    prior ``prod w_i^h_i``; a prior positive at 0 has ``h_i = 0``.

    Args:
        powers: ``k_i >= 1``, one per coordinate.

    Returns:
        lambda.

    Example:
        >>> normal_crossing_learning_coefficient([1, 2])
        0.25
    """
    if isinstance(powers, (str, bytes)) or len(powers) == 0:
        raise ValueError(f"`powers` must be a non-empty sequence of positive ints, got {powers!r}.")
    for i, k in enumerate(powers):
        _check_int(f"powers[{i}]", k, low=1)
    return 1.0 / (2 * max(powers))


def reduced_rank_learning_coefficient(M: int, H: int, N: int, r: int = 0) -> float:
    """Aoyagi & Watanabe (2005), Theorem 1: ``lambda`` of ``x -> B A x`` at a rank-``r`` truth.

    ``A`` is ``[H, M]``, ``B`` is ``[N, H]``; ``K(A, B) = |B A - B0 A0|_F^2 / 2``
    with ``rank(B0 A0) = r <= H``.

    * ``M + H < N + r``: ``(H M - H r + N r) / 2``;
    * ``N + H < M + r``: ``(H N - H r + M r) / 2``;
    * ``M + N < H + r``: ``M N / 2``;
    * otherwise ``(2 (H + r)(M + N) - (M - N)^2 - (H + r)^2 + [M + H + N + r odd]) / 8``.

    Aoyagi & Watanabe, "Stochastic complexities of reduced rank regression in
    Bayesian estimation", Neural Networks 18 (2005) 924-933.

    Args:
        M: Input dimension.
        H: The learner's rank (hidden width).
        N: Output dimension.
        r: Rank of the true map, ``0 <= r <= min(M, H, N)``.

    Returns:
        lambda.

    Example:
        >>> reduced_rank_learning_coefficient(5, 3, 5)
        6.5
    """
    for name, value in (("M", M), ("H", H), ("N", N)):
        _check_int(name, value, low=1)
    _check_int("r", r, low=0)
    if r > min(M, H, N):
        raise ValueError(
            f"`r` must be at most min(M, H, N) = {min(M, H, N)} (the rank of B A), got {r}."
        )
    if M + H < N + r:
        return (H * M - H * r + N * r) / 2
    if N + H < M + r:
        return (H * N - H * r + M * r) / 2
    if M + N < H + r:
        return M * N / 2
    odd = (M + H + N + r) % 2
    return (2 * (H + r) * (M + N) - (M - N) ** 2 - (H + r) ** 2 + odd) / 8


def _aoyagi_subset(m: list[int]) -> list[int]:
    """The values ``M_j`` of Aoyagi's set ``Sigma`` (2024, Theorem 1).

    ``Sigma`` has ``l + 1 >= 2`` elements, each smaller than every value left
    out, with ``sum(Sigma) >= l max(Sigma)`` and ``sum(Sigma) < l min(rest)``.
    The first condition makes ``Sigma`` a set of smallest values, so only the
    prefixes of the sorted list are candidates; Aoyagi shows one qualifies
    (the whole list does when no shorter prefix does).
    """
    values = sorted(m)
    for size in range(2, len(values) + 1):
        sigma, rest = values[:size], values[size:]
        ell, total = size - 1, sum(sigma)
        if rest and not sigma[-1] < rest[0]:
            continue
        if total < ell * sigma[-1]:
            continue
        if rest and not total < ell * rest[0]:
            continue
        return sigma
    # Unreachable by Aoyagi's Lemma: the whole list satisfies sum >= l max when no prefix does.
    raise AssertionError(f"no admissible subset for {m}")  # pragma: no cover


def deep_linear_learning_coefficient(widths: Sequence[int], rank: int = 0) -> float:
    """Aoyagi (2024), Theorem 1: ``lambda`` of a deep linear network at a rank-``r`` truth.

    The network is ``x -> W_L ... W_1 x`` with ``W_j`` ``[H_(j+1), H_j]``,
    ``widths = [H_1, ..., H_(L+1)]`` (input first, output last), and
    ``K(W) = |W_L ... W_1 - W*|_F^2 / 2`` for a true product of rank ``r``.
    With ``M_j = H_j - r``, let ``Sigma`` be the ``l + 1`` smallest ``M_j``
    satisfying ``max Sigma < min(rest)``, ``sum Sigma >= l max Sigma`` and
    ``sum Sigma < l min(rest)``; with ``S = sum Sigma``, ``m = ceil(S / l)``
    and ``a = S - (m - 1) l`` (``1 <= a <= l``)::

        lambda = (r (H_1 + H_(L+1)) - r^2) / 2 + a (l - a) / (4 l)
                 - l (l - 1) / 4 * (S / l)^2 + (1 / 2) sum_{i<j in Sigma} M_i M_j

    One hidden layer gives Aoyagi & Watanabe's reduced-rank regression
    (:func:`reduced_rank_learning_coefficient`); all widths 1 give the normal
    crossing ``(w_1 ... w_L)^2`` with ``lambda = 1/2``. Used by Furman & Lau,
    "Estimating the local learning coefficient at scale" (2024), to check the
    LLC estimator up to 100M parameters.

    Aoyagi, "Consideration on the learning efficiency of multiple-layered
    neural networks with linear units", Neural Networks 172 (2024) 106132.

    Args:
        widths: ``[input, hidden..., output]``, at least two positive ints
            (two widths: one linear layer, a regular model, ``lambda = H_1 H_2 / 2``).
        rank: Rank ``r`` of the true product, at most ``min(widths)``.

    Returns:
        lambda.

    Example:
        >>> deep_linear_learning_coefficient([5, 3, 5])  # = reduced-rank regression (5, 3, 5)
        6.5
        >>> deep_linear_learning_coefficient([1, 1, 1, 1])  # (w1 w2 w3)^2: a normal crossing
        0.5
    """
    if isinstance(widths, (str, bytes)) or len(widths) < 2:
        raise ValueError(
            f"`widths` must list at least two layer widths [input, ..., output], got {widths!r}."
        )
    for i, h in enumerate(widths):
        _check_int(f"widths[{i}]", h, low=1)
    _check_int("rank", rank, low=0)
    if rank > min(widths):
        raise ValueError(
            f"`rank` must be at most min(widths) = {min(widths)} (the largest rank the network "
            f"can represent), got {rank}."
        )
    m = [h - rank for h in widths]
    sigma = _aoyagi_subset(m)
    ell, total = len(sigma) - 1, sum(sigma)
    ceil = -(-total // ell)
    a = total - (ceil - 1) * ell
    pairs = sum(sigma[i] * sigma[j] for i in range(len(sigma)) for j in range(i + 1, len(sigma)))
    # Exact arithmetic in quarters: every term is a multiple of 1/(4 l).
    value = (
        2 * ell * (rank * (widths[0] + widths[-1]) - rank**2)
        + a * (ell - a)
        - (ell - 1) * total**2
        + 2 * ell * pairs
    )
    return value / (4 * ell)
