"""gradsketch.factorize side by side with Composer's factorize_core.

Prints one JSON line per case: median wall time of >= 5 interleaved runs on
2 threads, and the nmse of both: Composer's reported value and the true one
recomputed from its returned factors (they differ when a bias is given).

Composer is loaded from `composer/algorithms/factorize/factorize_core.py` by
path (its package `__init__` needs torchvision); install it with
`pip install --no-deps mosaicml`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

import gradsketch.factorize as gradsketch_factorize
from gradsketch.factorize import LowRankSolution


def load_composer_core() -> ModuleType | None:
    """Composer's factorize_core module, or None if mosaicml is not installed."""
    spec = importlib.util.find_spec("composer")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "algorithms/factorize/factorize_core.py"
    if not path.is_file():
        return None
    core_spec = importlib.util.spec_from_file_location("_composer_factorize_core", path)
    assert core_spec is not None and core_spec.loader is not None
    module = importlib.util.module_from_spec(core_spec)
    core_spec.loader.exec_module(module)
    return module


def true_nmse(y: torch.Tensor, y_hat: torch.Tensor) -> float:
    return float((y - y_hat).square().mean() / y.var())


def matrix_nmse(x: torch.Tensor, y: torch.Tensor, sol: Any) -> float:
    pred = x @ sol.Wa if sol.Wb is None else x @ sol.Wa @ sol.Wb
    return true_nmse(y, pred if sol.bias is None else pred + sol.bias)


def conv_nmse(x: torch.Tensor, y: torch.Tensor, sol: Any) -> float:
    y_hat = F.conv2d(F.conv2d(x, sol.Wa), sol.Wb, sol.bias)
    flat = lambda t: t.permute(0, 2, 3, 1).reshape(-1, t.shape[1])  # noqa: E731
    return true_nmse(flat(y), flat(y_hat))


def decaying_inputs(n: int, d: int, gen: torch.Generator) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=gen))
    scale = 1.0 / (1.0 + torch.arange(d, dtype=torch.float32) / 16)
    return torch.randn(n, d, generator=gen) * scale @ q.T


def cases(gen: torch.Generator) -> list[dict[str, Any]]:
    x = torch.randn(4096, 1024, generator=gen)
    w = torch.randn(1024, 1024, generator=gen)
    b = torch.randn(1024, generator=gen)
    xd = decaying_inputs(4096, 1024, gen)
    xc = torch.randn(64, 64, 16, 16, generator=gen)
    wc = torch.randn(64, 64, 3, 3, generator=gen)
    return [
        {
            "case": "matrix_4096x1024_r256_bias",
            "kind": "matrix",
            "x": x,
            "w": w,
            "b": b,
            "rank": 256,
        },
        {
            "case": "matrix_4096x1024_r256_nobias",
            "kind": "matrix",
            "x": x,
            "w": w,
            "b": None,
            "rank": 256,
        },
        {
            "case": "matrix_decaying_r256_bias",
            "kind": "matrix",
            "x": xd,
            "w": w,
            "b": b,
            "rank": 256,
        },
        {
            "case": "conv_64to64_3x3_64x64x16x16_r16",
            "kind": "conv",
            "x": xc,
            "w": wc,
            "b": None,
            "rank": 16,
        },
    ]


def runner(lib: Any, case: dict[str, Any]) -> Callable[[], LowRankSolution]:
    x, w, b, k = case["x"], case["w"], case["b"], case["rank"]
    if case["kind"] == "conv":
        return lambda: lib.factorize_conv2d(x, w, rank=k, n_iters=3)
    y = x @ w if b is None else x @ w + b
    return lambda: lib.factorize_matrix(x, y, w, bias=b, rank=k, n_iters=3)


def run_case(case: dict[str, Any], composer: ModuleType | None, repeats: int) -> dict[str, Any]:
    ours = runner(gradsketch_factorize, case)
    theirs = runner(composer, case) if composer is not None else None
    ours()  # warm-up
    if theirs is not None:
        theirs()
    times_ours: list[float] = []
    times_theirs: list[float] = []
    sol_ours = sol_theirs = None
    for _ in range(repeats):  # interleaved, so machine load hits both alike
        t0 = time.perf_counter()
        sol_ours = ours()
        times_ours.append(time.perf_counter() - t0)
        if theirs is not None:
            t0 = time.perf_counter()
            sol_theirs = theirs()
            times_theirs.append(time.perf_counter() - t0)
    x, w, b = case["x"], case["w"], case["b"]
    if case["kind"] == "conv":
        y = F.conv2d(x, w)
        nmse = conv_nmse
    else:
        y = x @ w if b is None else x @ w + b
        nmse = matrix_nmse
    row: dict[str, Any] = {"bench": "factorize", "case": case["case"]}
    row["gradsketch_s"] = round(statistics.median(times_ours), 4)
    row["composer_s"] = round(statistics.median(times_theirs), 4) if times_theirs else None
    row["ratio"] = round(row["composer_s"] / row["gradsketch_s"], 2) if times_theirs else None
    row["gradsketch_nmse"] = round(nmse(x, y, sol_ours), 5)
    row["gradsketch_nmse_reported"] = round(float(sol_ours.nmse), 5)
    row["composer_nmse_true"] = round(nmse(x, y, sol_theirs), 5) if sol_theirs else None
    row["composer_nmse_reported"] = round(float(sol_theirs.nmse), 5) if sol_theirs else None
    row["runs"] = repeats
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--case", action="append", help="run only these cases")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    composer = load_composer_core()
    if composer is None:
        print(
            "# Composer not installed (pip install --no-deps mosaicml): timing gradsketch only",
            file=sys.stderr,
        )
    for case in cases(torch.Generator().manual_seed(0)):
        if args.case and case["case"] not in args.case:
            continue
        print(json.dumps(run_case(case, composer, max(5, args.repeats))), flush=True)


if __name__ == "__main__":
    main()
