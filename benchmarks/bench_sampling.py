"""One sampler step on a ~1M-parameter MLP: gradsketch vs devinterp 2.0.1 vs torch SGD.

Prints one JSON line per (implementation, setting) with the median step time
over repeats and ratios against devinterp measured in the same run, then the
wall time of a 4-chain LLC estimate on a digits MLP with cores=1 and cores=2.

Run: ``.venv/bin/python benchmarks/bench_sampling.py [--repeats 30] [--skip-llc]``.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import logging
import statistics
import time
import warnings

import torch

from gradsketch.sampling import SGMCMC, estimate_learning_coeff_with_summary

SETTINGS = {
    "plain": {},
    "save_metrics": {"save_metrics": True},
    "sketch_1024": {"sketch_dim": 1024},
    "both": {"save_metrics": True, "sketch_dim": 1024},
}


def mlp(widths: list[int]) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def time_interleaved(opts: dict[str, torch.optim.Optimizer], repeats: int) -> dict[str, float]:
    """Median step time of each optimizer, alternating them every repeat.

    The machine is shared: alternating puts every implementation under the
    same load, so the ratios stay meaningful even when absolute times drift.
    """
    times: dict[str, list[float]] = {name: [] for name in opts}
    gens = {name: torch.Generator().manual_seed(0) for name in opts}
    for i in range(repeats + 3):
        for name, opt in opts.items():
            start = time.perf_counter()
            if isinstance(opt, torch.optim.SGD):
                opt.step()
            else:
                opt.step(noise_generator=gens[name])
            if i >= 3:  # warm-up: lazy state, allocator, first-touch pages
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def bench_step(repeats: int) -> list[dict]:
    torch.manual_seed(0)
    model = mlp([784, 1024, 192, 10])  # 1,005,770 parameters
    numel = sum(p.numel() for p in model.parameters())
    x, y = torch.randn(32, 784), torch.randint(0, 10, (32,))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    try:
        from devinterp.optim import SGMCMC as DevSGMCMC
    except ImportError:
        DevSGMCMC = None
        logging.warning("devinterp 2.0.1 not installed (make bench-setup); skipping it")

    def fresh() -> torch.nn.Module:
        m = copy.deepcopy(model)
        for p, g in zip(m.parameters(), grads):
            p.grad = g.clone()
        return m

    kw = dict(lr=1e-4, nbeta=50.0, localization=100.0)
    # Every implementation and setting in one interleaved loop: same load for all.
    opts: dict[str, torch.optim.Optimizer] = {"sgd": torch.optim.SGD(fresh().parameters(), lr=1e-4)}
    for setting, extra in SETTINGS.items():
        opts[f"gradsketch/{setting}"] = SGMCMC.sgld(fresh().parameters(), **kw, **extra)
        if DevSGMCMC is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                opts[f"devinterp/{setting}"] = DevSGMCMC.sgld(fresh().parameters(), **kw, **extra)
    ms = time_interleaved(opts, repeats)
    rows = []
    for setting in SETTINGS:
        ours = ms[f"gradsketch/{setting}"]
        row = {
            "bench": "sampler_step",
            "impl": "gradsketch",
            "setting": setting,
            "numel": numel,
            "median_ms": round(ours, 3),
            "torch_sgd_ms": round(ms["sgd"], 3),
        }
        if f"devinterp/{setting}" in ms:
            row["devinterp_ms"] = round(ms[f"devinterp/{setting}"], 3)
            row["speedup_vs_devinterp"] = round(ms[f"devinterp/{setting}"] / ours, 2)
        rows.append(row)
    plain = next(
        r["median_ms"] for r in rows if r["impl"] == "gradsketch" and r["setting"] == "plain"
    )
    for r in rows:
        if r["impl"] == "gradsketch":
            r["overhead_vs_own_plain"] = round(r["median_ms"] / plain - 1.0, 3)
    return rows


def bench_llc() -> list[dict]:
    from sklearn.datasets import load_digits
    from torch.utils.data import DataLoader, TensorDataset

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    torch.manual_seed(0)
    model = mlp([64, 64, 10])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(200):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)
    rows = []
    results = {}
    for cores in (1, 2):
        start = time.perf_counter()
        results[cores] = estimate_learning_coeff_with_summary(
            model,
            loader,
            num_chains=4,
            num_draws=200,
            cores=cores,
            seed=0,
            verbose=False,
            optimizer_kwargs=dict(lr=1e-4, localization=100.0, nbeta=20.0),
        )
        wall = time.perf_counter() - start
        rows.append(
            {
                "bench": "llc_4_chains_digits_mlp",
                "cores": cores,
                "wall_s": round(wall, 2),
                "llc_mean": round(results[cores]["llc/mean"], 4),
            }
        )
    rows[1]["same_as_cores_1"] = bool(abs(rows[0]["llc_mean"] - rows[1]["llc_mean"]) < 1e-9)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--skip-llc", action="store_true")
    args = parser.parse_args()
    rows = bench_step(args.repeats)
    if not args.skip_llc:
        rows += bench_llc()
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
