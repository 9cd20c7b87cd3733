"""FactorizedProjector: every block against its explicit Kronecker matrix in float64."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradsketch.sketch import FactorizedProjector, Fingerprint, FingerprintMismatchError
from gradsketch.sketch._factorized import (
    FactorizedLayer,
    FactorizedLayoutError,
    PlainParam,
    param_layout,
)

# Each test runs with the native scatter kernels and with torch's scatter.
pytestmark = pytest.mark.usefixtures("scatter_backend")

F64 = torch.float64


def mlp(bias: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7, bias=bias), nn.Tanh(), nn.Linear(7, 3, bias=bias)).double()


def mixed() -> nn.Module:
    """Embedding, LayerNorm, Linear, grouped conv: factorized and rest parameters interleaved."""

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(6, 4)
            self.norm = nn.LayerNorm(4)
            self.fc = nn.Linear(4, 3)
            self.gconv = nn.Conv2d(2, 4, 3, groups=2)
            self.conv = nn.Conv2d(2, 3, 2, bias=False)

    torch.manual_seed(0)
    return Mixed().double()


def explicit_matrix(p: FactorizedProjector) -> torch.Tensor:
    """Slow reference: project each basis vector of R^grad_dim alone (float64): P^T [d, k]."""
    eye = torch.eye(p.grad_dim, dtype=F64)
    return torch.cat([p.project(eye[i : i + 1], None) for i in range(p.grad_dim)])


def kronecker_reference(p: FactorizedProjector) -> torch.Tensor:
    """The same matrix assembled from the factors: s_l (P_out ⊗ P_in), bias column moved last."""
    cols = []
    for layer in p.layers:
        p_out, p_in = p.factor_matrices(layer.name, F64)
        kron = p.scale(layer.name) * torch.kron(p_out, p_in)  # [k_out k_in, d_out (d_in + b)]
        # Coordinates of [W | b] in parameter order: W row-major, then b.
        grid = torch.arange(layer.numel).reshape(layer.d_out, layer.in_dim)
        order = grid[:, : layer.d_in].reshape(-1)
        if layer.bias:
            order = torch.cat([order, grid[:, layer.d_in]])
        cols.append(kron[:, order].T)
    return torch.block_diag(*cols)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("proj_type", ["normal", "rademacher"])
def test_map_is_block_kronecker_float64(bias, proj_type):
    """The exact identity: P = blockdiag_l s_l (P_out ⊗ P_in) on the per-example gradient."""
    p = FactorizedProjector.from_model(mlp(bias), k_in=3, k_out=2, seed=4, proj_type=proj_type)
    torch.testing.assert_close(explicit_matrix(p), kronecker_reference(p), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("positions", [1, 6])
def test_linear_factors_equal_dense_projection_of_per_example_gradient(positions):
    """sum_t (P_out g_t) ⊗ (P_in [a_t, 1]) == P vec([sum_t g_t a_t^T | sum_t g_t])."""
    p = FactorizedProjector.from_model(mlp(), k_in=4, k_out=3, seed=1)
    gen = torch.Generator().manual_seed(0)
    batch = 5
    grads = {}
    out = torch.zeros(batch, p.proj_dim, dtype=F64)
    for layer in p.layers:
        a = torch.randn(batch, positions, layer.d_in, generator=gen, dtype=F64)
        g = torch.randn(batch, positions, layer.d_out, generator=gen, dtype=F64)
        p.project_layer_into_(out, layer.name, a, g)
        grads[f"{layer.name}.weight"] = torch.einsum("bto,bti->boi", g, a)
        grads[f"{layer.name}.bias"] = g.sum(1)
    flat = torch.cat([v.reshape(batch, -1) for v in grads.values()], dim=1)
    torch.testing.assert_close(out, flat @ kronecker_reference(p))
    torch.testing.assert_close(out, p.project(grads, 0))


@pytest.mark.parametrize(
    "conv",
    [
        dict(kernel_size=3, padding=1),
        dict(kernel_size=(2, 3), stride=2, dilation=(1, 2), padding=(1, 0)),
        dict(kernel_size=3, bias=False),
    ],
    ids=["same", "strided-dilated", "no-bias"],
)
def test_conv2d_im2col_factors_equal_projection_of_autograd_gradient(conv):
    """Conv2d through unfold: factors of the patches give P of the true per-example gradient."""
    torch.manual_seed(0)
    layer = nn.Conv2d(3, 4, **conv).double()
    p = FactorizedProjector.from_model(layer, k_in=5, k_out=3, seed=2)
    x = torch.randn(3, 3, 7, 8, dtype=F64)
    out = layer(x)
    w = torch.randn_like(out)
    # Slow reference: a batch-of-one loop with autograd.
    dense = []
    for b in range(3):
        gs = torch.autograd.grad(
            (layer(x[b : b + 1]) * w[b : b + 1]).sum(), list(layer.parameters())
        )
        dense.append(torch.cat([g.reshape(-1) for g in gs]))
    reference = torch.stack(dense) @ explicit_matrix(p)
    patches = F.unfold(
        x, layer.kernel_size, dilation=layer.dilation, padding=layer.padding, stride=layer.stride
    )
    got = torch.zeros(3, p.proj_dim, dtype=F64)
    p.project_layer_into_(got, "", patches.transpose(1, 2), w.flatten(2).transpose(1, 2))
    torch.testing.assert_close(got, reference)


def test_from_model_layout_rest_and_tied_weights():
    p = FactorizedProjector.from_model(mixed(), k_in=4, k_out=8, seed=0)
    kinds = [(type(s).__name__, s.name) for s in p.segments]
    assert kinds == [
        ("PlainParam", "emb.weight"),
        ("PlainParam", "norm.weight"),
        ("PlainParam", "norm.bias"),
        ("FactorizedLayer", "fc"),
        ("PlainParam", "gconv.weight"),  # groups=2: no single Kronecker product
        ("PlainParam", "gconv.bias"),
        ("FactorizedLayer", "conv"),
    ]
    fc, conv = p.layer("fc"), p.layer("conv")
    assert (fc.d_in, fc.d_out, fc.bias, fc.k_in, fc.k_out) == (4, 3, True, 4, 3)  # k clipped
    assert (conv.d_in, conv.d_out, conv.bias, conv.k_in, conv.k_out) == (8, 3, False, 4, 3)
    assert p.rest_proj_dim == 32 and p.proj_dim == 12 + 12 + 32
    assert p.grad_dim == sum(x.numel() for x in mixed().parameters())
    assert list(param_layout(p)) == [n for n, _ in mixed().named_parameters()]
    # grad_wrt: a layer without its bias keeps its weight factorized.
    q = FactorizedProjector.from_model(
        mixed(), k_in=2, k_out=2, seed=0, grad_wrt=["fc.weight", "norm.bias"]
    )
    assert [s.name for s in q.segments] == ["norm.bias", "fc"] and not q.layer("fc").bias
    # Tied weights appear once, under their first name (as in named_parameters).
    tied = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    tied[1].weight = tied[0].weight
    r = FactorizedProjector.from_model(tied, k_in=2, k_out=2, seed=0)
    assert [(type(s).__name__, s.name) for s in r.segments] == [
        ("FactorizedLayer", "0"),
        ("PlainParam", "1.bias"),
    ]


@pytest.mark.parametrize("budget", [1, 10, 64, 300, 2048, 10**6])
def test_from_budget_takes_the_largest_side_within_the_budget(budget):
    """Equal sides, at most ``budget`` features, and one more side would exceed it or add
    nothing; a model with a rest block counts it (side squared)."""
    mlp = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))
    mixed = nn.Sequential(nn.Linear(5, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    for model in (mlp, mixed):
        rest = any(isinstance(m, nn.LayerNorm) for m in model.modules())
        smallest = FactorizedProjector.from_model(model, k_in=1, k_out=1, seed=0).proj_dim
        if budget < smallest:
            with pytest.raises(ValueError, match=rf"`proj_dim`={budget} is below"):
                FactorizedProjector.from_budget(model, budget, seed=0)
            continue
        proj = FactorizedProjector.from_budget(model, budget, seed=3)
        assert proj.proj_dim <= budget and proj.seed == 3
        # The side: the rest block's square root, else the widest factor (layers cap it).
        if rest:
            side = math.isqrt(proj.rest_proj_dim)
            assert side * side == proj.rest_proj_dim
        else:
            side = max(max(layer.k_in, layer.k_out) for layer in proj.layers)
        same = FactorizedProjector.from_model(model, k_in=side, k_out=side, seed=3)
        assert same.fingerprint == proj.fingerprint
        bigger = FactorizedProjector.from_model(model, k_in=side + 1, k_out=side + 1, seed=0)
        assert bigger.proj_dim > budget or (not rest and bigger.proj_dim == proj.proj_dim)


def test_rest_block_and_mixed_model_equal_explicit_matrix():
    """Rest coordinates are a count sketch with entries ±sqrt(proj_dim), one per coordinate."""
    p = FactorizedProjector.from_model(mixed(), k_in=3, k_out=2, seed=5, rest_proj_dim=16)
    m = explicit_matrix(p)
    offsets = itertools.accumulate((seg.numel for seg in p.segments), initial=0)
    rest_rows = torch.cat(
        [
            torch.arange(off, off + s.numel)
            for s, off in zip(p.segments, offsets)
            if isinstance(s, PlainParam)
        ]
    )
    rest = m[rest_rows]
    assert (rest[:, : p.rest_offset] == 0).all()
    block = rest[:, p.rest_offset :]
    assert ((block != 0).sum(1) == 1).all()
    torch.testing.assert_close(
        block.abs().sum(1), torch.full((len(rest_rows),), math.sqrt(p.proj_dim), dtype=F64)
    )
    layer_rows = torch.tensor([i for i in range(p.grad_dim) if i not in set(rest_rows.tolist())])
    torch.testing.assert_close(m[layer_rows][:, : p.rest_offset], kronecker_reference(p))
    assert (m[layer_rows][:, p.rest_offset :] == 0).all()


def test_row_sparse_rest_equals_dense_rest():
    """project_rest_sparse_into_ (embedding rows, repeated rows add) == the dense rest path."""
    p = FactorizedProjector.from_model(mixed(), k_in=3, k_out=2, seed=5, rest_proj_dim=16)
    rows = torch.tensor([[0, 3, 3], [5, 1, 0]])
    values = torch.randn(2, 3, 4, dtype=F64)
    dense = torch.zeros(2, 6, 4, dtype=F64)
    dense.scatter_add_(1, rows.unsqueeze(-1).expand_as(values), values)
    expected = torch.zeros(2, p.proj_dim, dtype=F64)
    p.project_rest_into_(expected, dense.reshape(2, -1), p.rest_offset_of("emb.weight"))
    coords = (rows.unsqueeze(-1) * 4 + torch.arange(4)).reshape(2, -1)
    got = torch.zeros(2, p.proj_dim, dtype=F64)
    p.project_rest_sparse_into_(got, coords, values.reshape(2, -1))
    torch.testing.assert_close(got, expected)


def test_streaming_by_coordinates_and_dict_input_equal_flat():
    p = FactorizedProjector.from_model(mixed(), k_in=3, k_out=2, seed=3)
    x = torch.randn(4, p.grad_dim, dtype=F64)
    flat = p.project(x, 0)
    for cuts in (
        [0, p.grad_dim],
        [0, 5, 30, 31, 77, p.grad_dim],
        [*list(range(0, p.grad_dim, 13)), p.grad_dim],
    ):
        out = torch.zeros_like(flat)
        for lo, hi in itertools.pairwise(cuts):
            p.project_into_(out, x[:, lo:hi], lo)
        torch.testing.assert_close(out, flat)
    params = dict(mixed().named_parameters())
    grads, offset = {}, 0
    for name, t in params.items():
        grads[name] = x[:, offset : offset + t.numel()].reshape(4, *t.shape)
        offset += t.numel()
    torch.testing.assert_close(p.project(grads, 0), flat)


def test_float32_path_matches_float64_reference():
    p = FactorizedProjector.from_model(mixed(), k_in=4, k_out=4, seed=3)
    x = torch.randn(3, p.grad_dim, dtype=F64)
    ref = p.project(x, 0)
    out = p.project(x.float(), 0)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * math.sqrt(p.grad_dim))


def test_same_fingerprint_same_map_model_id_reseeds_and_names_do_not_matter():
    a = FactorizedProjector.from_model(mlp(), k_in=3, k_out=2, seed=9)
    b = FactorizedProjector.from_model(mlp(), k_in=3, k_out=2, seed=9)
    x = torch.randn(2, a.grad_dim, dtype=F64)
    assert a.fingerprint == b.fingerprint
    torch.testing.assert_close(a.project(x, 0), b.project(x, 0), rtol=0, atol=0)
    first = a.project(x, 0)
    assert not torch.allclose(a.project(x, 1), first)
    torch.testing.assert_close(a.project(x, 0), first, rtol=0, atol=0)  # back to model 0
    a.free_memory()
    torch.testing.assert_close(a.project(x, 0), first, rtol=0, atol=0)
    renamed = nn.Sequential()
    renamed.add_module("inp", nn.Linear(5, 7))
    renamed.add_module("act", nn.Tanh())
    renamed.add_module("out", nn.Linear(7, 3))
    c = FactorizedProjector.from_model(renamed, k_in=3, k_out=2, seed=9)
    assert c.fingerprint == a.fingerprint
    fp = a.fingerprint
    assert fp.kind == "factorized"
    assert json.loads(fp.extra) == {
        "segments": [["L", 5, 7, 1, 3, 2], ["L", 7, 3, 1, 3, 2]],
        "rest_proj_dim": 0,
    }
    assert Fingerprint.from_json(fp.to_json()) == fp
    other = FactorizedProjector.from_model(mlp(), k_in=2, k_out=3, seed=9)
    with pytest.raises(FingerprintMismatchError, match="extra"):
        fp.require_same(other.fingerprint, "factorized features")


def test_doubled_layer_block_sizes_keep_trak_normalisation():
    """Scale s_l = sqrt(proj_dim / (k_out k_in)), so blocks of different sizes weigh the same."""
    p = FactorizedProjector.from_model(mixed(), k_in=4, k_out=8, seed=0)
    assert p.scale("fc") == pytest.approx(math.sqrt(p.proj_dim / 12))


def _rank_one_moments(a1, a2, g1, g2, k_in, k_out, proj_type):
    """Mean and variance of <P x, P y>/(k_in k_out) for x = g1 a1^T, y = g2 a2^T.

    <Px, Py> = U V with U = <P_in a1, P_in a2>, V = <P_out g1, P_out g2>
    independent. U is a sum of k_in i.i.d. terms (r.a1)(r.a2) with mean c_a =
    <a1, a2> and variance |a1|^2 |a2|^2 + c_a^2 (normal rows) or that minus
    2 sum_i a1_i^2 a2_i^2 (Rademacher rows); likewise V. Then
    E[UV] = k_in k_out c_a c_g and Var[UV] = E[U^2] E[V^2] - E[U]^2 E[V]^2.
    """

    def moments(u, v, k):
        c = float(u @ v)
        var_term = float(u @ u) * float(v @ v) + c * c
        if proj_type == "rademacher":
            var_term -= 2 * float((u * u) @ (v * v))
        return k * c, k * var_term

    mu_u, var_u = moments(a1, a2, k_in)
    mu_v, var_v = moments(g1, g2, k_out)
    mean = mu_u * mu_v
    var = (var_u + mu_u**2) * (var_v + mu_v**2) - mean**2
    scale = k_in * k_out
    return mean / scale, var / scale**2


@pytest.mark.parametrize("proj_type", ["normal", "rademacher"])
def test_inner_products_unbiased_with_derived_variance(proj_type):
    """E<Px, Py> = k_in k_out <x, y> for one layer, checked against the exact variance.

    For rank-one gradients the variance of X = <Px, Py>/(k_in k_out) has the
    closed form of :func:`_rank_one_moments`. Over N = 300 independent seeds the
    mean of X has standard deviation sqrt(Var X / N); we accept 5 of them (a
    false alarm below 1e-6 by the CLT; the factors' 24-bit Box-Muller
    discretisation moves the moments by < 1e-6, far below the tolerance). The
    sample variance must also agree with the formula within 5 standard errors
    of a variance estimate, sqrt((m4 - s^4) / N), using the sample fourth
    central moment m4.
    """
    layer = FactorizedLayer("l", ("l.weight",), d_in=6, d_out=5, bias=False, k_in=3, k_out=2)
    gen = torch.Generator().manual_seed(3)
    a1, g1 = torch.randn(6, generator=gen, dtype=F64), torch.randn(5, generator=gen, dtype=F64)
    a2 = 0.6 * a1 + torch.randn(6, generator=gen, dtype=F64)
    g2 = 0.6 * g1 + torch.randn(5, generator=gen, dtype=F64)
    mean, var = _rank_one_moments(a1, a2, g1, g2, 3, 2, proj_type)
    assert mean == pytest.approx(
        float(torch.outer(g1, a1).reshape(-1) @ torch.outer(g2, a2).reshape(-1))
    )
    n = 300
    samples = []
    for seed in range(n):
        p = FactorizedProjector([layer], seed, proj_type=proj_type)
        x = p.project(torch.outer(g1, a1).reshape(1, -1), 0)
        y = p.project(torch.outer(g2, a2).reshape(1, -1), 0)
        samples.append(float(x @ y.T) / 6)
    s = torch.tensor(samples, dtype=F64)
    assert abs(float(s.mean()) - mean) < 5 * math.sqrt(var / n)
    m4 = float(((s - s.mean()) ** 4).mean())
    assert abs(float(s.var()) - var) < 5 * math.sqrt(max(m4 - float(s.var()) ** 2, 0.0) / n)


LAYER = FactorizedLayer("l", ("l.weight", "l.bias"), d_in=3, d_out=2, bias=True, k_in=2, k_out=2)

ERRORS = [
    ("empty", lambda: FactorizedProjector([], 0), FactorizedLayoutError, "`segments` is empty"),
    (
        "bad-segment",
        lambda: FactorizedProjector([object()], 0),  # type: ignore[list-item]
        TypeError,
        "FactorizedLayer or PlainParam",
    ),
    (
        "bias-names",
        lambda: FactorizedProjector([FactorizedLayer("l", ("l.weight",), 3, 2, True, 2, 2)], 0),
        FactorizedLayoutError,
        "needs 2 parameter names",
    ),
    (
        "zero-k",
        lambda: FactorizedProjector([FactorizedLayer("l", ("l.weight",), 3, 2, False, 0, 2)], 0),
        ValueError,
        "`l.k_in` must be a positive integer",
    ),
    (
        "rest-missing",
        lambda: FactorizedProjector([LAYER, PlainParam("e", 4)], 0),
        FactorizedLayoutError,
        "`rest_proj_dim`=0 but 4 coordinates",
    ),
    (
        "rest-unneeded",
        lambda: FactorizedProjector([LAYER], 0, rest_proj_dim=3),
        FactorizedLayoutError,
        "pass rest_proj_dim=0",
    ),
    (
        "proj-type",
        lambda: FactorizedProjector([LAYER], 0, proj_type="uniform"),
        ValueError,
        "`proj_type` must be one of 'normal', 'rademacher', got 'uniform'",
    ),
    (
        "k-from-model",
        lambda: FactorizedProjector.from_model(mlp(), k_in=0, seed=0),
        ValueError,
        "`k_in` must be a positive integer, got 0",
    ),
    (
        "grad-wrt",
        lambda: FactorizedProjector.from_model(mlp(), seed=0, grad_wrt=["0.weight", "nope"]),
        FactorizedLayoutError,
        r"`grad_wrt` names \['nope'\]",
    ),
    (
        "no-params",
        lambda: FactorizedProjector.from_model(nn.ReLU(), seed=0),
        FactorizedLayoutError,
        "no parameter selected",
    ),
    (
        "layer-name",
        lambda: FactorizedProjector([LAYER], 0).project_layer_into_(
            torch.zeros(1, 4), "x", torch.zeros(1, 3), torch.zeros(1, 2)
        ),
        FactorizedLayoutError,
        "`name`='x' is not a factorized layer of this projector; its layers are 'l'",
    ),
    (
        "factor-width",
        lambda: FactorizedProjector([LAYER], 0).project_layer_into_(
            torch.zeros(1, 4), "l", torch.zeros(1, 4), torch.zeros(1, 2)
        ),
        FactorizedLayoutError,
        r"`a` must be \[B, T, 3\] or \[B, 3\], got shape \(1, 4\)",
    ),
    (
        "factor-positions",
        lambda: FactorizedProjector([LAYER], 0).project_layer_into_(
            torch.zeros(1, 4), "l", torch.zeros(1, 5, 3), torch.zeros(1, 4, 2)
        ),
        FactorizedLayoutError,
        "shapes do not agree for layer 'l'",
    ),
    (
        "factor-dtype",
        lambda: FactorizedProjector([LAYER], 0).project_layer_into_(
            torch.zeros(1, 4), "l", torch.zeros(1, 3, dtype=torch.int64), torch.zeros(1, 2)
        ),
        TypeError,
        "`a` has dtype torch.int64",
    ),
    (
        "rest-range",
        lambda: FactorizedProjector(
            [LAYER, PlainParam("e", 4)], 0, rest_proj_dim=2
        ).project_rest_into_(torch.zeros(1, 8), torch.zeros(1, 3), 2),
        FactorizedLayoutError,
        r"rest coordinates \[2, 5\) run past the rest space of 4",
    ),
    (
        "rest-name",
        lambda: FactorizedProjector([LAYER, PlainParam("e", 4)], 0, rest_proj_dim=2).rest_offset_of(
            "l.weight"
        ),
        FactorizedLayoutError,
        r"`param_name`='l.weight' is not a rest parameter .* \['e'\]",
    ),
    (
        "grad-dim",
        lambda: FactorizedProjector([LAYER], 0).project(torch.zeros(1, 7), 0),
        ValueError,
        "`grads` has 7 coordinates per example but the projector was built with grad_dim=8",
    ),
]


@pytest.mark.parametrize(
    ("make", "exc", "match"), [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS]
)
def test_errors(make, exc, match):
    with pytest.raises(exc, match=match):
        make()
