"""One sampler step on a ~1M-parameter MLP: gradsketch vs devinterp 2.0.1 vs torch SGD.

Prints one JSON line per (implementation, setting) with the median step time
over repeats and ratios against devinterp measured in the same run, then the
wall time of a 4-chain LLC estimate on a digits MLP with cores=1 and cores=2.

Every optimizer is stepped in turn inside one loop (interleaved), so all of
them see the same machine load. Two clocks are reported: wall time
(``median_ms``) and process CPU time (``cpu_ms``). On a shared machine the
wall clock includes time spent descheduled; CPU time does not, so the
overhead ratios in ``cpu_overhead_vs_own_plain`` are the stable ones there.
With several torch threads on a loaded machine every parallel op also waits
for its slowest thread: ``--threads 1`` measures the work itself.

The steps above get the same stored gradients every time and run back to
back with other implementations' steps. ``sampler_step_in_loop`` rows time
the step where a sampler runs it: after ``zero_grad``, a forward and a
backward of its own model, each optimizer for a block of consecutive
iterations (see :func:`time_in_loop`). There the step meets the cache and
allocator state a sampling loop leaves: fresh gradient tensors, and
megabyte temporaries that cost page faults when a step allocates them.
``preconditioned_step_in_loop`` rows do the same for RMSprop-SGLD,
Adam-SGLD (gradsketch only) and SGNHT, plain and with both recordings.

Run: ``.venv/bin/python benchmarks/bench_sampling.py [--repeats 30] [--threads 1]
[--skip-llc] [--skip-loop] [--loop-rounds 12]``; with ``GRADSKETCH_NATIVE=0``
it measures torch's scatter path instead of the native kernels.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import logging
import os
import random
import statistics
import time
import warnings
from typing import Any

import torch

from gradsketch.sampling import SGMCMC, estimate_learning_coeff_with_summary
from gradsketch.sketch import native_status

SETTINGS = {
    "plain": {},
    "save_metrics": {"save_metrics": True},
    "sketch_1024": {"sketch_dim": 1024},
    "both": {"save_metrics": True, "sketch_dim": 1024},
}

#: Sampler hyperparameters of every SGLD-type step timed here.
STEP_KW = dict(lr=1e-4, nbeta=50.0, localization=100.0)


def mlp(widths: list[int]) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def time_interleaved(
    opts: dict[str, torch.optim.Optimizer], repeats: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Median wall and CPU time (ms) of each optimizer's step, alternating them every repeat.

    The machine is shared: alternating puts every implementation under the
    same load, so the ratios stay meaningful even when absolute times drift.
    """
    wall: dict[str, list[float]] = {name: [] for name in opts}
    cpu: dict[str, list[float]] = {name: [] for name in opts}
    gens = {name: torch.Generator().manual_seed(0) for name in opts}
    for i in range(repeats + 3):
        for name, opt in opts.items():
            cpu_start, start = time.process_time(), time.perf_counter()
            if isinstance(opt, torch.optim.SGD):
                opt.step()
            else:
                opt.step(noise_generator=gens[name])
            if i >= 3:  # warm-up: lazy state, allocator, first-touch pages
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - cpu_start)
    return (
        {name: statistics.median(ts) * 1e3 for name, ts in wall.items()},
        {name: statistics.median(ts) * 1e3 for name, ts in cpu.items()},
    )


def bench_step(repeats: int) -> list[dict]:
    model, x, y, DevSGMCMC = _loop_setup()
    numel = sum(p.numel() for p in model.parameters())
    torch.nn.functional.cross_entropy(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    if DevSGMCMC is None:
        logging.warning("devinterp 2.0.1 not installed (make bench-setup); skipping it")

    def fresh() -> torch.nn.Module:
        m = copy.deepcopy(model)
        for p, g in zip(m.parameters(), grads):
            p.grad = g.clone()
        return m

    # Every implementation and setting in one interleaved loop: same load for all.
    opts: dict[str, torch.optim.Optimizer] = {"sgd": torch.optim.SGD(fresh().parameters(), lr=1e-4)}
    for setting, extra in SETTINGS.items():
        opts[f"gradsketch/{setting}"] = SGMCMC.sgld(fresh().parameters(), **STEP_KW, **extra)
        if DevSGMCMC is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                opts[f"devinterp/{setting}"] = DevSGMCMC.sgld(
                    fresh().parameters(), **STEP_KW, **extra
                )
    ms, cpu = time_interleaved(opts, repeats)
    rows = []
    for setting in SETTINGS:
        ours = ms[f"gradsketch/{setting}"]
        row = {
            "bench": "sampler_step",
            "impl": "gradsketch",
            "setting": setting,
            "numel": numel,
            "threads": torch.get_num_threads(),
            "native_kernels": native_status().available,
            "load_avg_1min": round(os.getloadavg()[0], 2),
            "median_ms": round(ours, 3),
            "cpu_ms": round(cpu[f"gradsketch/{setting}"], 3),
            "torch_sgd_ms": round(ms["sgd"], 3),
        }
        if f"devinterp/{setting}" in ms:
            row["devinterp_ms"] = round(ms[f"devinterp/{setting}"], 3)
            row["devinterp_cpu_ms"] = round(cpu[f"devinterp/{setting}"], 3)
            row["speedup_vs_devinterp"] = round(ms[f"devinterp/{setting}"] / ours, 2)
            row["cpu_speedup_vs_devinterp"] = round(
                cpu[f"devinterp/{setting}"] / cpu[f"gradsketch/{setting}"], 2
            )
        row["overhead_vs_own_plain"] = round(ours / ms["gradsketch/plain"] - 1.0, 3)
        row["cpu_overhead_vs_own_plain"] = round(
            cpu[f"gradsketch/{setting}"] / cpu["gradsketch/plain"] - 1.0, 3
        )
        rows.append(row)
    return rows


def time_in_loop(
    models: dict[str, torch.nn.Module],
    opts: dict[str, torch.optim.Optimizer],
    x: torch.Tensor,
    y: torch.Tensor,
    rounds: int,
    block: int = 5,
) -> tuple[dict[str, float], dict[str, float]]:
    """Median step and whole-iteration time (ms) of each optimizer inside a sampling loop.

    Each iteration is what a sampler runs: ``zero_grad``, forward, backward,
    ``step``. Every optimizer runs ``block`` consecutive iterations of its own
    (the first one untimed) before the next takes over, in a new random order
    each round, so each step sees the caches and allocator a real loop leaves
    it, and a load swing hits all of them alike.
    """
    rng = random.Random(0)
    step_ms: dict[str, list[float]] = {name: [] for name in opts}
    iter_ms: dict[str, list[float]] = {name: [] for name in opts}
    gens = {name: torch.Generator().manual_seed(0) for name in opts}
    names = list(opts)
    for r in range(rounds + 1):
        rng.shuffle(names)
        for name in names:
            model, opt = models[name], opts[name]
            for i in range(block):
                start = time.perf_counter()
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                mid = time.perf_counter()
                if isinstance(opt, torch.optim.SGD):
                    opt.step()
                else:
                    opt.step(noise_generator=gens[name])
                end = time.perf_counter()
                if r > 0 and i > 0:  # round 0 and each block's first iteration warm up
                    step_ms[name].append((end - mid) * 1e3)
                    iter_ms[name].append((end - start) * 1e3)
    return (
        {name: statistics.median(v) for name, v in step_ms.items()},
        {name: statistics.median(v) for name, v in iter_ms.items()},
    )


def _loop_setup() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, Any]:
    """The 1M-parameter MLP, one batch, and devinterp's SGMCMC class (None if absent)."""
    torch.manual_seed(0)
    model = mlp([784, 1024, 192, 10])  # 1,002,570 parameters
    x, y = torch.randn(32, 784), torch.randint(0, 10, (32,))
    try:
        from devinterp.optim import SGMCMC as DevSGMCMC
    except ImportError:
        DevSGMCMC = None
    return model, x, y, DevSGMCMC


def bench_loop(rounds: int) -> list[dict]:
    """The four settings (and devinterp's, and torch SGD) stepped inside a sampling loop."""
    model, x, y, DevSGMCMC = _loop_setup()
    models = {"sgd": copy.deepcopy(model)}
    opts: dict[str, torch.optim.Optimizer] = {
        "sgd": torch.optim.SGD(models["sgd"].parameters(), lr=1e-4)
    }
    for setting, extra in SETTINGS.items():
        impls = [("gradsketch", SGMCMC)] + ([("devinterp", DevSGMCMC)] if DevSGMCMC else [])
        for impl, cls in impls:
            name = f"{impl}/{setting}"
            models[name] = copy.deepcopy(model)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                opts[name] = cls.sgld(models[name].parameters(), **STEP_KW, **extra)
    step, iteration = time_in_loop(models, opts, x, y, rounds)
    rows = []
    for setting in SETTINGS:
        ours = f"gradsketch/{setting}"
        row = {
            "bench": "sampler_step_in_loop",
            "impl": "gradsketch",
            "setting": setting,
            "threads": torch.get_num_threads(),
            "native_kernels": native_status().available,
            "load_avg_1min": round(os.getloadavg()[0], 2),
            "step_ms": round(step[ours], 3),
            "iteration_ms": round(iteration[ours], 3),
            "torch_sgd_step_ms": round(step["sgd"], 3),
            "overhead_vs_own_plain": round(step[ours] / step["gradsketch/plain"] - 1.0, 3),
            "iteration_overhead_vs_own_plain": round(
                iteration[ours] / iteration["gradsketch/plain"] - 1.0, 3
            ),
        }
        if f"devinterp/{setting}" in step:
            row["devinterp_step_ms"] = round(step[f"devinterp/{setting}"], 3)
            row["speedup_vs_devinterp"] = round(step[f"devinterp/{setting}"] / step[ours], 2)
        rows.append(row)
    return rows


def bench_preconditioners(rounds: int) -> list[dict]:
    """RMSprop-SGLD, Adam-SGLD and SGNHT steps (plain and both recordings) inside the loop."""
    model, x, y, DevSGMCMC = _loop_setup()
    models: dict[str, torch.nn.Module] = {}
    opts: dict[str, torch.optim.Optimizer] = {}
    methods = {
        "rmsprop_sgld": STEP_KW,
        "adam_sgld": STEP_KW,
        "sgnht": {k: v for k, v in STEP_KW.items() if k != "localization"},
    }
    for method, kw in methods.items():
        for setting in ("plain", "both"):
            impls = [("gradsketch", SGMCMC)]
            if DevSGMCMC is not None and hasattr(DevSGMCMC, method):
                impls.append(("devinterp", DevSGMCMC))
            for impl, cls in impls:
                name = f"{impl}/{method}/{setting}"
                models[name] = copy.deepcopy(model)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    make = getattr(cls, method)
                    opts[name] = make(models[name].parameters(), **kw, **SETTINGS[setting])
    step, _ = time_in_loop(models, opts, x, y, rounds)
    rows = []
    for method in methods:
        for setting in ("plain", "both"):
            ours = step[f"gradsketch/{method}/{setting}"]
            row = {
                "bench": "preconditioned_step_in_loop",
                "method": method,
                "setting": setting,
                "step_ms": round(ours, 3),
            }
            theirs = step.get(f"devinterp/{method}/{setting}")
            if theirs is not None:
                row["devinterp_step_ms"] = round(theirs, 3)
                row["speedup_vs_devinterp"] = round(theirs / ours, 2)
            rows.append(row)
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
    parser.add_argument("--skip-loop", action="store_true", help="no in-loop measurement")
    parser.add_argument("--loop-rounds", type=int, default=12, help="rounds of the in-loop run")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's)"
    )
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    rows = bench_step(args.repeats)
    if not args.skip_loop:
        rows += bench_loop(args.loop_rounds)
        rows += bench_preconditioners(max(2, args.loop_rounds // 2))
    if not args.skip_llc:
        rows += bench_llc()
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
