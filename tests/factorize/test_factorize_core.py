"""factorize_matrix / factorize_conv2d: exactness, monotonicity, references, edge cases."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from gradsketch.factorize import LowRankSolution, factorize_conv2d, factorize_matrix
from helpers.factorize import (
    decaying_inputs,
    low_rank,
    predict,
    reference_als,
    reference_rrr,
    svd_start,
    true_nmse,
)

F64 = torch.float64


@pytest.fixture
def problem() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = decaying_inputs(400, 24, seed=1)
    w = torch.randn(24, 18, generator=gen, dtype=F64)
    b = torch.randn(18, generator=gen, dtype=F64)
    return x, w, b, x @ w + b


@pytest.mark.parametrize("rank", [18, 24, 100], ids=["eq-out", "eq-in", "above"])
def test_full_rank_reproduces_outputs(problem, rank):
    x, w, b, y = problem
    sol = factorize_matrix(x, y, w, bias=b, rank=rank)
    assert sol.rank == -1 and sol.Wb is None
    assert sol.Wa.shape == (24, 18)
    torch.testing.assert_close(predict(x, sol.Wa, None, sol.bias), y, atol=1e-9, rtol=1e-9)
    assert sol.nmse < 1e-20


@pytest.mark.parametrize("init", ["whitened", "weights"])
def test_nmse_non_increasing_in_rank(problem, init):
    x, w, _b, y = problem
    errors = [factorize_matrix(x, y, w, rank=k, init=init, n_iters=4).nmse for k in range(1, 18, 2)]
    assert all(e1 >= e2 - 1e-12 for e1, e2 in itertools.pairwise(errors))
    assert errors[0] > errors[-1]


@pytest.mark.parametrize("init", ["whitened", "weights"])
def test_nmse_non_increasing_in_iterations(problem, init):
    x, w, _b, y = problem
    errors = [factorize_matrix(x, y, w, rank=5, n_iters=n, init=init).nmse for n in range(6)]
    assert all(e1 >= e2 - 1e-12 for e1, e2 in itertools.pairwise(errors))


def test_whitened_start_beats_composer_start(problem):
    x, w, _b, y = problem
    best = factorize_matrix(x, y, w, rank=5).nmse
    for n in (0, 3, 10):
        assert best <= factorize_matrix(x, y, w, rank=5, n_iters=n, init="weights").nmse + 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("fit_bias", [True, False], ids=["fit", "fixed"])
@pytest.mark.parametrize("init", ["whitened", "weights"])
def test_reported_nmse_is_true_nmse(problem, dtype, with_bias, fit_bias, init):
    x, w, b, _ = (t.to(dtype) for t in problem)
    bias = b if with_bias else None
    y = x @ w + (b if with_bias else 0)
    sol = factorize_matrix(x, y, w, bias=bias, rank=6, fit_bias=fit_bias, init=init)
    expected = true_nmse(y, predict(x, sol.Wa, sol.Wb, sol.bias))
    tol = 1e-10 if dtype == F64 else 1e-5
    assert sol.nmse == pytest.approx(expected, rel=tol, abs=tol)
    if not fit_bias:
        assert sol.bias is bias or torch.equal(sol.bias, bias)


@pytest.mark.parametrize("n_iters", [0, 1, 4])
@pytest.mark.parametrize("fit_bias", [True, False], ids=["fit", "fixed"])
def test_fast_path_matches_float64_lstsq_reference(problem, n_iters, fit_bias):
    """The R-factor-space sweeps equal plain ALS on all N rows, step for step."""
    x, w, b, y = problem
    target = y if fit_bias else y - b
    sol = factorize_matrix(
        x, y, w, bias=b, rank=5, n_iters=n_iters, init="weights", fit_bias=fit_bias, svd="full"
    )
    wa0, wb0 = svd_start(w, 5)
    wa, wb, bias = reference_als(x, target, wa0, wb0, n_iters, fit_bias=fit_bias)
    torch.testing.assert_close(sol.Wa @ sol.Wb, wa @ wb, atol=1e-8, rtol=1e-8)
    expected_bias = (y - x @ wa @ wb).mean(0) if fit_bias else b
    torch.testing.assert_close(sol.bias, expected_bias, atol=1e-8, rtol=1e-8)
    assert bias is None or torch.allclose(bias, expected_bias)


def test_whitened_start_is_reduced_rank_regression_optimum(problem):
    x, w, _b, y = problem
    sol = factorize_matrix(x, y, w, rank=7, svd="full")
    w_ref, b_ref = reference_rrr(x, y, 7)
    torch.testing.assert_close(sol.Wa @ sol.Wb, w_ref, atol=1e-8, rtol=1e-8)
    torch.testing.assert_close(sol.bias, b_ref, atol=1e-8, rtol=1e-8)


def test_float32_fast_path_close_to_float64(problem):
    x, w, _b, y = problem
    ref = factorize_matrix(x, y, w, rank=6).nmse
    got = factorize_matrix(x.float(), y.float(), w.float(), rank=6).nmse
    assert got == pytest.approx(ref, rel=1e-4, abs=1e-6)


def test_randomized_svd_is_close_and_deterministic():
    """A rank-8 fit of 96-wide outputs with a decaying spectrum: the randomized start
    (power iterations + sweeps) reaches the optimum to 1e-6 relative."""
    x = decaying_inputs(600, 96, seed=3)
    w = low_rank(96, 96, 40, seed=3) * (1.0 / (1.0 + torch.arange(96, dtype=F64)))
    y = x @ w
    full = factorize_matrix(x, y, w, rank=8, svd="full")
    rand = factorize_matrix(x, y, w, rank=8, svd="randomized", seed=5)
    again = factorize_matrix(x, y, w, rank=8, svd="randomized", seed=5)
    assert rand.nmse == pytest.approx(full.nmse, rel=1e-6)
    assert torch.equal(rand.Wa, again.Wa)
    weights = factorize_matrix(x, y, w, rank=8, svd="randomized", init="weights", n_iters=0)
    exact = factorize_matrix(x, y, w, rank=8, svd="full", init="weights", n_iters=0)
    assert weights.nmse == pytest.approx(exact.nmse, rel=1e-3)


def test_rank_one_and_fraction(problem):
    x, w, _b, y = problem
    one = factorize_matrix(x, y, w, rank=1)
    assert one.Wa.shape == (24, 1) and one.Wb.shape == (1, 18) and one.rank == 1
    frac = factorize_matrix(x, y, w, rank=0.25)
    assert frac.rank == 6  # a fraction of D = 24, as in Composer
    tiny = factorize_matrix(x, y, w, rank=0.001)
    assert tiny.rank == 1


def test_factored_input_and_rank_not_below_current(problem):
    x, w, _b, y = problem
    first = factorize_matrix(x, y, w, rank=8)
    lower = factorize_matrix(x, y, first.Wa, first.Wb, bias=first.bias, rank=4)
    assert lower.rank == 4 and lower.nmse >= first.nmse
    same = factorize_matrix(x, y, first.Wa, first.Wb, bias=first.bias, rank=8)
    assert same.rank == -1 and torch.equal(same.Wa, first.Wa) and torch.equal(same.Wb, first.Wb)
    assert same.nmse == pytest.approx(first.nmse, rel=1e-9)


def test_no_bias_fit_returns_no_bias(problem):
    x, w, _, _ = problem
    sol = factorize_matrix(x, x @ w, w, rank=4, fit_bias=False)
    assert sol.bias is None


def test_rank_deficient_inputs_stay_finite():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10, 30, generator=gen)  # fewer rows than features
    x_col = torch.randn(200, 30, generator=gen)
    x_col[:, 3] = x_col[:, 4]
    x_col[:, 5] = 2.0  # constant column
    w = torch.randn(30, 20, generator=gen)
    for xs in (x, x_col):
        sol = factorize_matrix(xs, xs @ w, w, rank=5)
        assert torch.isfinite(sol.Wa).all() and torch.isfinite(sol.Wb).all()
        assert 0.0 <= sol.nmse < 1.0
        assert sol.nmse == pytest.approx(
            true_nmse(xs @ w, predict(xs, sol.Wa, sol.Wb, sol.bias)), abs=1e-5
        )


def test_low_precision_inputs_are_computed_in_float32(problem):
    x, w, _b, y = problem
    sol = factorize_matrix(x.bfloat16(), y.bfloat16(), w.bfloat16(), rank=4)
    assert sol.Wa.dtype == torch.float32 and 0.0 < sol.nmse < 1.0


def test_constant_target_has_zero_nmse():
    x = torch.randn(50, 6, dtype=F64)
    y = torch.ones(50, 5, dtype=F64)
    sol = factorize_matrix(x, y, torch.zeros(6, 5, dtype=F64), rank=2)
    assert sol.nmse == 0.0


def test_solution_defaults():
    sol = LowRankSolution()
    assert (sol.Wa, sol.Wb, sol.bias, sol.rank, sol.nmse) == (None, None, None, -1, 0.0)


# ---------------------------------------------------------------- convolutions

CONV_SETTINGS = [
    pytest.param({}, id="plain"),
    pytest.param({"stride": 2, "padding": 1}, id="stride2-pad1"),
    pytest.param({"stride": (2, 1), "padding": (1, 0), "dilation": 2}, id="mixed"),
    pytest.param({"padding": "same"}, id="same"),
    pytest.param({"padding": 1, "padding_mode": "reflect"}, id="reflect"),
    pytest.param({"padding": 1, "padding_mode": "circular"}, id="circular"),
]


def _conv(x, w, b, settings):
    settings = dict(settings)
    mode = settings.pop("padding_mode", "zeros")
    if mode != "zeros":
        p = settings.pop("padding")
        x = F.pad(x, (p, p, p, p), mode=mode)
    return F.conv2d(x, w, b, **settings)


@pytest.mark.parametrize("settings", CONV_SETTINGS)
def test_conv_nmse_matches_real_convolutions(settings):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 5, 11, 11, generator=gen, dtype=F64)
    w = torch.randn(12, 5, 3, 3, generator=gen, dtype=F64)
    b = torch.randn(12, generator=gen, dtype=F64)
    sol = factorize_conv2d(x, w, rank=4, biasA=b, **settings)
    assert sol.Wa.shape == (4, 5, 3, 3) and sol.Wb.shape == (12, 4, 1, 1)
    y = _conv(x, w, b, settings)
    y_hat = F.conv2d(_conv(x, sol.Wa, None, settings), sol.Wb, sol.bias)
    flat = lambda t: t.permute(0, 2, 3, 1).reshape(-1, t.shape[1])  # noqa: E731
    assert sol.nmse == pytest.approx(true_nmse(flat(y), flat(y_hat)), rel=1e-9)


def test_conv_full_rank_single_kernel_reproduces_conv():
    x = torch.randn(4, 3, 9, 9, dtype=F64)
    w = torch.randn(6, 3, 3, 3, dtype=F64)
    sol = factorize_conv2d(x, w, rank=6, stride=2)
    assert sol.rank == -1 and sol.Wb is None and sol.Wa.shape == (6, 3, 3, 3)
    torch.testing.assert_close(
        F.conv2d(x, sol.Wa, sol.bias, stride=2), F.conv2d(x, w, stride=2), atol=1e-9, rtol=1e-9
    )


def test_conv_low_rank_kernel_is_exact():
    wm = low_rank(27, 16, 3)  # [fan_in, out] of rank 3
    w = wm.T.reshape(16, 3, 3, 3)
    x = torch.randn(5, 3, 8, 8, dtype=F64)
    sol = factorize_conv2d(x, w, rank=3, padding=1)
    assert sol.nmse < 1e-20


def test_conv_progressive_with_both_biases():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(4, 6, 8, 8, generator=gen, dtype=F64)
    wa = torch.randn(5, 6, 3, 3, generator=gen, dtype=F64)
    wb = torch.randn(10, 5, 1, 1, generator=gen, dtype=F64)
    ba, bb = torch.randn(5, generator=gen, dtype=F64), torch.randn(10, generator=gen, dtype=F64)
    sol = factorize_conv2d(x, wa, wb, rank=3, biasA=ba, biasB=bb)
    assert sol.Wa.shape == (3, 6, 3, 3) and sol.rank == 3
    y = F.conv2d(F.conv2d(x, wa, ba), wb, bb)
    y_hat = F.conv2d(F.conv2d(x, sol.Wa), sol.Wb, sol.bias)
    flat = lambda t: t.permute(0, 2, 3, 1).reshape(-1, t.shape[1])  # noqa: E731
    assert sol.nmse == pytest.approx(true_nmse(flat(y), flat(y_hat)), rel=1e-9)
    fixed = factorize_conv2d(x, wa, wb, rank=3, biasA=ba, biasB=bb, fit_bias=False)
    torch.testing.assert_close(fixed.bias, ba @ wb.reshape(10, 5).T + bb)


# ----------------------------------------------------------------- error paths

X = torch.randn(20, 6)
W = torch.randn(6, 4)
Y = X @ W

MATRIX_ERRORS = [
    pytest.param(
        {"X": torch.randn(20)}, ValueError, r"`X` must be a 2-D tensor; got \[20\]", id="X-1d"
    ),
    pytest.param({"Y": [1.0]}, ValueError, r"`Y` must be a 2-D tensor; got list", id="Y-list"),
    pytest.param(
        {"Y": torch.randn(19, 4)}, ValueError, r"same number of rows; got X \[20, 6\]", id="rows"
    ),
    pytest.param({"X": X[:1], "Y": Y[:1]}, ValueError, r"at least 2 rows", id="one-row"),
    pytest.param(
        {"Wa": torch.randn(5, 4)},
        ValueError,
        r"`Wa` must have X.shape\[1\]=6 rows; got Wa \[5, 4\]",
        id="Wa-rows",
    ),
    pytest.param(
        {"Wa": torch.randn(6, 3)},
        ValueError,
        r"map to 3 outputs but `Y` has 4 columns",
        id="outputs",
    ),
    pytest.param(
        {"Wa": torch.randn(6, 2), "Wb": torch.randn(3, 4)},
        ValueError,
        r"`Wb` must be \[Wa.shape\[1\], M\] = \[2, M\]; got \[3, 4\]",
        id="Wb",
    ),
    pytest.param(
        {"bias": torch.randn(5)}, ValueError, r"`bias` must have shape \[4\]; got \[5\]", id="bias"
    ),
    pytest.param(
        {"n_iters": -1},
        ValueError,
        r"`n_iters` must be a non-negative integer, got -1",
        id="n-iters",
    ),
    pytest.param(
        {"rank": 0},
        ValueError,
        r"`rank` must be an int >= 1 or a float in \(0, 1\); got 0",
        id="rank-0",
    ),
    pytest.param({"rank": 2.5}, ValueError, r"got 2.5. Round it \(e.g. 2\)", id="rank-frac"),
    pytest.param({"rank": float("nan")}, ValueError, r"got nan", id="rank-nan"),
    pytest.param({"rank": "2"}, TypeError, r"`rank` must be .*got '2' of type str", id="rank-str"),
    pytest.param(
        {"init": "random"},
        ValueError,
        r"`init` must be one of \['whitened', 'weights'\]; got 'random'",
        id="init",
    ),
    pytest.param(
        {"svd": "lanczos"},
        ValueError,
        r"`svd` must be one of \['auto', 'full', 'randomized'\]",
        id="svd",
    ),
]


@pytest.mark.parametrize(("override", "exc", "match"), MATRIX_ERRORS)
def test_factorize_matrix_errors(override, exc, match):
    kwargs = {"X": X, "Y": Y, "Wa": W, "rank": 2}
    kwargs.update(override)
    with pytest.raises(exc, match=match):
        factorize_matrix(**kwargs)


XC = torch.randn(2, 3, 6, 6)
WC = torch.randn(4, 3, 3, 3)

CONV_ERRORS = [
    pytest.param(
        {"X": torch.randn(3, 6)},
        ValueError,
        r"`X` must be a \[N, C, H, W\] tensor; got \[3, 6\]",
        id="X",
    ),
    pytest.param(
        {"Wa": torch.randn(4, 27)},
        ValueError,
        r"`Wa` must be a \[out, in, kh, kw\] kernel",
        id="Wa",
    ),
    pytest.param(
        {"Wa": torch.randn(4, 2, 3, 3)},
        ValueError,
        r"`Wa` expects 2 input channels but `X` has 3",
        id="channels",
    ),
    pytest.param(
        {"biasB": torch.randn(4)}, RuntimeError, r"got `biasB` but `Wb` is None", id="biasB"
    ),
    pytest.param(
        {"Wb": torch.randn(5, 3, 1, 1)},
        ValueError,
        r"`Wb` must be a \[out, 4, 1, 1\] kernel; got \[5, 3, 1, 1\]",
        id="Wb",
    ),
    pytest.param(
        {"biasA": torch.randn(3)},
        ValueError,
        r"`biasA` must have shape \[4\]; got \[3\]",
        id="biasA",
    ),
    pytest.param(
        {"Wb": torch.randn(5, 4, 1, 1), "biasB": torch.randn(4)},
        ValueError,
        r"`biasB` must have shape \[5\]",
        id="biasB-shape",
    ),
    pytest.param(
        {"groups": 3},
        NotImplementedError,
        r"`groups` must be 1 to factorize a convolution; got groups=3",
        id="groups",
    ),
    pytest.param(
        {"bias": True},
        ValueError,
        r"unknown `conv2d_kwargs` \['bias'\]; allowed: \['stride'",
        id="unknown",
    ),
    pytest.param(
        {"padding": "full"},
        ValueError,
        r"`padding` must be 'same', 'valid', an int or a pair; got 'full'",
        id="padding",
    ),
    pytest.param(
        {"stride": (1, 2, 3)},
        ValueError,
        r"`stride` must be an int or a pair of ints; got \(1, 2, 3\)",
        id="stride",
    ),
    pytest.param(
        {"padding_mode": "mirror"},
        ValueError,
        r"`padding_mode` must be one of \['zeros'",
        id="mode",
    ),
]


@pytest.mark.parametrize(("override", "exc", "match"), CONV_ERRORS)
def test_factorize_conv2d_errors(override, exc, match):
    kwargs = {"X": XC, "Wa": WC, "rank": 2}
    kwargs.update(override)
    with pytest.raises(exc, match=match):
        factorize_conv2d(**kwargs)


def test_valid_padding_and_unbatched_input():
    sol = factorize_conv2d(torch.randn(3, 6, 6), WC, rank=2, padding="valid")
    assert sol.Wa.shape == (2, 3, 3, 3)
    assert factorize_matrix(X, Y, W, rank=torch.tensor(2).item()).rank == 2


def test_same_solution_on_every_device(device):
    """Allocations follow the inputs, and the randomized test matrix is drawn on the
    CPU from the seed, so every device gets the same start."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(300, 40, generator=gen, dtype=F64)
    w = torch.randn(40, 40, generator=gen, dtype=F64)
    y = x @ w
    ref = factorize_matrix(x, y, w, rank=3, svd="randomized", seed=1)
    got = factorize_matrix(
        x.to(device), y.to(device), w.to(device), rank=3, svd="randomized", seed=1
    )
    assert got.Wa.device.type == device.type
    torch.testing.assert_close(got.Wa.cpu() @ got.Wb.cpu(), ref.Wa @ ref.Wb, atol=1e-8, rtol=1e-8)
    xc = torch.randn(3, 4, 10, 10, generator=gen, dtype=F64)
    conv = factorize_conv2d(xc.to(device), torch.randn(8, 4, 3, 3, dtype=F64).to(device), rank=2)
    assert conv.Wa.device.type == device.type


@pytest.mark.parametrize("init", ["whitened", "weights"])
def test_constant_inputs_and_rank_above_data_rank(init):
    x = torch.ones(50, 6, dtype=F64)
    w = torch.randn(6, 5, dtype=F64)
    y = x @ w + 0.1 * torch.randn(50, 5, dtype=F64)
    sol = factorize_matrix(x, y, w, rank=2, init=init)
    assert torch.isfinite(sol.Wa).all() and sol.Wa.abs().max() == 0  # nothing to explain
    assert sol.nmse == pytest.approx(true_nmse(y, predict(x, sol.Wa, sol.Wb, sol.bias)))
    few = torch.randn(3, 6, dtype=F64)  # 3 samples: centred rank 2 < requested rank 4
    sol = factorize_matrix(few, torch.randn(3, 5, dtype=F64), w, rank=4, init=init)
    assert sol.Wa.shape == (6, 4) and sol.nmse < 1e-12
