"""Calibration of the LLC estimator on models whose learning coefficient is known.

Ground truth (``gradsketch.sampling._truth``): deep linear networks (Aoyagi
2024; the protocol of Furman & Lau, "Estimating the local learning
coefficient at scale", 2024), reduced-rank regression at the zero map
(Aoyagi & Watanabe 2005) and normal crossings.

Deep linear networks: a teacher ``x -> W_L ... W_1 x`` with Gaussian layers
(std ``1 / sqrt(fan_in)``) and its middle layer cut to rank ``r``; noiseless
data ``x ~ N(0, I)``, ``y = teacher(x)``; the loss ``|f(x) - y|^2 / 2``
averaged over the batch, so ``L(w*) = 0`` on every batch and ``L`` is the
population ``K = |W - W*|_F^2 / 2`` up to the sample covariance. The
estimate is taken at the teacher (``w* = teacher``).

Sections (each run stays under about a minute on 2 cores):

* ``truth``: the chosen recipe on every case -> one JSON line per case
  (truth, estimate, relative error, settings, seconds).
* ``sweep``: one mid-size network; step size, localization, nbeta, chain
  length and preconditioner varied one at a time around the recipe.
* ``gibbs``: exact blocked Gibbs sampling of the tempered posteriors of the two
  smallest networks: the finite-temperature gap, with no step size.
* ``plot``: reads the JSON lines written by ``truth`` and draws estimate vs
  truth with the 10% band to ``benchmarks/llc_calibration.png``.

The recipe: ``nbeta = 1000``, ``gamma = 1``, SGLD, 2000 burn-in steps and
2000 draws, ``lr`` from
:func:`gradsketch.sampling.estimate_learning_coeff_calibrated` with
``target_bias=0.05`` (pilots aim at half of it, the full chain's
discretization-bias diagnostic is checked and the run repeated with a
rescaled step when it is above 1.5 times the target).

Run: ``python benchmarks/llc_calibration.py --section truth [--max-params 70000]
--out benchmarks/llc_calibration.jsonl`` then ``--section plot``.

Results (``benchmarks/llc_calibration.jsonl``; 2-core shared CPU with a load
average of 15-20 for most rows (3-6 for the 4-chain, 262k and 650k rows), so
the seconds are upper bounds; one chain unless stated):

====================================  =======  ========  ========  =======  ======  =====
case                                  params   lambda    estimate  error    rho     s
====================================  =======  ========  ========  =======  ======  =====
dln [5,4,3,4,5] r=1                   64       7         6.92      -1.1%    0.018   33
dln [5,4,3,4,5] r=1 (4 chains)        64       7         6.47      -7.6%    0.029   12
dln [20,16,12,16,20] r=4              1,024    112       112.2     +0.2%    0.021   32
dln [50,40,30,40,50] r=10             6,400    700       695.6     -0.6%    0.043   32
dln [160,128,96,128,160] r=32         65,536   7,168     7,155     -0.2%    0.060   171
dln [320,256,192,256,320] r=64        262,144  28,672    27,515    -4.0%    0.051   43
dln [512,400,300,400,512] r=100       649,600  71,200    65,344    -8.2%    0.039   176
rrr (5,3,5) r=0, 32 copies            960      208       203.8     -2.0%    0.036   32
crossing [1,1] (4 chains)             2        0.5       0.402     -19.6%   0.058   132
crossing [1,2] (4 chains)             2        0.25      0.234     -6.3%    0.047   232
====================================  =======  ========  ========  =======  ======  =====

The crossings miss lambda because the tempered target itself does: the
exact ``E[nbeta K]`` at nbeta = 1000, gamma = 1 (quadrature) is 0.390 for
[1,1] (-22%: multiplicity 2, the gap decays like 1 / log nbeta) and 0.225
for [1,2] (-10%); the sampler is within 3-4% of those. Exact blocked Gibbs
sampling of the deep linear posteriors (every layer's conditional is
Gaussian; ``--section gibbs``) puts the tempered targets at -5.1% (64
params, 6.65 +- 0.05) and -1.7% (1,024, 110.1 +- 0.1) of lambda, and at
-1.4% for the 6,400-parameter shape (on another draw of its teacher); for
the reduced-rank regression (the Gibbs sampler of tests/sampling/test_rrr.py)
at -4.5%. The 64-parameter row is a lucky chain: with 4 chains the same
recipe gives 6.47 (-7.6%, SE 0.17), 2.7% below its Gibbs value; the
smallest network is the least equilibrated after 2000 + 2000 steps and is
not pinned by a slow test.

Sweep on the 1,024-parameter network (``--section sweep``), one knob moved
from the recipe (calibrated lr = 1e-5, truth 112):

=====================  ========  =======  =====================================
knob                   estimate  error    reading
=====================  ========  =======  =====================================
recipe                 112.2     +0.2%
lr x 0.25              101.3     -9.6%    chain not spread in 4000 steps
lr x 4 (rho = 0.23)    141.4     +26%     discretization bias ~ rho
gamma 10               110.0     -1.8%
gamma 100              96.8      -13.5%   localization cuts the posterior
nbeta 100              106.9     -4.6%    larger finite-temperature gap
nbeta 10000            112.6     +0.5%    lr recalibrated to 1e-6
chain 500 + 500        93.2      -16.8%   not equilibrated
chain 8000 + 4000      112.1     +0.1%    rho grows to 0.037
rmsprop_sgld eps=1     112.4     +0.4%    G ~ 1: about plain SGLD
=====================  ========  =======  =====================================

What the study says: (1) the step size is the setting that matters and it
must be chosen per model: the calibrated steps span 4.7e-6 to 1.4e-4 here,
and a factor 4 either way costs 10-26%; the bias diagnostic predicts the
upward bias (measured bias ~ 0.5-1.1 rho). (2) Short pilots from w*
underestimate the full chain's rho by 2-5x on singular models (the chain
has not spread yet), hence the half-target pilots and the verification
rerun. (3) gamma <= 10 and nbeta >= 1000 keep the finite-temperature gap of
these models under 5%, except for multiplicity-2 singularities (crossing
[1,1]) whose gap is 20% at any practical nbeta. (4) Chains drift slowly
upward along the flat (rescaling) directions at a fixed step: on the 6,400
network a chain at lr = 1e-5 sits at the Gibbs value (~690) from step 2000
to 6000 and reaches ~765 (+9%) by step 8000. The diagnostic's rho grows
along (0.021 at 4,000 steps, 0.037 at 12,000 on the 1,024 network), and the
rerun check bounds it; a smaller step removes the drift but needs
proportionally more steps, so the recipe fixes the chain length instead.
(5) The fixed 2000 + 2000 steps stop being enough from ~250k parameters:
the calibrated step falls with width (1e-5 at 1k, 4.7e-6 at 65k, 2.4e-6 at
262k, 1.3e-6 at 650k parameters) and the chain covers proportionally less
of the singular directions, so the estimate is still rising (650k: first
half -9.8%, second half -6.7%). Scaling the chain as ``lr * steps = 0.02``
for both burn-in and draws (what 2000 steps are at lr = 1e-5) is the
natural rule; at 650k that is ~15,000 + 15,000 steps, ~20 minutes here,
and was not run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import setup_torch

from gradsketch.sampling import (
    StepSizeDiagnostic,
    deep_linear_learning_coefficient,
    estimate_learning_coeff_calibrated,
    estimate_learning_coeff_with_summary,
    normal_crossing_learning_coefficient,
    reduced_rank_learning_coefficient,
)

HERE = Path(__file__).resolve().parent

#: The recipe every ``truth`` row uses (see the module docstring).
RECIPE = dict(
    nbeta=1000.0,
    gamma=1.0,
    target_bias=0.05,
    burnin_time=0.02,
    boost=4.0,
    burnin=500,
    draws=2000,
    chains=1,
    batch=64,
)

#: (widths, teacher rank of the middle layer) from 64 to ~1M parameters.
DLN_CASES: list[tuple[list[int], int]] = [
    ([5, 4, 3, 4, 5], 1),
    ([20, 16, 12, 16, 20], 4),
    ([50, 40, 30, 40, 50], 10),
    ([160, 128, 96, 128, 160], 32),
    ([320, 256, 192, 256, 320], 64),
    ([512, 400, 300, 400, 512], 100),
    ([640, 500, 380, 500, 640], 128),
]


def emit(row: dict[str, Any], out: Path | None) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    if out is not None:
        with out.open("a") as f:
            f.write(line + "\n")


# ----------------------------------------------------------------- models
def deep_linear_teacher(widths: list[int], rank: int, seed: int) -> tuple[torch.nn.Sequential, int]:
    """Teacher DLN with its middle layer cut to ``rank``; returns it and its product's rank."""
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
    model = torch.nn.Sequential(*layers)
    prod = torch.eye(widths[0], dtype=torch.float64)
    for layer in layers:
        prod = layer.weight.double() @ prod
    # float32 rounding leaves singular values ~1e-8 where the cut made zeros.
    true_rank = int(torch.linalg.matrix_rank(prod, rtol=1e-4))
    return model, true_rank


def half_squared_error(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return 0.5 * (model(x) - y).square().sum(1).mean()


def dln_problem(
    widths: list[int], rank: int, seed: int, batch: int, n: int = 4096
) -> tuple[torch.nn.Module, DataLoader, float]:
    model, true_rank = deep_linear_teacher(widths, rank, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(n, widths[0], generator=gen)
    with torch.no_grad():
        y = model(x)
    loader = DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True)
    return model, loader, deep_linear_learning_coefficient(widths, true_rank)


class ReplicatedRRR(torch.nn.Module):
    """``copies`` independent ``B A`` at the zero map; population loss; lambda adds."""

    def __init__(self, copies: int, m: int, h: int, n: int) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(copies, h, m))
        self.b = torch.nn.Parameter(torch.zeros(copies, n, h))


def rrr_loss(model: ReplicatedRRR, batch: Any) -> torch.Tensor:
    return 0.5 * torch.bmm(model.b, model.a).square().sum()


class Crossing(torch.nn.Module):
    def __init__(self, powers: list[int]) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(len(powers)))
        self.powers = powers


def crossing_loss(model: Crossing, batch: Any) -> torch.Tensor:
    out = torch.ones(())
    for wi, k in zip(model.w, model.powers):
        out = out * wi ** (2 * k)
    return out


def crossing_tempered(powers: list[int], nbeta: float, gamma: float, grid: int = 4001) -> float:
    """Exact ``E[nbeta K]`` under ``exp(-nbeta K - gamma |w|^2 / 2)`` by quadrature (2-D grid)."""
    axis = np.linspace(-8.0 / math.sqrt(gamma), 8.0 / math.sqrt(gamma), grid)
    w1, w2 = np.meshgrid(axis, axis, indexing="ij")
    k = w1 ** (2 * powers[0]) * w2 ** (2 * powers[1])
    log_p = -nbeta * k - gamma * (w1**2 + w2**2) / 2
    p = np.exp(log_p - log_p.max())
    return float((nbeta * k * p).sum() / p.sum())


def dummy_loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.zeros(8, 1)), batch_size=8)


# ---------------------------------------------------------------- running
def estimate(
    case: str,
    model: torch.nn.Module,
    loader: DataLoader,
    evaluate: Any,
    truth: float,
    *,
    nbeta: float,
    gamma: float,
    target_bias: float,
    burnin_time: float,
    boost: float,
    burnin: int,
    draws: int,
    chains: int,
    lr: float | None = None,
    method: str = "sgld",
    seed: int = 0,
    extra: dict[str, Any] | None = None,
    **info: Any,
) -> dict[str, Any]:
    """Estimate (calibrated and verified unless ``lr`` is given); return the result row.

    With ``lr`` given, the chain runs ``ceil(burnin_time / lr) + burnin`` burn-in
    steps at ``lr`` (the recipe's diffusion time, no boost).
    """
    start = time.perf_counter()
    runs = 1
    boosted = 0
    if lr is None:
        out = estimate_learning_coeff_calibrated(
            model,
            loader,
            evaluate,
            nbeta=nbeta,
            localization=gamma,
            target_bias=target_bias,
            burnin_time=burnin_time,
            burnin_boost=boost,
            num_burnin_steps=burnin,
            num_draws=draws,
            num_chains=chains,
            init_loss=0.0,
            seed=seed,
            verbose=False,
        )
        lr, rho, runs = out["llc/lr"], out["llc/step_bias_rel"], out["llc/runs"]
        boosted = out["llc/burnin_steps"]
    else:
        burnin += math.ceil(burnin_time / lr) if burnin_time > 0 else 0
        diag = StepSizeDiagnostic() if method == "sgld" else None
        out = estimate_learning_coeff_with_summary(
            model,
            loader,
            evaluate=evaluate,
            sampling_method=method,
            optimizer_kwargs=dict(lr=lr, nbeta=nbeta, localization=gamma, **(extra or {})),
            num_draws=draws,
            num_chains=chains,
            num_burnin_steps=burnin,
            init_loss=0.0,
            seed=seed,
            verbose=False,
            callbacks=[diag] if diag is not None else (),
        )
        rho = float(out["llc/step_bias"]) / float(out["llc/mean"]) if diag is not None else None
    llc = float(out["llc/mean"])
    trace = out["nbeta"] * out["loss/trace"]
    return dict(
        case=case,
        params=sum(p.numel() for p in model.parameters()),
        truth=truth,
        estimate=llc,
        rel_error=llc / truth - 1.0,
        first_half=float(trace[:, : draws // 2].mean()),
        second_half=float(trace[:, draws // 2 :].mean()),
        step_bias=rho,
        lr=lr,
        runs=runs,
        nbeta=nbeta,
        gamma=gamma,
        method=method,
        burnin_time=burnin_time,
        boost=boost if boosted else None,
        boosted_steps=boosted,
        burnin=burnin,
        draws=draws,
        chains=chains,
        ess=float(out["llc/ess"]),
        seconds=round(time.perf_counter() - start, 2),
        **info,
    )


def truth_section(
    max_params: int,
    out: Path | None,
    seed: int,
    min_params: int = 0,
    potentials: bool = True,
    chains: int | None = None,
) -> None:
    recipe = dict(RECIPE)
    if chains is not None:
        recipe["chains"] = chains
    batch = int(recipe.pop("batch"))
    for widths, rank in DLN_CASES:
        params = sum(a * b for a, b in itertools.pairwise(widths))
        if not min_params <= params <= max_params:
            continue
        model, loader, truth = dln_problem(widths, rank, seed, batch)
        emit(
            estimate(
                f"dln {widths} r={rank}",
                model,
                loader,
                half_squared_error,
                truth,
                seed=seed,
                widths=widths,
                **recipe,  # type: ignore[arg-type]
            ),
            out,
        )
    if not potentials:
        return
    # Reduced-rank regression (5, 3, 5) at the zero map: 32 independent copies.
    copies = 32
    lam = reduced_rank_learning_coefficient(5, 3, 5)
    emit(
        estimate(
            "rrr (5,3,5) r=0 x32",
            ReplicatedRRR(copies, 5, 3, 5),
            dummy_loader(),
            rrr_loss,
            copies * lam,
            seed=seed,
            **recipe,  # type: ignore[arg-type]
        ),
        out,
    )
    for powers in ([1, 1], [1, 2]):
        emit(
            estimate(
                f"crossing {powers}",
                Crossing(powers),
                dummy_loader(),
                crossing_loss,
                normal_crossing_learning_coefficient(powers),
                seed=seed,
                tempered=crossing_tempered(powers, recipe["nbeta"], recipe["gamma"]),
                **{**recipe, "chains": 4},  # type: ignore[arg-type]
            ),
            out,
        )


#: Sweep knobs: name -> changes to the recipe. A given ``lr`` fixes the step
#: (no calibration, no boost; burn-in ``burnin_time / lr + burnin`` steps);
#: ``lr_factor`` scales the recipe's calibrated step of the same network.
SWEEP_KNOBS: dict[str, dict[str, Any]] = {
    "lr x0.25": dict(lr_factor=0.25),
    "lr x4": dict(lr_factor=4.0),
    "gamma 0.1": dict(gamma=0.1),
    "gamma 10": dict(gamma=10.0),
    "gamma 100": dict(gamma=100.0),
    "nbeta 100": dict(nbeta=100.0),
    "nbeta 10000": dict(nbeta=1e4),
    "draws 500": dict(draws=500),
    "draws 8000": dict(draws=8000),
    "burnin_time 0.005": dict(burnin_time=0.005),
    "burnin_time 0.08": dict(burnin_time=0.08),
    "boost 1": dict(boost=1.0),
    "boost 16": dict(boost=16.0),
    "no boosted burn-in, 2000 steps": dict(burnin_time=0.0, burnin=2000),
    "rmsprop_sgld": dict(method="rmsprop_sgld", lr_factor=1.0),
    "rmsprop_sgld lr/10": dict(method="rmsprop_sgld", lr_factor=0.1),
    "adam_sgld": dict(method="adam_sgld", lr_factor=1.0),
    "adam_sgld lr/10": dict(method="adam_sgld", lr_factor=0.1),
}


def sweep_section(out: Path | None, seed: int, case: int, knobs: list[str] | None) -> None:
    """One knob at a time around the recipe, on ``DLN_CASES[case]``."""
    widths, rank = DLN_CASES[case]
    recipe = dict(RECIPE)
    batch = int(recipe.pop("batch"))
    model, loader, truth = dln_problem(widths, rank, seed, batch)
    name = f"sweep dln {widths}"
    base = estimate(name, model, loader, half_squared_error, truth, seed=seed, **recipe)  # type: ignore[arg-type]
    if knobs is None or "recipe" in knobs:
        emit({**base, "knob": "recipe"}, out)
    for knob, change in SWEEP_KNOBS.items():
        if knobs is not None and knob not in knobs:
            continue
        kwargs: dict[str, Any] = {**recipe, **change}
        factor = kwargs.pop("lr_factor", None)
        if factor is not None:
            kwargs["lr"] = base["lr"] * factor
        row = estimate(name, model, loader, half_squared_error, truth, seed=seed, **kwargs)
        emit({**row, "knob": knob}, out)


def tempered_gibbs(
    widths: list[int],
    rank: int,
    nbeta: float,
    gamma: float,
    *,
    chains: int = 8,
    sweeps: int = 400,
    seed: int = 0,
) -> tuple[float, float]:
    """Exact ``E[nbeta K]`` of the tempered, localized DLN posterior by blocked Gibbs sampling.

    ``K = |W_L ... W_1 - W*|_F^2 / 2`` (the population loss of the benchmark's
    data). Given the other layers, ``W_j`` enters linearly through
    ``P W_j Q`` (``P``, ``Q`` the products after and before it), so its
    conditional under ``exp(-nbeta K - gamma |W - W_teacher|^2 / 2)`` is
    Gaussian with precision ``nbeta (P^T P kron Q Q^T) + gamma I`` (row-major
    vec) and linear term ``nbeta P^T W* Q^T + gamma W_j,teacher``. No step
    size: this is the target SGLD's estimate approaches. Returns the mean over
    chains and sweeps after the first fifth, and its standard error over chains.
    """
    model, _ = deep_linear_teacher(widths, rank, seed)
    centre = [layer.weight.detach().double() for layer in model]
    target = torch.eye(widths[0], dtype=torch.float64)
    for w in centre:
        target = w @ target
    gen = torch.Generator().manual_seed(seed + 7)
    ws = [w.expand(chains, *w.shape).clone() for w in centre]
    values = []
    for _ in range(sweeps):
        for j, w0 in enumerate(centre):
            q = torch.eye(widths[0], dtype=torch.float64).expand(chains, -1, -1)
            for w in ws[:j]:
                q = w @ q
            p = torch.eye(widths[-1], dtype=torch.float64).expand(chains, -1, -1)
            for w in ws[j + 1 :][::-1]:
                p = p @ w
            rows, cols = w0.shape
            size = rows * cols
            prec = nbeta * torch.einsum("cij,ckl->cikjl", p.mT @ p, q @ q.mT).reshape(
                chains, size, size
            ) + gamma * torch.eye(size, dtype=torch.float64)
            lin = nbeta * (p.mT @ target @ q.mT).reshape(chains, size) + gamma * w0.reshape(1, -1)
            chol = torch.linalg.cholesky(prec)
            mean = torch.cholesky_solve(lin.unsqueeze(-1), chol).squeeze(-1)
            z = torch.randn(chains, size, 1, generator=gen, dtype=torch.float64)
            noise = torch.linalg.solve_triangular(chol.mT, z, upper=True).squeeze(-1)
            ws[j] = (mean + noise).reshape(chains, rows, cols)
        prod = torch.eye(widths[0], dtype=torch.float64).expand(chains, -1, -1)
        for w in ws:
            prod = w @ prod
        values.append((nbeta * 0.5 * (prod - target).square().sum((1, 2))).numpy())
    trace = np.stack(values, axis=1)[:, sweeps // 5 :]
    return float(trace.mean()), float(trace.mean(axis=1).std(ddof=1) / math.sqrt(chains))


def gibbs_section(out: Path | None, seed: int) -> None:
    """The finite-temperature gap of the small networks at the recipe's nbeta and gamma."""
    for widths, rank in DLN_CASES[:2]:
        start = time.perf_counter()
        mean, se = tempered_gibbs(widths, rank, RECIPE["nbeta"], RECIPE["gamma"], seed=seed)
        _, true_rank = deep_linear_teacher(widths, rank, seed)
        lam = deep_linear_learning_coefficient(widths, true_rank)
        emit(
            dict(
                case=f"gibbs dln {widths} r={rank}",
                truth=lam,
                tempered=mean,
                se=se,
                gap=mean / lam - 1.0,
                nbeta=RECIPE["nbeta"],
                gamma=RECIPE["gamma"],
                knob="gibbs",
                seconds=round(time.perf_counter() - start, 2),
            ),
            out,
        )


def plot_section(path: Path, png: Path) -> None:
    """Left: estimate vs truth (log-log). Right: relative error with the ±10% band."""
    from gradsketch._plotting import new_figure, save_figure

    every = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in every if r.get("knob") is None]
    fig, (ax, rel) = new_figure(width=12.0, height=5.0, ncols=2)
    truths = np.array([r["truth"] for r in rows])
    grid = np.geomspace(truths.min() / 2, truths.max() * 2, 100)
    ax.plot(grid, grid, color="black", lw=1, label="estimate = truth")
    ax.fill_between(grid, 0.9 * grid, 1.1 * grid, color="tab:green", alpha=0.3, label="±10%")
    rel.axhline(0.0, color="black", lw=1)
    rel.axhspan(-10, 10, color="tab:green", alpha=0.2, label="±10%")
    for marker, prefix in (("o", "dln"), ("s", "rrr"), ("^", "crossing")):
        sel = [r for r in rows if r["case"].startswith(prefix)]
        if not sel:
            continue
        x = [r["truth"] for r in sel]
        ax.scatter(x, [r["estimate"] for r in sel], marker=marker, zorder=3, label=prefix)
        rel.scatter(x, [100 * r["rel_error"] for r in sel], marker=marker, zorder=3, label=prefix)
        for r in sel:
            rel.annotate(
                f"{r['params']:,} p",
                (r["truth"], 100 * r["rel_error"]),
                textcoords="offset points",
                xytext=(6, 4),
                fontsize=7,
            )
    tempered = [r for r in every if r.get("tempered") is not None]
    if tempered:
        rel.scatter(
            [r["truth"] for r in tempered],
            [100 * (r["tempered"] / r["truth"] - 1) for r in tempered],
            marker="x",
            color="black",
            zorder=4,
            label="exact tempered E[nβK] (quadrature / Gibbs)",
        )
    for a in (ax, rel):
        a.set_xscale("log")
        a.set_xlabel("true learning coefficient λ (closed form)")
    ax.set_yscale("log")
    ax.set_ylabel("LLC estimate")
    rel.set_ylabel("estimate / λ - 1 (%)")
    rel.set_ylim(-30, 30)
    ax.set_title(
        "SGLD, nβ=1000, γ=1: calibrated step, burn-in lr·steps = 0.02 at 4x it, 2000 draws",
        fontsize=9,
    )
    rel.set_title("relative error; x: the exact tempered value (no sampler)")
    ax.legend(loc="upper left", fontsize=8)
    rel.legend(loc="lower right", fontsize=8)
    save_figure(fig, png)
    print(json.dumps({"plot": str(png), "rows": len(rows)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--section", choices=["truth", "sweep", "gibbs", "plot"], default="truth")
    parser.add_argument("--max-params", type=int, default=70_000)
    parser.add_argument("--min-params", type=int, default=0)
    parser.add_argument("--chains", type=int, default=None, help="override the recipe's 1")
    parser.add_argument(
        "--no-potentials", action="store_true", help="deep linear networks only (no RRR/crossing)"
    )
    parser.add_argument("--out", type=Path, default=None, help="append JSON lines here")
    parser.add_argument("--png", type=Path, default=HERE / "llc_calibration.png")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sweep-case", type=int, default=1, help="index into DLN_CASES")
    parser.add_argument(
        "--knobs", nargs="*", default=None, help=f"sweep these only: recipe {list(SWEEP_KNOBS)}"
    )
    args = parser.parse_args()
    setup_torch(args.threads)
    if args.section == "truth":
        truth_section(
            args.max_params,
            args.out,
            args.seed,
            args.min_params,
            not args.no_potentials,
            args.chains,
        )
    elif args.section == "sweep":
        sweep_section(args.out, args.seed, args.sweep_case, args.knobs)
    elif args.section == "gibbs":
        gibbs_section(args.out, args.seed)
    else:
        plot_section(args.out or HERE / "llc_calibration.jsonl", args.png)


if __name__ == "__main__":
    main()
