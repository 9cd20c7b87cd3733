"""FactorizedLinear / FactorizedConv2d: built from trained weights, rank changes, state_dict."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gradsketch.factorize import (
    FACTORIZED_MODULES,
    FactorizedConv2d,
    FactorizedLinear,
    LowRankSolution,
    factorizing_could_speedup,
    max_rank_with_possible_speedup,
)
from helpers.factorize import low_rank, true_nmse


def _linear_with_rank(n_in: int, n_out: int, r: int, *, bias: bool = True) -> nn.Linear:
    lin = nn.Linear(n_in, n_out, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(low_rank(n_out, n_in, r, dtype=torch.float32))
    return lin


@pytest.mark.parametrize("calibrated", [False, True], ids=["svd", "calibrated"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_from_linear_low_rank_weight_keeps_function(calibrated, bias):
    lin = _linear_with_rank(48, 40, 6, bias=bias)
    x = torch.randn(300, 48)
    fact = FactorizedLinear.from_linear(lin, 6, calibration_input=x if calibrated else None)
    assert fact.latent_features == 6 and (fact.module1.bias is not None) == bias
    torch.testing.assert_close(fact(x), lin(x), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("calibrated", [False, True], ids=["svd", "calibrated"])
def test_from_conv2d_low_rank_kernel_keeps_function(calibrated):
    conv = nn.Conv2d(8, 16, 3, stride=2, padding=1)
    with torch.no_grad():
        conv.weight.copy_(low_rank(16, 72, 4, dtype=torch.float32).reshape(16, 8, 3, 3))
    x = torch.randn(4, 8, 12, 12)
    fact = FactorizedConv2d.from_conv2d(conv, 4, calibration_input=x if calibrated else None)
    assert fact.latent_channels == 4 and fact.kernel_size == (3, 3)
    torch.testing.assert_close(fact(x), conv(x), atol=1e-4, rtol=1e-4)


def test_calibrated_beats_plain_svd_on_correlated_inputs():
    torch.manual_seed(0)
    lin = nn.Linear(32, 32)
    x = torch.randn(500, 32) * torch.logspace(0, -2, 32)  # anisotropic inputs
    plain = FactorizedLinear.from_linear(lin, 4)
    calib = FactorizedLinear.from_linear(lin, 4, calibration_input=x)
    y = lin(x).detach()
    assert true_nmse(y, calib(x).detach()) < true_nmse(y, plain(x).detach())


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_set_rank_and_solutions(kind):
    torch.manual_seed(0)
    if kind == "linear":
        fact = FactorizedLinear.from_linear(nn.Linear(40, 30), 12)
        x = torch.randn(200, 40)
    else:
        fact = FactorizedConv2d.from_conv2d(nn.Conv2d(10, 12, 3, padding=1), 8)
        x = torch.randn(6, 10, 7, 7)
    out_shape = fact(x).shape
    sol = fact.solution_for_rank(x, 4)
    assert isinstance(sol, LowRankSolution) and sol.rank == 4
    fact.set_rank(x, 6)
    assert fact.latent_size == 6 and fact(x).shape == out_shape
    fact.apply_solution(fact.solution_for_rank(x, 3))
    assert fact.latent_size == 3 and fact(x).shape == out_shape
    fact.set_rank(x, 3)  # same rank: no-op
    assert fact.latent_size == 3
    assert fact.should_factorize(2) and not fact.should_factorize(3)


def test_set_rank_without_bias_keeps_no_bias():
    fact = FactorizedLinear.from_linear(nn.Linear(20, 20, bias=False), 6)
    fact.set_rank(torch.randn(100, 20), 3)
    assert fact.module1.bias is None and fact.latent_features == 3


def test_set_rank_on_batched_linear_inputs():
    """Leading dimensions are rows: `set_rank` on ``[4, 25, 16]`` inputs gives the same
    rank-2 factors (float64) as on the ``[100, 16]`` rows, and the module maps batched
    inputs as it maps the rows."""
    torch.manual_seed(0)
    linear = nn.Linear(16, 16).double()
    x = torch.randn(4, 25, 16, dtype=torch.float64)
    batched = FactorizedLinear.from_linear(linear, 6)
    rows = FactorizedLinear.from_linear(linear, 6)
    batched.set_rank(x, 2)
    rows.set_rank(x.reshape(100, 16), 2)
    assert batched.latent_size == rows.latent_size == 2
    got, want = batched.state_dict(), rows.state_dict()
    assert list(got) == list(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-12, msg=name)
    torch.testing.assert_close(batched(x), rows(x.reshape(100, 16)).reshape(4, 25, 16))
    # Rank 2 of a generic 16x16 map changes the outputs: the refit really happened.
    assert not torch.allclose(batched(x), linear(x), atol=1e-3)


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_state_dict_round_trip_at_any_rank(kind):
    torch.manual_seed(0)
    if kind == "linear":
        make = lambda: FactorizedLinear(24, 24, latent_features=8)  # noqa: E731
        x = torch.randn(50, 24)
    else:
        make = lambda: FactorizedConv2d(6, 12, 3, latent_channels=4, padding=1)  # noqa: E731
        x = torch.randn(3, 6, 8, 8)
    src = make()
    fresh = make()
    fresh.load_state_dict(src.state_dict())
    torch.testing.assert_close(fresh(x), src(x))
    src.set_rank(x, 2)
    again = make()
    again.load_state_dict(src.state_dict())
    assert again.latent_size == 2
    torch.testing.assert_close(again(x), src(x))


def test_keeps_device_dtype_and_module_api():
    lin = nn.Linear(16, 8).double()
    fact = FactorizedLinear.from_linear(lin, 3)
    assert fact.module0.weight.dtype == torch.float64
    assert (fact.in_features, fact.out_features) == (16, 8)
    conv = FactorizedConv2d(4, 8, (3, 1), latent_channels=0.5, stride=2)
    assert (conv.in_channels, conv.out_channels, conv.latent_channels) == (4, 8, 2)
    assert "16 -> 3 -> 8" in repr(fact)


@pytest.mark.parametrize(
    ("n_in", "n_out", "kernel", "expected"),
    [(512, 512, None, 255), (1024, 256, None, 204), (64, 64, 3, 57), (3, 64, (7, 7), 44)],
    ids=["square", "wide", "conv3", "stem7"],
)
def test_max_allowed_latent_size(n_in, n_out, kernel, expected):
    fan_in = n_in * (math.prod((kernel, kernel) if isinstance(kernel, int) else kernel or (1,)))
    assert expected == math.ceil(fan_in * n_out / (fan_in + n_out) - 1)
    assert max_rank_with_possible_speedup(n_in, n_out, kernel) == expected
    if kernel is None:
        assert FactorizedLinear.max_allowed_latent_features(n_in, n_out) == expected
        assert FactorizedLinear.max_allowed_latent_channels(n_in, n_out) == expected  # Composer
    else:
        assert FactorizedConv2d.max_allowed_latent_channels(n_in, n_out, kernel) == expected
        assert FactorizedConv2d.max_allowed_latent_features(n_in, n_out, kernel) == expected


def test_factorizing_could_speedup():
    assert factorizing_could_speedup(nn.Linear(512, 512), 255)
    assert not factorizing_could_speedup(nn.Linear(512, 512), 256)
    assert not factorizing_could_speedup(nn.Conv2d(8, 8, 3, groups=2), 2)
    assert not factorizing_could_speedup(nn.Tanh(), 2)
    assert factorizing_could_speedup(FactorizedLinear(64, 64, latent_features=8), 4)


def test_registry_is_keyed_by_module_type():
    assert FACTORIZED_MODULES[nn.Linear] is FactorizedLinear
    assert FACTORIZED_MODULES[nn.Conv2d] is FactorizedConv2d
    assert FactorizedLinear.replaces is nn.Linear


# ----------------------------------------------------------------- error paths


def test_latent_too_large_is_refused():
    with pytest.raises(ValueError, match=r"`latent_features`=40 .* must be <= 31"):
        FactorizedLinear(64, 64, latent_features=40)
    with pytest.raises(ValueError, match=r"`latent_channels`=60 .* must be <= 57"):
        FactorizedConv2d(64, 64, 3, latent_channels=60)


def test_grouped_and_unknown_conv_arguments_are_refused():
    with pytest.raises(NotImplementedError, match=r"`groups` must be 1; got groups=2"):
        FactorizedConv2d(8, 8, 3, latent_channels=2, groups=2)
    with pytest.raises(ValueError, match=r"unknown keyword\(s\) \['kernel'\]"):
        FactorizedConv2d(8, 8, 3, latent_channels=2, kernel=3)
    with pytest.raises(NotImplementedError, match="`groups` must be 1"):
        FactorizedConv2d.from_conv2d(nn.Conv2d(8, 8, 3, groups=4), 2)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match=r"`in_size` must be a positive integer, got 0"):
        FactorizedLinear(0, 4, latent_features=1)
    with pytest.raises(ValueError, match=r"`latent_features` must be an int >= 1"):
        FactorizedLinear(16, 16, latent_features=-1)


def test_set_rank_above_current_is_refused():
    fact = FactorizedLinear(32, 32, latent_features=4)
    with pytest.raises(ValueError, match=r"`rank`=5 exceeds the current latent_features=4"):
        fact.set_rank(torch.randn(10, 32), 5)


def test_apply_single_matrix_or_foreign_bias_is_refused():
    fact = FactorizedLinear(8, 8, bias=False, latent_features=2)
    single = LowRankSolution(torch.randn(8, 8), None, None, rank=-1)
    with pytest.raises(ValueError, match=r"`solution` must hold a pair \(Wa, Wb\); got rank=-1"):
        fact.apply_solution(single)
    biased = LowRankSolution(torch.randn(8, 2), torch.randn(2, 8), torch.ones(8), rank=2)
    with pytest.raises(ValueError, match="built with bias=False"):
        fact.apply_solution(biased)


def test_wrong_module_type_is_refused():
    with pytest.raises(TypeError, match=r"`module` must be a torch.nn.modules.linear.Linear"):
        FactorizedLinear.from_linear(nn.Conv2d(4, 4, 1), 2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"`module` must be a .*Conv2d; got Linear"):
        FactorizedConv2d.from_conv2d(nn.Linear(4, 4), 2)  # type: ignore[arg-type]
