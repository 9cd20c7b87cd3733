"""Statistical test: sketch inner products track the exact metrics (count-sketch variance)."""

from __future__ import annotations

import math

import pytest
import torch

from gradsketch.sampling import SGMCMC

# Each test runs with the native scatter kernels and with torch's scatter.
pytestmark = pytest.mark.usefixtures("scatter_backend")

PAIRS = [
    ("scaled_grad", "scaled_grad"),
    ("noise", "noise"),
    ("localization", "localization"),
    ("scaled_grad", "noise"),
    ("unscaled_grad", "localization"),
]


def run(num_seeds: int, width: int, k: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, width), torch.nn.Tanh(), torch.nn.Linear(width, 2)
    )
    model = model.double()
    x = torch.randn(32, 6, dtype=torch.float64)
    y = torch.randint(0, 2, (32,))
    lr, nbeta, gamma = 1e-2, 20.0, 50.0
    w_init = [p.detach().clone() for p in model.parameters()]
    shift = [0.1 * torch.randn_like(p) for p in model.parameters()]
    sketches = {pair: [] for pair in PAIRS}
    exact = None
    for seed in range(num_seeds):
        for p, w in zip(model.parameters(), w_init):
            with torch.no_grad():
                p.copy_(w)
        opt = SGMCMC.sgld(
            model.parameters(),
            lr=lr,
            nbeta=nbeta,
            localization=gamma,
            sketch_dim=k,
            sketch_seed=seed,
            save_metrics=exact is None,
        )
        with torch.no_grad():  # move away from w0 so localization is non-zero
            for p, s in zip(model.parameters(), shift):
                p.add_(s)
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if exact is None:
            g = torch.cat([p.grad.flatten() for p in model.parameters()])
            d = torch.cat([s.flatten() for s in shift])
            gen = torch.Generator().manual_seed(11)
            xi = torch.cat(
                [
                    torch.normal(0.0, 1.0, size=p.shape, generator=gen, dtype=p.dtype).flatten()
                    for p in model.parameters()
                ]
            )
            vec = {
                "scaled_grad": lr / 2 * nbeta * g,
                "unscaled_grad": lr / 2 * nbeta * g,
                "localization": lr / 2 * gamma * d,
                "noise": math.sqrt(lr) * xi,
            }
        opt.step(noise_generator=torch.Generator().manual_seed(11))
        buf = opt.get_sketches().as_dict()
        if exact is None:
            exact = opt.get_metrics(dtype=torch.float64)
        for a, b in PAIRS:
            sketches[(a, b)].append(float(buf[a].double() @ buf[b].double()))
    for a, b in PAIRS:
        va, vb = vec[a], vec[b]
        true = float(va @ vb)
        if a == b:
            assert true == pytest.approx(float(getattr(exact, a)) ** 2, rel=1e-10)
        if (a, b) == ("scaled_grad", "noise"):
            assert true == pytest.approx(float(exact.dot_grad_noise), rel=1e-10)
        var = (float(va @ va) * float(vb @ vb) + true**2 - 2 * float((va**2 * vb**2).sum())) / k
        mean = sum(sketches[(a, b)]) / num_seeds
        tol = 5.0 * math.sqrt(var / num_seeds)
        assert abs(mean - true) <= tol, (a, b, mean, true, tol)


def test_sketch_inner_products_track_exact_metrics():
    """Over sketch seeds s, <S_s a, S_s b> is unbiased for <a, b> with
    Var = (|a|^2 |b|^2 + <a,b>^2 - 2 sum_i a_i^2 b_i^2) / k (CountSketch docstring).
    Seeds give independent sketches (counter-based hash), so the mean over
    N seeds has standard deviation sqrt(Var / N); by the CLT a deviation above
    5 standard deviations has probability < 1e-6 per pair. 100 seeds, k = 32,
    ~180 coordinates: fixed seeds, about a second."""
    run(num_seeds=100, width=20, k=32)


@pytest.mark.slow
def test_sketch_inner_products_track_exact_metrics_large():
    """Same derivation as the fast test, 1000 seeds on ~5k coordinates, k = 256."""
    run(num_seeds=1000, width=600, k=256)
