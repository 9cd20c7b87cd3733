"""Per-layer Kronecker projection (LoGra): inner products unbiased, with the stated variance.

For one layer with gradients ``V, W`` (``[d_out, d_in + 1]``), Gaussian
factors ``A = P_out`` (``k1 = k_out`` rows ``a_p``) and ``B = P_in`` (``k2 =
k_in`` rows ``b_q``), the normalised estimate is::

    X = <A V Bᵀ, A W Bᵀ> / (k1 k2) = (1 / (k1 k2)) sum_{p,q} f(p, q),
    f(p, q) = (a_pᵀ V b_q)(a_pᵀ W b_q).

``E f = <V, W>``, so ``E X = <V, W>`` (the docstring's promise). Terms with
``p ≠ p'`` and ``q ≠ q'`` are independent; the others share a factor. With
``E[xᵀPx · xᵀQx] = tr P tr Q + 2 tr(PQ)`` (Isserlis, symmetric ``P, Q``)
and ``Var(xᵀMx) = 2 ||sym M||²`` for ``x ~ N(0, I)``:

* ``Var f = |V|²|W|² + <V,W>² + 2 ||VᵀW||² + 4 ||sym(V Wᵀ)||²``;
* same ``p``, other ``q`` (``a`` shared): ``Cov = Var_a(aᵀ V Wᵀ a) = 2 ||sym(V Wᵀ)||²``;
* same ``q``, other ``p`` (``b`` shared): ``Cov = 2 ||sym(Vᵀ W)||²``;

so ``Var X = [Var f + (k2 - 1) 2||sym(VWᵀ)||² + (k1 - 1) 2||sym(VᵀW)||²] / (k1 k2)``
(:func:`gradsketch.sketch._factorized.kronecker_inner_product_variance`). For large
``k`` it is ``≈ 2||sym(VWᵀ)||²/k1 + 2||sym(VᵀW)||²/k2``: a side of ``k``
rows leaves a relative error of order ``sqrt(2/k)`` per side, not the
``1/k`` of a dense map with ``k1 k2`` rows.

The tests draw ``S = 3000`` independent maps (:func:`_draws`) and check, at
a fixed seed:

* the mean: ``|mean X - <V,W>| <= 4.5 σ / sqrt(S)`` with ``σ²`` the formula
  (a false failure has probability ~7e-6 by the central limit theorem);
* the variance: the sample variance ``s²`` has standard deviation
  ``σ² sqrt((κ - 1) / S)`` (``κ``: the kurtosis of ``X``, estimated from the
  same draws), so ``|s²/σ² - 1| <= 4.5 sqrt((κ̂ - 1) / S)``.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gradsketch.sketch import FactorizedProjector
from gradsketch.sketch._factorized import FactorizedLayer, kronecker_inner_product_variance

F64 = torch.float64
S = 3000
Z = 4.5


def _pair(d_in: int, d_out: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two correlated layer gradients ``sum_t g_t [a_t, 1]ᵀ`` (``[d_out, d_in + 1]``)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(2, tokens, d_in, generator=g, dtype=F64)
    a = torch.cat([a, torch.ones(2, tokens, 1, dtype=F64)], -1)
    gout = torch.randn(2, tokens, d_out, generator=g, dtype=F64)
    gout[1] = 0.6 * gout[0] + 0.8 * gout[1]  # correlated, so <V, W> is far from 0
    v, w = (torch.einsum("to,ti->oi", gout[i], a[i]) for i in range(2))
    return v, w


def _draws(v: torch.Tensor, w: torch.Tensor, k_in: int, k_out: int) -> torch.Tensor:
    """``S`` draws of ``X``: disjoint column blocks of one wide layer's factors.

    The factors' entries are i.i.d. (hashed per entry), so block ``s`` of a
    ``[k_out, S d_out]`` ``P_out`` and of a ``[k_in, S (d_in + 1)]`` ``P_in``
    are ``S`` independent maps of the ``[d_out, d_in + 1]`` layer, made in
    two calls instead of ``S``.
    """
    d_out, width = v.shape
    wide = FactorizedLayer(
        name="wide",
        param_names=("wide.weight",),
        d_in=S * width,
        d_out=S * d_out,
        bias=False,
        k_in=k_in,
        k_out=k_out,
    )
    p_out, p_in = FactorizedProjector([wide], seed=11).factor_matrices("wide", F64)
    p_out = p_out.reshape(k_out, S, d_out).transpose(0, 1)  # [S, k_out, d_out]
    p_in = p_in.reshape(k_in, S, width).transpose(0, 1)  # [S, k_in, d_in + 1]
    pv = p_out @ v @ p_in.transpose(1, 2)
    pw = p_out @ w @ p_in.transpose(1, 2)
    return (pv * pw).sum((1, 2)) / (k_in * k_out)


@pytest.mark.parametrize(("k_in", "k_out"), [(3, 2), (5, 5), (1, 4), (16, 16)], ids=str)
def test_kronecker_inner_product_mean_and_variance(k_in, k_out):
    v, w = _pair(6, 5, tokens=3)
    draws = _draws(v, w, k_in, k_out)
    exact = float((v * w).sum())
    var = kronecker_inner_product_variance(v, w, k_in=k_in, k_out=k_out)
    sigma = math.sqrt(var)
    assert abs(float(draws.mean()) - exact) <= Z * sigma / math.sqrt(S)
    centred = draws - draws.mean()
    s2 = float(centred.pow(2).mean())
    kurtosis = float(centred.pow(4).mean()) / s2**2
    assert abs(s2 / var - 1) <= Z * math.sqrt((kurtosis - 1) / S)


@pytest.mark.parametrize("side", ["in", "out"])
def test_one_sided_projection_mean_and_variance(side):
    """Only one side projected (the other exact, as the rows keep a side with ``k >= d``):
    ``X = (1/k) sum_p a_pᵀ M a_p``, ``k`` independent Gaussian quadratic forms with ``M =
    V Wᵀ`` (output side) or ``Vᵀ W`` (input side): ``Var X = 2||sym M||² / k``. Same
    checks and tolerances as above."""
    v, w = _pair(6, 5, tokens=3)
    k = 4
    d_out, width = v.shape
    wide = FactorizedLayer("w", ("w.weight",), S * width, S * d_out, False, k, k)
    p_out, p_in = FactorizedProjector([wide], seed=5).factor_matrices("w", F64)
    if side == "out":
        p = p_out.reshape(k, S, d_out).transpose(0, 1)
        draws = ((p @ v) * (p @ w)).sum((1, 2)) / k
        var = kronecker_inner_product_variance(v, w, k_in=None, k_out=k)
    else:
        p = p_in.reshape(k, S, width).transpose(0, 1)
        draws = ((v @ p.transpose(1, 2)) * (w @ p.transpose(1, 2))).sum((1, 2)) / k
        var = kronecker_inner_product_variance(v, w, k_in=k, k_out=None)
    assert abs(float(draws.mean()) - float((v * w).sum())) <= Z * math.sqrt(var / S)
    centred = draws - draws.mean()
    s2 = float(centred.pow(2).mean())
    kurtosis = float(centred.pow(4).mean()) / s2**2
    assert abs(s2 / var - 1) <= Z * math.sqrt((kurtosis - 1) / S)
    assert kronecker_inner_product_variance(v, w, k_in=None, k_out=None) == 0.0


def test_variance_formula_against_the_dense_expansion():
    """With ``k1 = k2 = 1`` the formula is ``Var f``; check it on rank-one ``V = W = u vᵀ``.

    Then ``a_ᵀ V b = (a·u)(v·b)``, a product of independent ``N(0,|u|²)`` and
    ``N(0,|v|²)``: ``f = (a·u)²(v·b)²`` and ``Var f = (3·3 - 1)|u|⁴|v|⁴ = 8|V|⁴``.
    """
    u = torch.tensor([1.0, 2.0, -1.0], dtype=F64)
    x = torch.tensor([0.5, -1.0], dtype=F64)
    v = torch.outer(u, x)
    got = kronecker_inner_product_variance(v, v, k_in=1, k_out=1)
    assert got == pytest.approx(8 * float(v.pow(2).sum()) ** 2, rel=1e-12)


def test_projector_output_is_the_scaled_kronecker_map():
    """``project`` of a layer's gradient is ``s vec(P_out G P_inᵀ)``, ``s² = proj_dim/(k1 k2)``.

    So ``<Px, Py> / proj_dim`` is the ``X`` above, to rounding (float64: 1e-12).
    """
    layer = nn.Linear(6, 5)
    v, w = _pair(6, 5, tokens=2)
    projector = FactorizedProjector.from_model(layer, k_in=3, k_out=2, seed=4)
    flat = torch.stack([torch.cat([m[:, :-1].reshape(-1), m[:, -1]]) for m in (v, w)])
    out = projector.project(flat, model_id=0)
    p_out, p_in = projector.factor_matrices("", F64)
    want = ((p_out @ v @ p_in.T) * (p_out @ w @ p_in.T)).sum() / 6
    assert float(out[0] @ out[1]) / projector.proj_dim == pytest.approx(float(want), rel=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"k_in": 0, "k_out": 1}, r"`k_in` must be a positive integer"),
        ({"k_in": 1, "k_out": 1, "w": torch.zeros(2, 2)}, r"`v` and `w` must have one shape"),
    ],
    ids=["k_in", "shapes"],
)
def test_variance_arguments_are_checked(kwargs, match):
    v = torch.zeros(3, 2)
    kwargs = dict(kwargs)
    w = kwargs.pop("w", v)
    with pytest.raises(ValueError, match=match):
        kronecker_inner_product_variance(v, w, **kwargs)
