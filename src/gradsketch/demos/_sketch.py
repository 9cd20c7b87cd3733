"""Sketching demo: inner-product error against sketch size for every kind."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from gradsketch.sketch import (
    AbstractProjector,
    BasicProjector,
    CountSketchProjector,
    SparseProjector,
)

#: Projector factories shown by the demo: name -> (grad_dim, proj_dim, seed) -> projector.
DEMO_KINDS: dict[str, Callable[[int, int, int], AbstractProjector]] = {
    "count_sketch": lambda d, k, s: CountSketchProjector(d, k, s, "cpu"),
    "sparse_jl_nnz4": lambda d, k, s: SparseProjector(d, k, s, 4, "cpu"),
    "dense_rademacher": lambda d, k, s: BasicProjector(
        d, k, s, "rademacher", "cpu", block_size=512
    ),
    "dense_normal": lambda d, k, s: BasicProjector(d, k, s, "normal", "cpu", block_size=512),
}


def correlated_pairs(
    num_pairs: int, dim: int, *, rho: float = 0.5, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian pairs with correlation ``rho``: ``x, y`` of shape ``[num_pairs, dim]``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_pairs, dim, generator=gen)
    noise = torch.randn(num_pairs, dim, generator=gen)
    return x, rho * x + math.sqrt(1 - rho**2) * noise


def inner_product_error(projector: AbstractProjector, x: torch.Tensor, y: torch.Tensor) -> float:
    """Mean relative error ``|<Px,Py>/k - <x,y>| / (|x||y|)`` over the pairs."""
    px, py = projector.project(x, 0), projector.project(y, 0)
    estimate = (px * py).sum(dim=1) / projector.proj_dim
    exact = (x * y).sum(dim=1)
    scale = x.norm(dim=1) * y.norm(dim=1)
    return float(((estimate - exact).abs() / scale).mean())


def run_sketch_demo(
    out_dir: str | Path,
    *,
    dim: int = 1 << 14,
    sizes: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048),
    num_pairs: int = 64,
    seed: int = 0,
    rho: float = 0.5,
) -> dict[str, Any]:
    """Measure inner-product error against k for every sketch kind; write a table, PNG and JSON.

    The relative error of a JL sketch falls like ``1 / sqrt(k)``; the plot
    shows every kind against the exact expectation for a Gaussian map.

    Args:
        out_dir: output folder (created).
        dim: input dimension d.
        sizes: sketch sizes k.
        num_pairs: correlated vector pairs per measurement.
        seed: seed of the data and of the sketches.
        rho: correlation of each vector pair.

    Returns:
        The summary written to ``summary.json``.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     summary = run_sketch_demo(tmp, dim=256, sizes=(16, 32), num_pairs=4)
        >>> sorted(summary["errors"])[:2]
        ['count_sketch', 'dense_normal']
    """
    from gradsketch._plotting import new_figure, save_figure

    for name, value in (("dim", dim), ("num_pairs", num_pairs)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be a positive int, got {value!r}; e.g. {name}=1024.")
    bad = [k for k in sizes if isinstance(k, bool) or not isinstance(k, int) or k < 1]
    if not sizes or bad:
        raise ValueError(f"`sizes` must be positive ints, got {sizes!r}; e.g. sizes=(64, 128).")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(
            f"`out_dir`={str(out)!r} is a file, not a folder; pass a folder path (it is created)."
        )
    out.mkdir(parents=True, exist_ok=True)
    x, y = correlated_pairs(num_pairs, dim, rho=rho, seed=seed)
    errors: dict[str, dict[int, float]] = {name: {} for name in DEMO_KINDS}
    seconds: dict[str, float] = {name: 0.0 for name in DEMO_KINDS}
    cells = [(name, k) for name in DEMO_KINDS for k in sizes]
    for name, k in tqdm(cells, desc="sketch demo", leave=False):
        start = time.perf_counter()
        errors[name][k] = inner_product_error(DEMO_KINDS[name](dim, k, seed), x, y)
        seconds[name] += time.perf_counter() - start

    fig, ax = new_figure()
    for name, by_k in errors.items():
        ax.loglog(list(by_k), list(by_k.values()), marker="o", label=name)
    # Gaussian JL: <Px,Py>/k - <x,y> has variance (|x|^2|y|^2 + <x,y>^2)/k, so
    # the mean absolute relative error is sqrt(2/pi) * sqrt((1 + rho^2)/k).
    theory = [math.sqrt(2 / math.pi * (1 + rho**2) / k) for k in sizes]
    ax.loglog(sizes, theory, "k--", label="theory: sqrt(2(1+rho^2)/(pi k))")
    ax.set_xlabel("sketch size k")
    ax.set_ylabel("mean relative inner-product error")
    ax.set_title(f"Inner products after sketching (d = {dim}, {num_pairs} pairs)")
    ax.legend()
    save_figure(fig, out / "sketch_error.png")

    summary = {
        "dim": dim,
        "sizes": list(sizes),
        "num_pairs": num_pairs,
        "seed": seed,
        "rho": rho,
        "theory": dict(zip(map(str, sizes), theory)),
        "errors": {name: {str(k): e for k, e in by_k.items()} for name, by_k in errors.items()},
        "seconds": seconds,
        "plot": str(out / "sketch_error.png"),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def format_sketch_table(summary: dict[str, Any]) -> str:
    """The error table as aligned text: one row per kind, one column per k."""
    sizes = summary["sizes"]
    head = f"{'kind':<18}" + "".join(f"{'k=' + str(k):>10}" for k in sizes)
    rows = [
        f"{name:<18}" + "".join(f"{by_k[str(k)]:>10.4f}" for k in sizes)
        for name, by_k in summary["errors"].items()
    ]
    return "\n".join([head, *rows])
