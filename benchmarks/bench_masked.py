"""Masked Adagrad step time on a 4096x4096 parameter at 0.1 %, 1 %, 10 % and 50 % density.

Methods, all updating the same parameter shape:

- ``masked_adagrad_bool_mask``: MaskedAdagrad, dense gradient + the same
  boolean mask passed to every ``step(masks=...)`` (its scan is cached
  between steps, as torch's COO gradient is prebuilt);
- ``masked_adagrad_fresh_mask``: the same, but every step gets a different
  mask tensor (two copies, alternated), so every step scans the mask;
- ``masked_adagrad_group_mask``: MaskedAdagrad with the mask as the param
  group's static ``"mask"`` (its scan is cached between steps);
- ``masked_adagrad_coo``: MaskedAdagrad fed the same sparse COO gradient as torch;
- ``torch_sparse``: torch.optim.Adagrad given a prebuilt, coalesced sparse COO
  gradient (the masked semantics torch has today);
- ``torch_dense_fused`` / ``torch_dense_foreach``: torch's dense Adagrad; it
  updates every entry, so it is not the masked semantics, but it shows what
  one pass over 16 M entries costs;
- ``maskedtensor_seed``: the MaskedTensor formulation of
  shared/seeds/maskedtensor_adagrad.txt (prebuilt dense gradient and mask).

Methods are timed round-robin, one step each per round (in a new random
order every round), so that load from other processes spreads over all of
them and every step starts with caches another method has filled. Prints one JSON line per
(density, method) with the median (and minimum) over the rounds, plus the
load average before and after: on a shared machine, other processes' load
inflates multi-threaded torch ops far more than single-threaded ones.

Usage: ``python benchmarks/bench_masked.py [--rounds 11] [--slow-rounds 3]``
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
import warnings
from collections.abc import Callable

import torch

from gradsketch.masked import MaskedAdagrad

SHAPE = (4096, 4096)
DENSITIES = (0.001, 0.01, 0.1, 0.5)
LR, EPS = 0.01, 1e-10


def make_methods(density: float, seed: int) -> dict[str, Callable[[], None]]:
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(SHAPE, generator=gen) < density
    dense_grad = torch.randn(SHAPE, generator=gen)
    coo = torch.sparse_coo_tensor(
        mask.nonzero().T, dense_grad[mask], SHAPE, check_invariants=False
    ).coalesce()
    methods: dict[str, Callable[[], None]] = {}

    def add_optimizer(name: str, opt_factory, grad, **step_kwargs) -> None:
        p = torch.nn.Parameter(torch.zeros(SHAPE))
        opt = opt_factory([p])

        def step() -> None:
            p.grad = grad
            opt.step(**{k: (v(p) if callable(v) else v) for k, v in step_kwargs.items()})

        methods[name] = step

    add_optimizer(
        "masked_adagrad_bool_mask",
        lambda ps: MaskedAdagrad(ps, lr=LR, eps=EPS),
        dense_grad,
        masks=lambda p: {p: mask},
    )
    copies = [mask, mask.clone()]
    calls = [0]

    def fresh_mask(p):
        calls[0] += 1
        return {p: copies[calls[0] % 2]}

    add_optimizer(
        "masked_adagrad_fresh_mask",
        lambda ps: MaskedAdagrad(ps, lr=LR, eps=EPS),
        dense_grad,
        masks=fresh_mask,
    )
    add_optimizer(
        "masked_adagrad_group_mask",
        lambda ps: MaskedAdagrad([{"params": ps, "mask": mask}], lr=LR, eps=EPS),
        dense_grad,
    )
    add_optimizer("masked_adagrad_coo", lambda ps: MaskedAdagrad(ps, lr=LR, eps=EPS), coo)
    add_optimizer("torch_sparse", lambda ps: torch.optim.Adagrad(ps, lr=LR, eps=EPS), coo)
    for kind in ("fused", "foreach"):
        try:
            opt_kwargs = {kind: True}
            probe = torch.nn.Parameter(torch.zeros(4))
            probe.grad = torch.ones(4)
            torch.optim.Adagrad([probe], lr=LR, **opt_kwargs).step()
        except (RuntimeError, ValueError):
            continue
        add_optimizer(
            f"torch_dense_{kind}",
            lambda ps, kw=opt_kwargs: torch.optim.Adagrad(ps, lr=LR, eps=EPS, **kw),
            dense_grad,
        )

    from torch.masked import masked_tensor

    param = torch.zeros(SHAPE)
    state_sum = torch.zeros(SHAPE)

    def seed_step() -> None:
        nonlocal param, state_sum
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # MaskedTensor is a prototype
            masked_grad = masked_tensor(dense_grad, mask)
            state_sum = state_sum + masked_grad.pow(2).to_tensor(0)
            std = masked_tensor(state_sum, mask).sqrt().add(EPS)
            param = param.add((masked_grad / std).to_tensor(0), alpha=-LR)

    methods["maskedtensor_seed"] = seed_step
    return methods


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--slow-rounds", type=int, default=3, help="rounds for MaskedTensor")
    parser.add_argument("--densities", type=float, nargs="*", default=list(DENSITIES))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # Opt out explicitly (torch warns otherwise); the gradients are built valid.
    torch.sparse.check_sparse_tensor_invariants.disable()
    meta = {
        "bench": "masked",
        "meta": True,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "shape": list(SHAPE),
        "loadavg_start": os.getloadavg()[0],
    }
    print(json.dumps(meta), flush=True)
    for density in args.densities:
        methods = make_methods(density, seed=0)
        times: dict[str, list[float]] = {name: [] for name in methods}
        for step in methods.values():
            step()  # warm-up: lazy state, allocator
        order = random.Random(0)
        for round_ in range(args.rounds):
            # A new order every round: what ran just before a step (a
            # multi-threaded dense pass, say) costs it, so no method may
            # always follow the same one.
            names = list(methods)
            order.shuffle(names)
            for name in names:
                step = methods[name]
                if name == "maskedtensor_seed" and round_ >= args.slow_rounds:
                    continue
                start = time.perf_counter()
                step()
                times[name].append((time.perf_counter() - start) * 1e3)
        medians = {name: statistics.median(ts) for name, ts in times.items()}
        for name, median in medians.items():
            row = {
                "bench": "masked",
                "density": density,
                "method": name,
                "median_ms": round(median, 3),
                "min_ms": round(min(times[name]), 3),
                "ratio_vs_torch_sparse": round(median / medians["torch_sparse"], 4),
                "runs": len(times[name]),
            }
            print(json.dumps(row), flush=True)
        del methods
    print(json.dumps({"bench": "masked", "meta": True, "loadavg_end": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
