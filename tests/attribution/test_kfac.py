"""K-FAC / EK-FAC curvature of one layer against explicit float64 matrices."""

from __future__ import annotations

import pytest
import torch

from gradsketch.attribution._kfac import (
    KroneckerFactors,
    add_bias_input,
    eigh_float64,
    ekfac_eigenvalues,
    influence,
    resolve_damping,
)

D_IN, D_OUT, N, T = 4, 3, 6, 5


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(N, T, D_IN, generator=g, dtype=torch.float64)
    grad = torch.randn(N, T, D_OUT, generator=g, dtype=torch.float64)
    return a, grad


def _per_example_grads(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``vec(G_n)`` with ``G_n = sum_t g_t a_tᵀ``, by an explicit loop: ``[N, d_out * d_in]``."""
    rows = []
    for n in range(a.shape[0]):
        gn = torch.zeros(g.shape[-1], a.shape[-1], dtype=torch.float64)
        for t in range(a.shape[1]):
            gn += torch.outer(g[n, t], a[n, t])
        rows.append(gn.reshape(-1))
    return torch.stack(rows)


def _fitted(a: torch.Tensor, g: torch.Tensor) -> KroneckerFactors:
    f = KroneckerFactors.zeros(a.shape[-1], g.shape[-1])
    f.update(a[:2], g[:2])  # two batches: the sums stream
    f.update(a[2:], g[2:])
    return f


def test_factors_equal_hand_computed_sums():
    a, g = _batch()
    a_cov, g_cov = _fitted(a, g).covariances()
    a_ref = sum(torch.outer(a[n, t], a[n, t]) for n in range(N) for t in range(T)) / (N * T)
    g_ref = sum(torch.outer(g[n, t], g[n, t]) for n in range(N) for t in range(T)) / N
    torch.testing.assert_close(a_cov, a_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_cov, g_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rank", [40, 9], ids=["full-rank", "rank-deficient"])
def test_eigh_float64_decomposes_the_factor_as_torch_does(rank):
    """SciPy's ``syevd`` against ``torch.linalg.eigh``, both float64, on a ``[40, 40]`` factor.

    Both are backward stable: ``‖A − Q diag(α) Qᵀ‖ ≤ p(d) u ‖A‖`` and
    ``‖QᵀQ − I‖ ≤ p(d) u`` with ``u = 2⁻⁵³ ≈ 1.1e-16``; at d = 40, ``p(d) u`` stays
    below 1e-13 (tolerances relative to ``‖A‖``). Eigenvalues are equal to the
    same bound (Weyl); the rank-deficient factor (9 tokens) has 31 zero
    eigenvalues, where eigenvectors are any basis of the null space, so only
    the reconstruction and the projector onto the range are compared there.
    """
    g = torch.Generator().manual_seed(3)
    x = torch.randn(rank, 40, generator=g, dtype=torch.float64) + 0.5
    factor = x.T @ x / rank
    values, vectors = eigh_float64(factor)
    assert values.dtype == vectors.dtype == torch.float64
    scale = float(torch.linalg.matrix_norm(factor, 2))
    want_values, want_vectors = torch.linalg.eigh(factor)
    torch.testing.assert_close(values, want_values, rtol=0, atol=1e-13 * scale)
    rebuilt = vectors @ torch.diag(values) @ vectors.T
    torch.testing.assert_close(rebuilt, factor, rtol=0, atol=1e-13 * scale)
    torch.testing.assert_close(
        vectors.T @ vectors, torch.eye(40, dtype=torch.float64), rtol=0, atol=1e-13
    )
    top = slice(40 - rank, 40)  # the range: eigenvalues well away from 0
    torch.testing.assert_close(
        vectors[:, top] @ vectors[:, top].T,
        want_vectors[:, top] @ want_vectors[:, top].T,
        rtol=0,
        atol=1e-11,
    )


def test_rotate_is_the_gradient_in_the_kronecker_eigenbasis():
    a, g = _batch()
    eig = _fitted(a, g).eigen()
    grads = _per_example_grads(a, g).reshape(N, D_OUT, D_IN)
    ref = torch.stack([eig.q_s.T @ gn @ eig.q_a for gn in grads]).reshape(N, -1)
    torch.testing.assert_close(eig.rotate(a, g), ref, rtol=1e-10, atol=1e-12)


def test_rotate_rows_of_stored_gradients_and_back():
    a, g = _batch()
    eig = _fitted(a, g).eigen()
    rows = _per_example_grads(a, g).reshape(N, -1)
    rotated = eig.rotate_rows(rows)
    torch.testing.assert_close(rotated, eig.rotate(a, g), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(eig.unrotate_rows(rotated), rows, rtol=1e-10, atol=1e-12)


def test_precondition_is_the_damped_inverse_of_the_kronecker_curvature():
    a, g = _batch()
    eig = _fitted(a, g).eigen()
    rows = _per_example_grads(a, g).reshape(N, -1)
    values = eig.kfac_eigenvalues()
    dense = torch.kron(eig.q_s, eig.q_a) @ torch.diag(values) @ torch.kron(eig.q_s, eig.q_a).T
    want = torch.linalg.solve(dense + 0.3 * torch.eye(dense.shape[0], dtype=dense.dtype), rows.T)
    torch.testing.assert_close(eig.precondition(rows, values, 0.3), want.T, rtol=1e-8, atol=1e-10)


def test_rank_one_squares_sum_the_rotated_rank_one_gradients():
    a, g = _batch()
    a1, g1 = a[:, :1], g[:, :1]  # one position per example: G_n = g_n a_nᵀ
    eig = _fitted(a, g).eigen()
    ref = (eig.rotate(a1, g1) ** 2).sum(0)
    torch.testing.assert_close(
        eig.rank_one_squares(a1[:, 0], g1[:, 0]), ref, rtol=1e-10, atol=1e-12
    )


def test_ekfac_eigenvalues_are_the_fisher_diagonal_in_the_eigenbasis():
    a, g = _batch()
    eig = _fitted(a, g).eigen()
    v = _per_example_grads(a, g)
    fisher = v.T @ v / N
    q = torch.kron(eig.q_s, eig.q_a)  # row-major vec: vec(Q_Sᵀ G Q_A) = (Q_S ⊗ Q_A)ᵀ vec(G)
    ref = torch.diagonal(q.T @ fisher @ q)
    torch.testing.assert_close(ekfac_eigenvalues(eig.rotate(a, g)), ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_influence_equals_explicit_inverse(method):
    """``g_qᵀ (F̂ + λI)⁻¹ g_t`` with ``F̂`` formed as a dense float64 matrix and solved."""
    a, g = _batch()
    aq, gq = _batch(seed=1)
    f = _fitted(a, g)
    eig = f.eigen()
    train, query = eig.rotate(a, g), eig.rotate(aq, gq)
    q = torch.kron(eig.q_s, eig.q_a)
    if method == "kfac":
        a_cov, g_cov = f.covariances()
        curvature = torch.kron(g_cov, a_cov)
        lam_vec = eig.kfac_eigenvalues()
    else:
        lam_vec = ekfac_eigenvalues(train)
        curvature = q @ torch.diag(lam_vec) @ q.T
    damping = 0.3
    dense = curvature + damping * torch.eye(D_IN * D_OUT, dtype=torch.float64)
    ref = _per_example_grads(a, g) @ torch.linalg.solve(dense, _per_example_grads(aq, gq).T)
    got = influence(train, query, lam_vec, damping=damping)
    torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-12)


def test_kfac_is_exact_for_one_example_of_a_softmax_layer():
    """One input ``x`` of a Linear + softmax cross-entropy layer: the true Fisher
    ``sum_y p_y vec(∇_W CE_y) vec(∇_W CE_y)ᵀ`` is exactly ``(diag(p) - p pᵀ) ⊗ x xᵀ``,
    so K-FAC's inverse (factors from the layer input and the label-weighted output
    gradients) equals the exact damped inverse. The Fisher is built with autograd,
    not with the Kronecker formula."""
    torch.manual_seed(0)
    w = torch.randn(D_OUT, D_IN, dtype=torch.float64)
    x = torch.randn(D_IN, dtype=torch.float64)
    p = torch.softmax(w @ x, 0)
    grads, outs = [], []
    for y in range(D_OUT):
        wp = w.clone().requires_grad_(True)
        loss = torch.nn.functional.cross_entropy((wp @ x)[None], torch.tensor([y]))
        (gw,) = torch.autograd.grad(loss, wp)
        grads.append(gw.reshape(-1))
        outs.append(p - torch.nn.functional.one_hot(torch.tensor(y), D_OUT).double())
    fisher = sum(p[y] * torch.outer(grads[y], grads[y]) for y in range(D_OUT))
    # Factors: A from the one input; S from the label-weighted output gradients
    # (each label a "token" of weight sqrt(p_y), so S = sum_y p_y g_y g_yᵀ).
    f = KroneckerFactors.zeros(D_IN, D_OUT)
    f.update(x.reshape(1, 1, -1), torch.zeros(1, 1, D_OUT, dtype=torch.float64))
    f.g_sum = sum(p[y] * torch.outer(outs[y], outs[y]) for y in range(D_OUT))
    a_cov, g_cov = f.covariances()
    torch.testing.assert_close(torch.kron(g_cov, a_cov), fisher, rtol=1e-10, atol=1e-12)
    eig = f.eigen()
    v = torch.randn(2, D_OUT, D_IN, dtype=torch.float64)
    rot = torch.stack([eig.q_s.T @ m @ eig.q_a for m in v]).reshape(2, -1)
    damping = 0.05
    dense = fisher + damping * torch.eye(D_IN * D_OUT, dtype=torch.float64)
    ref = v.reshape(2, -1) @ torch.linalg.solve(dense, v.reshape(2, -1).T)
    got = influence(rot, rot, eig.kfac_eigenvalues(), damping=damping)
    torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-12)


def test_bias_is_an_input_fixed_at_one():
    a, g = _batch()
    ab = add_bias_input(a)
    v = _per_example_grads(ab, g).reshape(N, D_OUT, D_IN + 1)
    torch.testing.assert_close(v[..., -1], g.sum(1))  # the bias gradient, sum_t g_t
    torch.testing.assert_close(v[..., :-1], _per_example_grads(a, g).reshape(N, D_OUT, D_IN))


def test_auto_damping_is_three_tenths_of_the_mean_eigenvalue():
    lam = torch.tensor([1.0, 2.0, 3.0, 6.0])
    assert resolve_damping("auto", lam) == pytest.approx(0.9)
    assert resolve_damping(0.5, lam) == 0.5


@pytest.mark.parametrize(
    ("damping", "match"),
    [("big", "`damping` must be a number >= 0 or 'auto', got 'big'"), (-1.0, "got -1.0")],
    ids=["unknown-string", "negative"],
)
def test_bad_damping_is_refused(damping, match):
    with pytest.raises(ValueError, match=match):
        resolve_damping(damping, torch.ones(3))


def test_shape_errors_name_the_argument():
    f = KroneckerFactors.zeros(D_IN, D_OUT)
    with pytest.raises(ValueError, match=r"`a` must be \[batch, tokens, 4\]"):
        f.update(torch.zeros(2, D_IN), torch.zeros(2, D_OUT))
    with pytest.raises(ValueError, match="`a` and `g` must share"):
        f.update(torch.zeros(2, 3, D_IN), torch.zeros(2, 4, D_OUT))
    with pytest.raises(ValueError, match="no batch was added"):
        f.covariances()
