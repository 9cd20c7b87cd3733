"""damped_solver (triangular solves against the Cholesky factor) against float64 references."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from gradsketch.attribution import _linalg as linalg
from gradsketch.attribution._linalg import damped_inverse, damped_solver


def _spectrum(k: int, lowest: float, seed: int = 0) -> torch.Tensor:
    """A float64 symmetric ``[k, k]`` with eigenvalues ``lowest, ..., 1`` in a random basis."""
    g = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(k, k, generator=g, dtype=torch.float64))
    evals = torch.logspace(0, float(np.log10(lowest)), k, dtype=torch.float64)
    return (basis * evals) @ basis.T


def _no_inverse(*args, **kwargs):
    raise AssertionError("the fast path formed the inverse")


@pytest.mark.parametrize("lowest", [0.5, 1e-4], ids=["kappa-2", "kappa-1e4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_solved_rows_within_the_backward_error_bound(lowest, dtype, monkeypatch):
    """Each solved row ``r̂`` is within ``‖A⁻¹‖₂ ε ‖r̂‖`` of the exact ``t A⁻¹``.

    The solve computes ``r̂ (A + ΔA) = t`` with ``|ΔA| <= (2u + 2γ_k + γ_k²)
    |L| |Lᵀ| + (k+1) γ_k64 |L| |Lᵀ|``: ``L`` rounded to ``t``'s dtype
    (``2u``), two triangular solves (``γ_k`` each, Higham Thm 8.5), the
    float64 Cholesky (Thm 10.3). ``‖ |L| |Lᵀ| ‖₂ <= ‖L‖_F² = trace(A)``, so
    ``r̂ - r = -r̂ ΔA A⁻¹`` gives ``‖r̂ - r‖ <= ‖A⁻¹‖₂ ε trace(A) ‖r̂‖``
    with ``ε`` the bracket. A deterministic bound: every row is checked.
    The reference is the float64 solve with the same (float32-rounded) A,
    whose own error (``k u64 κ``, below 1e-10 here) is far inside it.
    """
    monkeypatch.setattr(linalg, "damped_inverse", _no_inverse)
    k = 64
    a = _spectrum(k, lowest).float()
    g = torch.Generator().manual_seed(1)
    t = torch.randn(40, k, generator=g, dtype=torch.float64)
    got = damped_solver(a, 0.0)(t.to(dtype)).double()
    ref = torch.linalg.solve(a.double(), t.T).T
    u = torch.finfo(dtype).eps / 2
    gamma = k * u / (1 - k * u)
    u64 = torch.finfo(torch.float64).eps / 2
    eps = 2 * u + 2 * gamma + gamma**2 + (k + 1) * k * u64 / (1 - (k + 1) * u64)
    inv_norm = 1 / float(torch.linalg.eigvalsh(a.double())[0])
    bound = inv_norm * eps * float(torch.trace(a.double())) * got.norm(dim=1)
    assert torch.all((got - ref).norm(dim=1) <= bound)


def test_fast_path_matches_the_inverse_path():
    """Same rows as ``t @ damped_inverse(...)`` to float32 accuracy, λ > 0 and λ = 0.

    Gaussian XᵀX of 500 rows and 48 columns: κ < 4, so both paths are within
    ``c k u32 κ`` (about 1e-5 with k = 48) of the exact rows, relative.
    """
    g = torch.Generator().manual_seed(2)
    x = torch.randn(500, 48, generator=g)
    t = torch.randn(30, 48, generator=g)
    xtx = x.T @ x
    for lam in (0.0, 7.5):
        fast = damped_solver(xtx, lam)(t)
        slow = t @ damped_inverse(xtx, lam)
        assert fast.dtype == torch.float32
        torch.testing.assert_close(fast, slow, rtol=0, atol=1e-5 * float(slow.abs().max()))


def test_singular_goes_to_the_pseudo_inverse(caplog):
    """Fewer rows than columns with λ = 0: the gate refuses, the pseudo-inverse answers."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 12, generator=g)
    t = torch.randn(4, 12, generator=g)
    xtx = x.T @ x
    got = damped_solver(xtx, 0.0)(t)
    assert "pseudo-inverse" in caplog.text
    assert torch.equal(got, t @ damped_inverse(xtx, 0.0))


def test_zero_columns_are_solved_on_the_live_block(monkeypatch):
    """Zero columns with λ = 0 (empty count-sketch buckets): the float64 pseudo-inverse's rows.

    The live block takes the fast path (``damped_inverse`` is not called);
    the dead columns of the result are exactly 0. The live block is a
    Gaussian XᵀX of 50 rows and 5 columns (κ < 10), so float32 rows are
    within ``c k u32 κ`` (below 1e-5 relative) of the float64 ones.
    """
    g = torch.Generator().manual_seed(4)
    x = torch.randn(50, 7, generator=g, dtype=torch.float64)
    x[:, [2, 5]] = 0
    t = torch.randn(3, 7, generator=g, dtype=torch.float64)
    xtx = x.T @ x
    ref = t @ torch.linalg.pinv(xtx, hermitian=True)
    monkeypatch.setattr(linalg, "damped_inverse", _no_inverse)
    got = damped_solver(xtx.float(), 0.0)(t.float())
    assert torch.equal(got[:, [2, 5]], torch.zeros(3, 2))
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=1e-5 * float(ref.abs().max()))


def test_no_scipy_takes_the_inverse_path(monkeypatch):
    """Without SciPy's LAPACK: ``t @ damped_inverse(...)``, the same bits."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(50, 6, generator=g)
    t = torch.randn(3, 6, generator=g)
    xtx = x.T @ x
    monkeypatch.setitem(sys.modules, "scipy.linalg", None)
    assert torch.equal(damped_solver(xtx, 0.1)(t), t @ damped_inverse(xtx, 0.1))


def test_non_finite_gram_is_refused():
    xtx = torch.eye(4)
    xtx[1, 2] = float("nan")
    with pytest.raises(ValueError, match="holds NaN or inf"):
        damped_solver(xtx, 0.0)
