"""The calibrated LLC recipe against closed-form learning coefficients (slow).

Recipe (``benchmarks/llc_calibration.py``, where the study behind it is):
:func:`estimate_learning_coeff_calibrated` with its defaults at
``nbeta = 1000``, ``gamma = 1``: SGLD, pilots for the step, a burn-in of
diffusion time ``lr * steps = 0.02`` at 4 times that step, the draw step
re-measured on the spread chain for ``target_bias = 0.05``, then 500 steps
and 2000 draws. Every estimate runs on one thread.

Deep linear networks (Aoyagi 2024; the protocol of Furman & Lau 2024): a
teacher with Gaussian layers (std ``1 / sqrt(fan_in)``) whose middle layer is
cut to rank ``r``; noiseless data ``y = teacher(x)``, ``x ~ N(0, I)``; loss
``|f(x) - y|^2 / 2`` averaged over a batch of 64; the estimate is taken at
the teacher, so ``L(w*) = 0`` exactly.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from gradsketch.sampling import (
    deep_linear_learning_coefficient,
    estimate_learning_coeff_calibrated,
)


def teacher(widths: list[int], rank: int, seed: int) -> tuple[torch.nn.Sequential, int]:
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
        layer = torch.nn.Linear(fan_in, fan_out, bias=False)
        w = torch.randn(fan_out, fan_in, generator=gen, dtype=torch.float64) / math.sqrt(fan_in)
        if i == (len(widths) - 1) // 2:
            u, s, vh = torch.linalg.svd(w, full_matrices=False)
            w = (u[:, :rank] * s[:rank]) @ vh[:rank]
        with torch.no_grad():
            layer.weight.copy_(w)
        layers.append(layer)
    prod = torch.eye(widths[0], dtype=torch.float64)
    for layer in layers:
        prod = layer.weight.double() @ prod
    return torch.nn.Sequential(*layers), int(torch.linalg.matrix_rank(prod, rtol=1e-4))


def half_squared_error(model, batch):
    x, y = batch
    return 0.5 * (model(x) - y).square().sum(1).mean()


def calibrated(model, loader, evaluate, chains=1):
    """The recipe, on one thread (the chain length follows the calibrated step)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return estimate_learning_coeff_calibrated(
            model,
            loader,
            evaluate,
            nbeta=1000.0,
            localization=1.0,
            num_chains=chains,
            init_loss=0.0,
            seed=0,
            verbose=False,
        )
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("widths", "rank", "lam", "chains"),
    [
        ([20, 16, 12, 16, 20], 4, 112.0, 4),
        ([160, 128, 96, 128, 160], 32, 7168.0, 1),
        ([640, 500, 380, 500, 640], 128, 112662.0, 1),
    ],
    ids=["1024-params", "65536-params", "1020000-params"],
)
def test_deep_linear_llc_within_ten_percent(widths, rank, lam, chains):
    """The recipe's estimate is within 10% of Aoyagi's lambda.

    Error budget (measured in the study, see benchmarks/llc_calibration.py):

    * finite temperature: the exact tempered value E[nbeta K] under
      exp(-nbeta K - gamma |w - w*|^2 / 2), computed by blocked Gibbs
      sampling (each layer's conditional is Gaussian; the benchmark's
      ``--section gibbs``), is 1.7% below lambda at nbeta = 1000, gamma = 1
      for 1,024 parameters and 1.4% for 6,400;
    * discretization: the draws' diagnostic rho = eps E|nbeta grad L|^2 / (8 LLC)
      is checked to be <= 1.5 * 0.05 (the calibrated estimator reruns
      otherwise); the measured bias is 0.5-1 times rho, so at most +7.5%;
    * equilibration: after the burn-in's diffusion time 0.02 the draws'
      two halves differ by 1-2% at 262k-1M parameters (the fixed
      2000 + 2000 steps of the earlier recipe left 650k parameters at
      -9.8% then -6.7%, still rising, -8.2% in all);
    * Monte Carlo: SE = sd / sqrt(ESS) of the draws' nbeta L (ArviZ); the
      test requires 3 SE <= 5% of lambda, so noise alone cannot carry the
      estimate through the band and a pass is not luck. One chain of the
      1,024-parameter network has ESS ~ 20 of its 2000 draws (3 SE = 7%),
      so that case runs 4 chains; the larger ones have a relative spread
      of nbeta L far below 1% and pass with one.

    The 64-parameter network [5, 4, 3, 4, 5] is not pinned: lambda = 7 with
    fluctuations of the same order needs many chains; its Gibbs value is
    5.1% below lambda, one chain of the recipe gives +4.6% with halves 5%
    apart (the earlier recipe, 4 chains: -7.6%), too close to the band for
    a test that must not flake.

    The first two have opposite signs and each stays inside 10%; the band is
    the issue's target, not widened for the test. Seconds on one thread of
    a 2-core machine shared with other jobs (load average ~7): 77 (1k, 4
    chains), 25 (65k) and 415 (1M; ~8,700 steps of ~12 ms unloaded, so
    about 2 minutes on an idle core).
    """
    model, true_rank = teacher(widths, rank, seed=0)
    assert true_rank == rank
    assert deep_linear_learning_coefficient(widths, true_rank) == lam
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4096, widths[0], generator=gen)
    with torch.no_grad():
        y = model(x)
    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)
    out = calibrated(model, loader, half_squared_error, chains)
    assert out["llc/step_bias_rel"] <= 0.075
    trace = out["nbeta"] * out["loss/trace"]
    se = float(np.std(trace)) / math.sqrt(out["llc/ess"])
    assert 3 * se <= 0.05 * lam, (se, out["llc/ess"])
    assert abs(out["llc/mean"] - lam) <= 0.1 * lam, (out["llc/mean"], lam)


class ReplicatedRRR(torch.nn.Module):
    """``copies`` independent ``B A`` at the zero map (population loss); lambda adds up."""

    def __init__(self, copies: int, m: int, h: int, n: int) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(copies, h, m))
        self.b = torch.nn.Parameter(torch.zeros(copies, n, h))


def rrr_loss(model: ReplicatedRRR, batch) -> torch.Tensor:
    return 0.5 * torch.bmm(model.b, model.a).square().sum()


@pytest.mark.slow
def test_reduced_rank_regression_llc_within_ten_percent():
    """Reduced-rank regression (5, 3, 5) at the zero map, lambda = 6.5 (Aoyagi & Watanabe),
    32 independent copies (lambda = 208), with the recipe of the deep linear test.

    The zero map is the most singular point (K is quartic there), so the
    pilots from w* see about a fifth of the full chain's bias: this is the
    case the draw step's re-measurement on the spread chain exists for.
    Error budget: the exact tempered value at nbeta = 1000, gamma = 1 is
    6.21 per copy, 4.5% below lambda (the Gibbs sampler of
    tests/sampling/test_rrr.py, 64 chains x 2000 sweeps, SE 0.007); the
    discretization bias is positive and at most ~1.5 * 0.05 after the check;
    Monte Carlo as in the deep linear test (3 SE <= 5% of lambda).
    """
    copies, lam = 32, 6.5 * 32
    out = calibrated(
        ReplicatedRRR(copies, 5, 3, 5),
        DataLoader(TensorDataset(torch.zeros(8, 1)), batch_size=8),
        rrr_loss,
    )
    assert out["llc/step_bias_rel"] <= 0.075
    trace = out["nbeta"] * out["loss/trace"]
    se = float(np.std(trace)) / math.sqrt(out["llc/ess"])
    assert 3 * se <= 0.05 * lam, (se, out["llc/ess"])
    assert abs(out["llc/mean"] - lam) <= 0.1 * lam, (out["llc/mean"], lam)
