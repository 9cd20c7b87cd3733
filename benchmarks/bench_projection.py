"""Projection benchmark: 32 gradients of d = 2**18 to k = 2048 on 2 threads.

First the speed rows (``"section": "speed"``): in one process, with their
repeats interleaved so that all see the same machine load, gradsketch's
``CountSketchProjector`` with the native kernels and with torch's scatter,
devinterp 2.0.1's ``CountSketch`` looped over the batch, and the floors of
reading the batch once (``x.sum()``) and copying it once. They are measured
twice: on this CPU's own code paths, and on the AVX2 paths of torch, MKL and
the native kernels (``ATEN_CPU_CAPABILITY=avx2``, ``-march=x86-64-v3``), as
an AVX2-only machine runs them. Each row carries the ratios
``devinterp_loop / gradsketch`` and ``gradsketch / read_once``.

Then each method runs in its own process (so its peak RSS is its own) and reports
the median time of a batch over repeated runs (9; 5 for the slow dense ones),
its set-up time, its peak RSS and the mean relative inner-product error on 64
correlated pairs. Reference packages (traker, scikit-learn, devinterp) are
measured in the same run. ``gradsketch.CountSketchProjector(torch scatter)``
is the same projector with the native kernels turned off in its process.

    python benchmarks/bench_projection.py            # every method, 9 (slow: 5) repeats
    python benchmarks/bench_projection.py --quick    # fewer repeats, no 8 GB dense matrix
    python benchmarks/bench_projection.py --speed    # the speed rows only
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import interleaved_medians, run_isolated

from gradsketch.demos.protocols import emit, machine_info, setup_torch

D, K, BATCH, PAIRS, RHO = 1 << 18, 2048, 32, 64, 0.5
#: Environment of the AVX2 pass of the speed rows.
AVX2_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "GRADSKETCH_NATIVE_MARCH": "x86-64-v3",
}

METHODS = [
    "null",
    "gradsketch.CountSketchProjector",
    "gradsketch.CountSketchProjector(torch scatter)",
    "gradsketch.SparseProjector(nnz=4)",
    "gradsketch.BasicProjector(rademacher)",
    "traker.BasicProjector",
    "traker.BasicSingleBlockProjector",
    "sklearn.SparseRandomProjection",
    "devinterp.CountSketch(loop)",
]
HEAVY = {"traker.BasicSingleBlockProjector"}
SLOW = {"gradsketch.BasicProjector(rademacher)", "traker.BasicProjector"}


def _batch(seed: int):
    import torch

    return torch.randn(BATCH, D, generator=torch.Generator().manual_seed(seed))


def _pairs(chunk: int, seed: int):
    """Correlated pairs, generated a chunk at a time so no method holds all 64."""
    import torch

    gen = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(chunk, D, generator=gen)
    y = RHO * x + math.sqrt(1 - RHO**2) * torch.randn(chunk, D, generator=gen)
    return x, y


def _build(method: str) -> tuple[Callable[[Any], Any], float]:
    """Return ``(project, normaliser)``: ``<project(x), project(y)> / normaliser ~ <x, y>``."""
    import torch

    if method == "null":
        # Same data and error pass as every method, so its RSS is the baseline.
        return (lambda g: g[:, :K].clone()), 1.0
    if method.startswith("gradsketch.CountSketchProjector"):
        if method.endswith("(torch scatter)"):
            # This process only: the native kernels load lazily, so this turns them off.
            os.environ["GRADSKETCH_NATIVE"] = "0"
        from gradsketch.sketch import CountSketchProjector

        p = CountSketchProjector(D, K, 0, "cpu")
        return (lambda g: p.project(g, 0)), K
    if method == "gradsketch.SparseProjector(nnz=4)":
        from gradsketch.sketch import SparseProjector

        sp = SparseProjector(D, K, 0, 4, "cpu")
        return (lambda g: sp.project(g, 0)), K
    if method == "gradsketch.BasicProjector(rademacher)":
        from gradsketch.sketch import BasicProjector

        bp = BasicProjector(D, K, 0, "rademacher", "cpu")
        return (lambda g: bp.project(g, 0)), K
    if method.startswith("traker."):
        from trak import projectors

        cls = getattr(projectors, method.split(".")[1])
        tp = cls(
            grad_dim=D,
            proj_dim=K,
            seed=0,
            proj_type=projectors.ProjectionType.rademacher,
            device="cpu",
        )
        return (lambda g: tp.project(g, model_id=0)), K
    if method == "sklearn.SparseRandomProjection":
        from sklearn.random_projection import SparseRandomProjection

        srp = SparseRandomProjection(n_components=K, random_state=0)
        srp.fit(torch.zeros(2, D).numpy())
        return (lambda g: torch.from_numpy(srp.transform(g.numpy()))), 1.0
    if method == "devinterp.CountSketch(loop)":
        from devinterp.optim.sketch import CountSketch

        cs = CountSketch.create(D, K, seed=0)
        return (lambda g: torch.stack([cs.sketch(row) for row in g])), 1.0
    raise ValueError(f"unknown method {method!r}; known: {METHODS}")


def measure(method: str, repeats: int) -> dict[str, Any]:
    """Worker (runs in its own process): set-up, median batch time, error."""

    import torch

    setup_torch()
    grads = _batch(0)
    start = time.perf_counter()
    project, norm = _build(method)
    project(grads)  # first call: lazy tables, allocator warm-up
    setup_s = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        project(grads)
        times.append(time.perf_counter() - t0)
    del grads
    errors = []
    for i in range(PAIRS // (BATCH // 2)):
        x, y = _pairs(BATCH // 2, i)
        px, py = project(torch.cat([x, y])).double().split(BATCH // 2)
        estimate = (px * py).sum(1) / norm
        exact = torch.einsum("bd,bd->b", x, y).double()
        errors.append(((estimate - exact).abs() / (x.norm(dim=1) * y.norm(dim=1))).mean())
    error = None if method == "null" else float(torch.stack(errors).mean())
    from gradsketch.sketch import native_status

    return {
        "median_s": statistics.median(times),
        "setup_s": setup_s,
        "error": error,
        "native_kernels": native_status().available,
    }


def speed(repeats: int) -> None:
    """The speed rows: every contender's repeats interleaved in this one process."""
    import torch

    from gradsketch.sketch import CountSketchProjector, _native

    setup_torch()
    x = _batch(0)
    projector = CountSketchProjector(D, K, 0, "cpu")
    native = _native._kernels() is not None
    fallback = (_native.NativeStatus(False, "turned off by the benchmark"), None)

    def torch_scatter() -> Any:
        saved, _native._state = _native._state, fallback
        try:
            return projector.project(x, 0)
        finally:
            _native._state = saved

    contenders: dict[str, Callable[[], Any]] = {
        "gradsketch": lambda: projector.project(x, 0),
        "gradsketch(torch scatter)": torch_scatter,
        "read_once": lambda: x.sum(),
        "copy_once": lambda: x.clone(),
    }
    try:
        from devinterp.optim.sketch import CountSketch

        cs = CountSketch.create(D, K, seed=0)
        contenders["devinterp_loop"] = lambda: torch.stack([cs.sketch(row) for row in x])
    except ImportError as err:
        emit({"bench": "projection", "section": "speed", "skipped": f"devinterp: {err}"})
    torch.testing.assert_close(contenders["gradsketch"](), torch_scatter(), rtol=1e-4, atol=1e-3)
    med = interleaved_medians(contenders, repeats)
    isa = os.environ.get("ATEN_CPU_CAPABILITY") or "native"
    for name, seconds in med.items():
        row: dict[str, Any] = {
            "bench": "projection",
            "section": "speed",
            "paths": isa,
            "method": name,
            "median_ms": seconds * 1e3,
            "repeats": repeats,
            "batch": BATCH,
            "d": D,
            "k": K,
        }
        if name.startswith("gradsketch"):
            row["native_kernels"] = native and name == "gradsketch"
            row["vs_read_once"] = seconds / med["read_once"]
            if "devinterp_loop" in med:
                row["devinterp_loop_over_this"] = med["devinterp_loop"] / seconds
        emit(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="3 repeats (1 for slow methods), skip 8 GB"
    )
    parser.add_argument("--methods", nargs="*", default=None, help="subset of methods")
    parser.add_argument("--speed", action="store_true", help="the speed rows only")
    parser.add_argument("--speed-repeats", type=int, default=41, help=argparse.SUPPRESS)
    parser.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.in_process:
        speed(args.speed_repeats)
        return
    emit({"bench": "projection", "d": D, "k": K, "batch": BATCH, **machine_info()})
    for extra in ({}, AVX2_ENV):
        # A fresh interpreter per pass: the capability is read when torch loads.
        cmd = [sys.executable, __file__, "--in-process", "--speed-repeats", str(args.speed_repeats)]
        subprocess.run(cmd, env={**os.environ, **extra}, check=True)
    if args.speed:
        return
    methods = args.methods or [m for m in METHODS if not (args.quick and m in HEAVY)]
    # CountSketchProjector and null run first (METHODS order), so every later
    # row can be printed as soon as it is measured, with its ratio.
    ours: float | None = None
    baseline: float | None = None
    for method in methods:
        repeats = (1 if method in SLOW else 3) if args.quick else (5 if method in SLOW else 9)
        try:
            out = run_isolated("bench_projection:measure", method, repeats, timeout=3600)
        except RuntimeError as err:
            emit({"bench": "projection", "method": method, "skipped": str(err).splitlines()[-1]})
            continue
        record = {"bench": "projection", "method": method, **out["result"]}
        record.update(peak_rss_mb=out["peak_rss_mb"], repeats=repeats)
        if method == "null":
            baseline = out["peak_rss_mb"]
        elif baseline is not None:
            record["rss_above_null_mb"] = out["peak_rss_mb"] - baseline
        if method == "gradsketch.CountSketchProjector":
            ours = record["median_s"]
        elif ours and method != "null":
            record["time_vs_countsketch"] = record["median_s"] / ours
        emit(record)


if __name__ == "__main__":
    main()
