"""K-FAC / EK-FAC with factors of rank below their width, against full float64 ``eigh``.

A factor summed from ``r < d`` token rows has rank ``<= r``;
:func:`eigh_low_rank` decomposes its range only and the basis keeps ``r``
columns. Everything a score depends on must equal the full decomposition's:
the reference is :func:`eigh_float64` on the same factor, with explicit
``[d_out d_in, d_out d_in]`` float64 matrices where a test says so.

Tolerances: both decompositions are backward stable in float64
(``u = 2⁻⁵³ ≈ 1.1e-16``), residuals ``<= p(d) u ‖A‖`` with ``p(d)`` a small
multiple of ``d`` (here ``d <= 40``: under 1e-13 relative to ``‖A‖``).
Eigenvectors of distinct eigenvalues differ by angles ``<= p(d) u ‖A‖ / gap``;
the random factors below have relative gaps above 1e-4 (checked in
:func:`_factor`), so vectors, and the scores built from them, agree to about
``1e-13 / 1e-4 = 1e-9`` relative: the tests use ``rtol = 1e-8``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradsketch.attribution import InfluenceComputer, _kfac
from gradsketch.attribution._kfac import (
    KroneckerEigenbasis,
    KroneckerFactors,
    eigh_float64,
    eigh_low_rank,
    ekfac_eigenvalues,
    influence,
)

RTOL = 1e-8
D_IN, D_OUT, N, T = 40, 30, 4, 3  # 12 token rows: both factors have rank <= 12


def _factor(d: int, r: int, spread: float, seed: int = 0) -> torch.Tensor:
    """``XᵀX`` of ``r`` rows of width ``d`` with column scales over ``spread`` decades."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(r, d, generator=g, dtype=torch.float64)
    x = x * torch.logspace(-spread, 0, d, dtype=torch.float64)
    a = x.T @ x
    w = torch.linalg.eigvalsh(a)[-r:]
    assert float((w[1:] - w[:-1]).min() / w[-1]) > 1e-9  # distinct eigenvalues
    return a


@pytest.mark.parametrize(
    ("d", "r", "spread"),
    [(40, 9, 0.0), (40, 9, 2.0), (40, 30, 1.0), (25, 25, 0.5)],
    ids=["flat", "four-decades", "small-block", "full-rank"],
)
def test_eigh_low_rank_is_eigh_on_the_range(d, r, spread):
    """Eigenpairs of the range equal ``eigh_float64``'s; nothing of ``A`` is left out.

    ``four-decades``: eigenvalues spread over 4 decades puts columns below
    ``1e-6 w_max`` through the re-orthogonalised block of :func:`eigh_low_rank`.
    """
    a = _factor(d, r, spread)
    w, u = eigh_low_rank(a)
    w_ref, u_ref = eigh_float64(a)
    scale = float(w_ref[-1])
    assert u.shape == (d, min(r, d))
    eye = torch.eye(u.shape[1], dtype=torch.float64)
    torch.testing.assert_close(u.T @ u, eye, rtol=0, atol=1e-12)
    torch.testing.assert_close(u @ torch.diag(w) @ u.T, a, rtol=0, atol=1e-13 * scale)
    torch.testing.assert_close(w, w_ref[-len(w) :], rtol=0, atol=1e-13 * scale)
    # Same vectors up to sign: |cos| = 1 within the angle bound of the module docstring.
    cos = (u * u_ref[:, -len(w) :]).sum(0).abs()
    big = w > 1e-6 * scale
    torch.testing.assert_close(cos[big], torch.ones_like(cos[big]), rtol=0, atol=RTOL)


def test_eigh_low_rank_of_zero_is_the_full_basis():
    """No range: a full orthonormal basis with eigenvalues 0 (no empty ``[d, 0]`` basis)."""
    w, u = eigh_low_rank(torch.zeros(6, 6, dtype=torch.float64))
    assert torch.equal(w, torch.zeros(6, dtype=torch.float64))
    torch.testing.assert_close(u.T @ u, torch.eye(6, dtype=torch.float64), rtol=0, atol=1e-15)


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(N, T, D_IN, generator=g, dtype=torch.float64)
    a = a * torch.logspace(-1, 0, D_IN, dtype=torch.float64)
    return a, torch.randn(N, T, D_OUT, generator=g, dtype=torch.float64)


def _fitted(monkeypatch: pytest.MonkeyPatch, low: bool) -> KroneckerFactors:
    monkeypatch.setattr(_kfac, "LOW_RANK_MIN_WIDTH", 1 if low else 10**9)
    a, g = _batch()
    f = KroneckerFactors.zeros(D_IN, D_OUT)
    f.update(a, g)
    return f


def test_factors_of_few_tokens_keep_their_range(monkeypatch):
    eig = _fitted(monkeypatch, low=True).eigen()
    assert eig.q_a.shape == (D_IN, N * T) and eig.q_s.shape == (D_OUT, N * T)
    assert eig.reduced and eig.size == D_IN * D_OUT
    kept = _fitted(monkeypatch, low=True).eigen(low_rank_s=False)
    assert kept.q_s.shape == (D_OUT, D_OUT) and kept.q_a.shape == (D_IN, N * T)
    assert not _fitted(monkeypatch, low=False).eigen().reduced


def test_wide_factors_of_few_tokens_sum_float64_products(monkeypatch):
    """float32 batches: products in float64 while a factor may still be low rank, then not.

    A (40 wide) may be low rank up to 0.75 * 40 = 30 token rows, S (30 wide) up
    to 22.5: after the first batch (12 rows) both are exact, after the second
    (24) only A, after the third (36) neither.
    """
    monkeypatch.setattr(_kfac, "LOW_RANK_MIN_WIDTH", 1)
    a, g = _batch()
    f = KroneckerFactors.zeros(D_IN, D_OUT)
    f.update(a.float(), g.float())
    assert (f.a_exact, f.g_exact) == (True, True)
    # The sums are those of float64 products of the float32 inputs, to float64 rounding.
    af = a.float().double().reshape(-1, D_IN)
    torch.testing.assert_close(f.a_sum, af.T @ af, rtol=1e-14, atol=0)
    f.update(a.float(), g.float())
    assert (f.a_exact, f.g_exact) == (True, False)
    assert f.eigen().q_a.shape[1] < D_IN and f.eigen().q_s.shape == (D_OUT, D_OUT)
    f.update(a.float(), g.float())
    assert (f.a_exact, f.g_exact) == (False, False)
    assert not f.eigen().reduced


def test_exact_flags_survive_the_preconditioner_state(monkeypatch):
    """Featurize and finalize may be separate runs: the state keeps the flags."""
    from gradsketch.attribution._preconditioners import KFACPreconditioner, PreconditionerSpec

    f = _fitted(monkeypatch, low=True)
    spec = PreconditionerSpec(feature_dim=D_IN * D_OUT, damping=0.1, device=torch.device("cpu"))
    pre = KFACPreconditioner(spec)
    pre.factors = [f]
    state = pre.state_dict()
    spec.layers = [object()]  # one layer, as the factors  # type: ignore[list-item]
    back = KFACPreconditioner(spec)
    back.load_state_dict(state)
    assert (back.factors[0].a_exact, back.factors[0].g_exact) == (True, True)
    del state["exact"]  # a store written before the flags: full decompositions
    back.load_state_dict(state)
    assert (back.factors[0].a_exact, back.factors[0].g_exact) == (False, False)


def _explicit(basis: KroneckerEigenbasis, values: torch.Tensor, lam: float) -> torch.Tensor:
    """``(P diag(values) Pᵀ + λI)⁻¹`` as a ``[d_out d_in, d_out d_in]`` float64 matrix."""
    p = torch.kron(basis.q_s, basis.q_a)
    h = p @ torch.diag(values) @ p.T
    return torch.linalg.inv(h + lam * torch.eye(h.shape[0], dtype=torch.float64))


@pytest.mark.parametrize("damping", [0.05, "auto"])
@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_reduced_solve_and_scores_equal_the_full_basis(monkeypatch, method, damping):
    """Solves of any vector and scores against training rows equal the full basis's.

    The full basis's solve is checked against the explicit float64 inverse of
    its own curvature (so both are tied to ``(F + λI)⁻¹``); EK-FAC's
    eigenvalues outside the range are 0 up to rounding (``<= 1e-20`` of the
    largest: squares of ``u``-sized components), so its curvature is the
    reduced one's.
    """
    a, g = _batch()
    bases = []
    for low in (True, False):
        eig = _fitted(monkeypatch, low).eigen()
        values = ekfac_eigenvalues(eig.rotate(a, g)) if method == "ekfac" else eig.eigenvalues
        bases.append(KroneckerEigenbasis(eig.q_a, eig.q_s, values))
    reduced, full = bases
    assert reduced.reduced and not full.reduced
    assert reduced.damping(damping) == pytest.approx(full.damping(damping), rel=RTOL)
    lam = full.damping(damping)
    gen = torch.Generator().manual_seed(5)
    queries = torch.randn(3, D_OUT * D_IN, generator=gen, dtype=torch.float64)
    got = reduced.solve(queries, damping)
    want = full.solve(queries, damping)
    explicit = queries @ _explicit(full, full.eigenvalues, lam)
    scale = float(explicit.abs().max())
    torch.testing.assert_close(want, explicit, rtol=0, atol=RTOL * scale)
    torch.testing.assert_close(got, explicit, rtol=0, atol=RTOL * scale)
    # Scores of training rows (in the range): rotated rows and solve_rotated.
    train_full = torch.stack([(g[n].T @ a[n]).reshape(-1) for n in range(N)])
    scores = influence(
        reduced.rotate(a, g), reduced.rotate_rows(queries), reduced.eigenvalues, damping=lam
    )
    ref = train_full @ explicit.T
    torch.testing.assert_close(scores, ref, rtol=0, atol=RTOL * float(ref.abs().max()))


def test_reduced_solve_with_zero_damping_is_the_pseudo_inverse(monkeypatch):
    """λ = 0: ``P diag(1/Λ) Pᵀ``, the Moore-Penrose inverse of the K-FAC curvature."""
    eig = _fitted(monkeypatch, low=True).eigen()
    gen = torch.Generator().manual_seed(6)
    queries = torch.randn(2, D_OUT * D_IN, generator=gen, dtype=torch.float64)
    p = torch.kron(eig.q_s, eig.q_a)
    h = p @ torch.diag(eig.eigenvalues) @ p.T
    ref = queries @ torch.linalg.pinv(h, hermitian=True, rtol=1e-10)
    got = eig.solve(queries, 0.0)
    # pinv's cutoff drops the same (none: every kept K-FAC eigenvalue is above
    # 1e-10 of the largest here) directions; its error is κ u relative.
    assert float(eig.eigenvalues.min() / eig.eigenvalues.max()) > 1e-8
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6 * float(ref.abs().max()))


transformers = pytest.importorskip("transformers")
from helpers.hf_families import tiny_gpt2  # noqa: E402

LM_N, LM_M, LM_T, VOCAB = 6, 2, 5, 11  # 30 token rows; c_fc's S is 32 wide, mlp.c_proj's A 33


def _lm_scores(tmp_path, monkeypatch, low, method, damping, curvature):
    monkeypatch.setattr(_kfac, "LOW_RANK_MIN_WIDTH", 1 if low else 10**9)
    monkeypatch.setattr(_kfac, "LOW_RANK_SHARE", 1.0)
    model = tiny_gpt2(VOCAB, LM_T)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (LM_N + LM_M, LM_T), generator=gen)
    ic = InfluenceComputer(
        model,
        "language_modeling",
        LM_N,
        tmp_path / f"low{int(low)}",
        method=method,
        damping=damping,
        curvature=curvature,
        dtype=torch.float64,
        progress=False,
    )
    state = model.state_dict()
    ic.load_checkpoint(state, model_id=0)
    train = ids[:LM_N]
    ic.featurize((train, torch.ones_like(train), train), num_samples=LM_N)
    ic.finalize_features()
    query = ids[LM_N:]
    ic.start_scoring_checkpoint("q", state, model_id=0, num_targets=LM_M)
    ic.score((query, torch.ones_like(query), query), num_samples=LM_M)
    reduced = [basis.reduced for basis in ic.preconditioner(0).eigen]
    return np.asarray(ic.finalize_scores("q")), reduced


@pytest.mark.parametrize(
    ("method", "damping", "curvature"),
    [("ekfac", "auto", "loss"), ("kfac", 0.03, "loss"), ("ekfac", "auto", "sampled")],
)
def test_gpt2_scores_with_reduced_bases_equal_full_ones(
    tmp_path, monkeypatch, method, damping, curvature
):
    """The whole flow (store, finalize, rotated scoring) with and without reduced bases.

    The full-basis flow is checked against explicit float64 inverses in
    ``test_influence_lm.py``; the scores come back in float32 (``rtol`` 1e-5).
    """
    got, reduced = _lm_scores(tmp_path, monkeypatch, True, method, damping, curvature)
    want, full = _lm_scores(tmp_path, monkeypatch, False, method, damping, curvature)
    assert any(reduced) and not any(full)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


class _Stub:
    """A featurizer standing in for KroneckerFactors' rows: expands rows as they are."""

    feature_dim = 3

    @staticmethod
    def expand_rank_one(rows, **_):
        return rows


class _Stored(np.ndarray):
    chunks = (2, 3)


@pytest.mark.parametrize(
    ("value", "bad"),
    [(float("nan"), True), (float("inf"), True), (3e38, False)],
    ids=["nan", "inf", "finite-sum-overflows"],
)
def test_factored_rows_refuse_rows_that_are_not_finite(value, bad):
    """The finiteness check's fast sum: NaN and inf are refused, a float32 sum's overflow is not."""
    from gradsketch.attribution._kronecker_features import FactoredRows

    stored = np.zeros((4, 3), dtype=np.float32)
    stored[2, :2] = value
    rows = FactoredRows(stored.view(_Stored), _Stub())  # type: ignore[arg-type]
    if bad:
        with pytest.raises(ValueError, match=r"stored factored rows \[2\] are not finite"):
            rows[0:4]
    else:
        np.testing.assert_array_equal(rows[0:4], stored)


def _forced_scores(tmp_path, monkeypatch, pattern):
    from gradsketch.attribution._preconditioners import KFACPreconditioner

    chosen: list[list[bool]] = []

    def forced(self, train, targets):
        flags = [
            pattern == "all" or (pattern == "alternate" and i % 2 == 0)
            for i in range(len(self.spec.layers))
        ]
        chosen.append(flags)
        return flags

    monkeypatch.setattr(KFACPreconditioner, "_rotate_train", forced)
    got, reduced = _lm_scores(tmp_path / pattern, monkeypatch, True, "ekfac", "auto", "loss")
    assert chosen and any(reduced)
    return got


@pytest.mark.parametrize("pattern", ["none", "alternate"])
def test_scores_with_targets_rotated_back_equal_rotated_training_rows(
    tmp_path, monkeypatch, pattern
):
    """Layers scored against training rows as stored (targets solved and rotated back).

    Same scores as rotating every layer's training rows, with reduced bases
    on; float32 scores (``rtol`` 1e-5).
    """
    want = _forced_scores(tmp_path, monkeypatch, "all")
    got = _forced_scores(tmp_path, monkeypatch, pattern)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def test_rotate_train_rule_follows_the_multiply_adds():
    """16 documents of 128 tokens rotate GPT-2's training rows, 64 rotate the 4 targets back."""
    from types import SimpleNamespace

    from gradsketch.attribution._preconditioners import KFACPreconditioner

    def basis(d_in, r_a, d_out, r_s):
        q_a, q_s = torch.empty(d_in, r_a), torch.empty(d_out, r_s)
        return KroneckerEigenbasis(q_a, q_s, torch.empty(r_a * r_s))

    pre = object.__new__(KFACPreconditioner)
    pre.eigen = [basis(769, 769, 2304, 2304), basis(3073, 3073, 768, 768)]
    rows = SimpleNamespace(shape=(16, 0), tokens=[128, 128])
    assert pre._rotate_train(rows, 4) == [True, True]  # type: ignore[arg-type]
    rows.shape = (64, 0)
    assert pre._rotate_train(rows, 4) == [False, False]  # type: ignore[arg-type]
