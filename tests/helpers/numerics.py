"""Float32 rounding bounds shared by the tests that compare runs which sum in other orders.

Runs that split the same data differently (ranks, shards, other CPUs' BLAS
blocking) round differently; these helpers give the entrywise bounds the
tests assert instead of bit equality.

Where the tests do assert bit equality on floats, it holds on every CPU by
construction, in one of four ways: (1) integers, booleans, hashes, copies
and store round trips; (2) the same computation twice in one process with
the same shapes, kernels and thread count (torch, MKL and OpenBLAS are
deterministic then); (3) our own kernels, whose summation order is fixed by
our code whatever the index dtype or row grouping; (4) distributed runs
whose ranks do exactly the one-process arithmetic on the same batches with
one thread, the results being only copied between ranks. Everything else
(another batch split, another thread count, a sum reduced across ranks,
another instruction set) is compared within a bound derived here or in the
test's docstring.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

U = 2.0**-24  # unit roundoff of float32


def gamma(n: int) -> float:
    """Higham's γ_n = n u / (1 - n u): relative error bound of an n-term float32 sum."""
    return n * U / (1 - n * U)


def trak_score_tolerance(
    train: Sequence[np.ndarray],
    targets: Sequence[np.ndarray],
    out_to_loss: Sequence[np.ndarray],
    xtx_a: Sequence[np.ndarray],
    xtx_b: Sequence[np.ndarray],
    lambda_reg: float,
) -> np.ndarray:
    """Entrywise bound on ``|scores_a - scores_b|`` of two TRAK runs, ``[n, m]``.

    Both runs score ``s_ij = Σ_c w_i x_ci A_c⁻¹ t_cjᵀ`` with ``A_c = XᵀX + λI``
    and ``w = mean_c(Q_c) / C`` from bit-identical features ``X``, ``T`` and
    ``Q``; only their float32 ``XᵀX`` differ (summed in other orders). In
    exact arithmetic the scores then differ by ``Σ_c w_i x_ci (B_c⁻¹ - A_c⁻¹)
    t_cjᵀ``, evaluated here in float64 from the two stored matrices (float64
    error ~1e-16 relative, negligible). On top, each run rounds: the float32
    cast of its float64 inverse (u), ``T A⁻¹`` (γ_k), ``x * w`` (u), the final
    GEMM (γ_k), the sum over C checkpoints (γ_C) and the float32 result (u):
    at most ``(2 γ_k + 3 u + γ_C) |w_i| |x_i| |A⁻¹| |t_j|ᵀ`` per run (entrywise
    absolute values; Higham, *Accuracy and Stability*, eq. 3.13 for dot
    products). These hold whatever order any BLAS sums in. The float64
    Cholesky inverse's own error (about ``k κ 2⁻⁵³`` relative) is far below u.
    """
    n_ck = len(train)
    k = train[0].shape[1]
    q = sum(np.asarray(x, dtype=np.float64).reshape(-1) for x in out_to_loss)
    w = (q / n_ck / n_ck)[:, None]  # the row weight mean_c(Q_c) / C
    n, m = train[0].shape[0], targets[0].shape[0]
    exact_gap = np.zeros((n, m))
    rounding = np.zeros((n, m))
    per_run = 2 * gamma(k) + 3 * U + gamma(n_ck)
    for x32, t32, a, b in zip(train, targets, xtx_a, xtx_b):
        x = np.asarray(x32, dtype=np.float64)
        t = np.asarray(t32, dtype=np.float64)
        a_inv = np.linalg.inv(np.asarray(a, dtype=np.float64) + lambda_reg * np.eye(k))
        b_inv = np.linalg.inv(np.asarray(b, dtype=np.float64) + lambda_reg * np.eye(k))
        exact_gap += w * (x @ (b_inv - a_inv) @ t.T)
        rounding += np.abs(w) * (np.abs(x) @ (np.abs(a_inv) + np.abs(b_inv)) @ np.abs(t).T)
    # 1e-12 relative slack for the float64 evaluation of this very bound.
    return np.abs(exact_gap) + per_run * rounding * (1 + 1e-12)
