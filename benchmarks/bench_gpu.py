"""GPU benchmark: Triton count sketch and on-the-fly dense JL vs a dense matmul.

On one CUDA device, for a batch of gradients ``[batch, d]`` projected to
``k`` coordinates, times (median of synchronised repeats after warm-up):

* ``triton.count_sketch``: :func:`triton_count_sketch` (what
  ``CountSketchProjector`` runs on CUDA), hashing in registers;
* ``torch.count_sketch``: the torch path on the same GPU (int64 tables and
  ``index_add_``), i.e. ``GRADSKETCH_TRITON=0``;
* ``triton.dense_rademacher`` / ``triton.dense_normal``:
  :func:`triton_dense_project` (what ``BasicProjector`` / ``CudaProjector``
  run on CUDA), the matrix generated in registers;
* ``torch.matmul_precomputed``: ``x @ M`` with the ``[d, k]`` float32 matrix
  held in GPU memory (``allow_tf32`` left at torch's default, off), the
  baseline the issue asks for. Its memory is the price the kernels avoid.

Each line is one JSON object with the time, gradient throughput (GB/s of
input read), the speed ratio against the precomputed matmul measured in the
same run, the peak extra GPU memory, and a correctness check against the
torch path. Without CUDA it prints one line saying it was skipped and exits 0.

    python benchmarks/bench_gpu.py                  # d = 2**22 (dense), 2**26 (count sketch)
    python benchmarks/bench_gpu.py --quick          # smaller sizes, fewer repeats
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from gradsketch.demos.protocols import emit, machine_info
from gradsketch.sketch import _triton
from gradsketch.sketch._countsketch import accumulate_folded
from gradsketch.sketch._tables import buckets_and_signs, dense_block, dense_key, sparse_key

_TILE_ROWS = 1 << 14  # rows of M generated at a time when building the matmul baseline


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _peak_extra_mb(fn: Callable[[], Any], device: torch.device) -> float | None:
    """Peak GPU memory a call allocates beyond what is already held."""
    if device.type != "cuda":
        return None
    _sync(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    _sync(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-300))


def _dense_matrix(key: int, d: int, k: int, kind: str, device: torch.device) -> torch.Tensor:
    """The ``[d, k]`` float32 matrix of the dense map, built in row tiles."""
    matrix = torch.empty(d, k, dtype=torch.float32, device=device)
    for start in range(0, d, _TILE_ROWS):
        stop = min(start + _TILE_ROWS, d)
        matrix[start:stop] = dense_block(
            key, start, stop - start, 0, k, kind, torch.float32, device
        )
    return matrix


def _count_sketch_rows(
    base: dict[str, Any], device: torch.device, batch: int, k: int, d: int, repeats: int
) -> None:
    """Triton and torch count sketch of ``[batch, d]`` Gaussian gradients."""
    gen = torch.Generator(device=device).manual_seed(1)
    kernels = _triton.available()
    warmup = 2
    x = torch.randn(batch, d, generator=gen, device=device)
    key = sparse_key(0, 0, 0)
    scale = k**0.5
    table = buckets_and_signs(key, 0, d, k, device)
    ref = torch.zeros(batch, k, device=device)
    accumulate_folded(ref, x, table, k, scale)
    gbytes = x.numel() * x.element_size() / 1e9
    rows = []

    def torch_cs() -> torch.Tensor:
        out = torch.zeros(batch, k, device=device)
        accumulate_folded(out, x, table, k, scale)
        return out

    rows.append(("torch.count_sketch", d, torch_cs, ref))
    if kernels:

        def triton_cs() -> torch.Tensor:
            out = torch.zeros(batch, k, device=device)
            return _triton.triton_count_sketch(x, key, 0, k, scale, out)

        rows.append(("triton.count_sketch", d, triton_cs, ref))
    for name, dim, fn, expected in rows:
        seconds = _median_time(fn, device, repeats, warmup)
        emit(
            {
                **base,
                "method": name,
                "d": dim,
                "seconds": seconds,
                "gb_per_s": gbytes / seconds,
                "peak_extra_mb": _peak_extra_mb(fn, device),
                "rel_diff_vs_torch_path": _rel_diff(fn(), expected),
            }
        )


def run(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    batch, k = args.batch, args.k
    repeats, warmup = args.repeats, 2
    gen = torch.Generator(device=device).manual_seed(0)
    base: dict[str, Any] = {
        "benchmark": "gpu",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "triton": None if _triton.triton is None else _triton.triton.__version__,
        "interpreter": _triton.interpret_mode(),
        "batch": batch,
        "k": k,
    }
    emit({**base, "machine": machine_info()})
    kernels = _triton.available()

    _count_sketch_rows(base, device, batch, k, args.d_cs, repeats)

    # ---- dense JL: d_dense coordinates, vs the precomputed matmul -------
    d = args.d_dense
    x = torch.randn(batch, d, generator=gen, device=device)
    gbytes = x.numel() * x.element_size() / 1e9
    key = dense_key(0, 0)
    results: dict[str, float] = {}
    for kind in ("rademacher", "normal"):
        matrix = _dense_matrix(key, d, k, kind, device)
        expected = x @ matrix
        matmul_s = _median_time(lambda m=matrix: x @ m, device, repeats, warmup)
        results[f"matmul_{kind}"] = matmul_s
        emit(
            {
                **base,
                "method": f"torch.matmul_precomputed({kind})",
                "d": d,
                "seconds": matmul_s,
                "gb_per_s": gbytes / matmul_s,
                "matrix_mb": matrix.numel() * 4 / 2**20,
                "tflops": 2 * batch * d * k / matmul_s / 1e12,
            }
        )
        del matrix
        if not kernels:
            continue

        def triton_dense(kind: str = kind) -> torch.Tensor:
            out = torch.zeros(batch, k, device=device)
            return _triton.triton_dense_project(x, key, 0, k, kind, out)

        seconds = _median_time(triton_dense, device, repeats, warmup)
        emit(
            {
                **base,
                "method": f"triton.dense_{kind}",
                "d": d,
                "seconds": seconds,
                "gb_per_s": gbytes / seconds,
                "tflops": 2 * batch * d * k / seconds / 1e12,
                "vs_matmul_precomputed": matmul_s / seconds,
                "peak_extra_mb": _peak_extra_mb(triton_dense, device),
                "rel_diff_vs_matmul": _rel_diff(triton_dense(), expected),
            }
        )
        del expected
    if kernels:
        # The count sketch on the same input, against the same baseline.
        cs_key = sparse_key(0, 0, 0)

        def triton_cs_dense_d() -> torch.Tensor:
            out = torch.zeros(batch, k, device=device)
            return _triton.triton_count_sketch(x, cs_key, 0, k, k**0.5, out)

        seconds = _median_time(triton_cs_dense_d, device, repeats, warmup)
        emit(
            {
                **base,
                "method": "triton.count_sketch",
                "d": d,
                "seconds": seconds,
                "gb_per_s": gbytes / seconds,
                "vs_matmul_precomputed": results["matmul_rademacher"] / seconds,
            }
        )
    if not kernels:
        emit({**base, "note": "triton kernels unavailable: install the `gpu` extra"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    parser.add_argument(
        "--device", default="cuda", help="cuda (default) or cpu (interpreter smoke test)"
    )
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--d-cs", type=int, default=None, help="coordinates for the count sketch")
    parser.add_argument("--d-dense", type=int, default=None, help="coordinates for the dense maps")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        emit({"benchmark": "gpu", "skipped": True, "reason": "no CUDA device"})
        return 0
    if args.device == "cpu" and not _triton.interpret_mode():
        emit(
            {
                "benchmark": "gpu",
                "skipped": True,
                "reason": "--device cpu only runs under TRITON_INTERPRET=1 (a smoke test)",
            }
        )
        return 0
    if args.d_cs is None:
        args.d_cs = 1 << (22 if args.quick else 26)
    if args.d_dense is None:
        args.d_dense = 1 << (18 if args.quick else 22)
    if args.repeats is None:
        args.repeats = 3 if args.quick else 10
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
