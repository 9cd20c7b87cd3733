"""Count sketches of scaled rows in devinterp's order of rounding (a sampler's components).

A sampler step records its update components as scalar multiples
``a_c * (b_c * x_c)`` of a few rows ``x_c`` (the gradient, the noise,
``w - w0``, ...). devinterp 2.0.1 computes each element of a component in
the parameter's dtype (``b_c`` first, then ``a_c``, each scalar rounded to
that dtype), converts it to float32, and adds it times its sign into its
bucket with ``scatter_add_``, parameter after parameter: on the CPU each
bucket sums its elements in order. Its tests compare a sampler's sketch
with that scatter at ``atol=0``, so :func:`scatter_components_` does the
same operations in the same order:

* with the native kernel (``csrc/gs_ordered.c``, CPU, compiled at first use
  like :mod:`gradsketch.sketch._native`'s): each element is scaled as it is
  read and added at once, one pass over the rows, no scaled copy;
* otherwise (GPU, or the native kernels off): torch's operations, tile by
  tile, then ``scatter_add_`` (bit-equal on the CPU; CUDA's atomic adds sum
  in no fixed order).

The native kernel is used where :func:`gradsketch.sketch._backend.default_backend`
picks the native scatter (so ``GRADSKETCH_NATIVE_SKETCH=0`` turns it off too);
``GRADSKETCH_NATIVE_ORDERED=0`` turns off this one alone.

Example:
    >>> out = torch.zeros(1, 2)
    >>> rows = torch.tensor([[1.0, 2.0, 3.0]])
    >>> folded = torch.tensor([0, 3, 4])  # +bucket 0, -bucket 1, skipped (2k)
    >>> scatter_components_(out, folded, rows, [(0, 0, 0.5, 2.0)])
    >>> out
    tensor([[ 1., -2.]])
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch

from gradsketch import _native_build
from gradsketch.sketch import _backend

__all__ = ["SketchComponent", "ordered_status", "scatter_components_"]

#: ``(output row c, source row, a, b)``: ``out[c] += S(a * (b * rows[source]))``.
SketchComponent = tuple[int, int, float, float]

#: Must equal ``gs_abi_version()`` in ``csrc/gs_ordered.c``.
ABI_VERSION = 1
_VALUE = _native_build.VALUE_SUFFIX
_INDEX = _native_build.INDEX_SUFFIX
#: The C sources (package data), compiled and loaded by :mod:`gradsketch._native_build`.
SOURCES = ("gs_ordered.c", "gs_ordered.h", "gs_each_index.h", "gs_ordered_index.h")
SPEC = _native_build.NativeSpec.typed("ordered", __file__, SOURCES, ABI_VERSION, "gs_ordered")
#: Most components one call takes (``GS_MAX_COMPONENTS`` in ``gs_ordered.c``).
MAX_COMPONENTS = 8
#: Columns per tile of the torch path: bounds its float32 temporaries.
TILE = 1 << 16
#: The same on CUDA, where each tile costs a few kernel launches.
CUDA_TILE = 1 << 22
#: Fewest columns per component worth a second thread.
MIN_PER_THREAD = 1 << 15

_ARGTYPES = [
    ctypes.c_void_p,  # ptrs: row q of segment s at [s * r + q]
    ctypes.c_void_p,  # starts: int64 [nseg + 1]
    ctypes.c_int64,  # nseg
    ctypes.c_int64,  # r
    ctypes.c_int64,  # nc
    ctypes.c_void_p,  # dst_row: int64 [nc]
    ctypes.c_void_p,  # src: int64 [nc]
    ctypes.c_void_p,  # a: double [nc]
    ctypes.c_void_p,  # b: double [nc]
    ctypes.c_void_p,  # idx
    ctypes.c_void_p,  # out: float32
    ctypes.c_int64,  # k
    ctypes.c_int64,  # os
    ctypes.c_int,  # threads
]


def _load() -> tuple[_native_build.NativeStatus, dict[tuple[str, str], Any] | None]:
    return _native_build.bind_kernels(
        SPEC, "gs_ordered", _VALUE.values(), _INDEX.values(), _ARGTYPES
    )


#: The kernel, bound at first use (tests set ``_LOADED.state`` to switch it off).
_LOADED = _native_build.OnceLoaded(SPEC, _load, "torch's scatter_add_")
_kernels = _LOADED.get
#: Whether the ordered kernel is in use (:meth:`~gradsketch._native_build.OnceLoaded.status`).
ordered_status = _LOADED.status


def scatter_components_(
    out: torch.Tensor,
    folded: torch.Tensor,
    rows: torch.Tensor | list[list[torch.Tensor]],
    components: Sequence[SketchComponent],
) -> None:
    """``out[c] += S(a * (b * rows[src]))`` for each ``(c, src, a, b)``, in devinterp's rounding.

    Each element is computed in the rows' dtype (``b`` then ``a``, each
    rounded to that dtype first), converted to float32 and added times its
    sign into its bucket, columns in increasing order (see the module).

    Args:
        out: float32 ``[>= 5, k]`` running sketches (added into; rows contiguous).
        folded: ``[n]`` int16/32/64 table: ``bucket + k * [sign < 0]``, or ``2k`` for a
            column outside the sketch (skipped).
        rows: ``[r, n]`` float32/float64 block, or its columns as segments
            (``rows[s][q]``: row ``q`` of the ``s``-th run of columns, contiguous).
        components: ``(c, src, a, b)`` per sketched component.
    """
    if not components:
        return
    if _native(out, folded, rows, components):
        return
    block = rows if isinstance(rows, torch.Tensor) else _stack(rows)
    k = out.shape[1]
    n = block.shape[1]
    tile = CUDA_TILE if block.device.type == "cuda" else TILE
    for start in range(0, n, tile):
        f = folded[start : start + tile].to(torch.int64)
        neg = f >= k
        bucket = f - k * neg.to(torch.int64)
        sign = 1.0 - 2.0 * neg.to(torch.float32)
        keep = (f < 2 * k).nonzero().flatten() if bool((f >= 2 * k).any()) else None
        if keep is not None:
            bucket, sign = bucket[keep], sign[keep]
        for c, src, a, b in components:
            v = block[src, start : start + tile]
            if b != 1.0:
                v = v * b
            if a != 1.0:
                v = v * a
            v = v.to(torch.float32)
            if keep is not None:
                v = v[keep]
            out[c].scatter_add_(0, bucket, sign * v)


def _stack(segments: list[list[torch.Tensor]]) -> torch.Tensor:
    r = len(segments[0])
    return torch.stack([torch.cat([seg[q].reshape(-1) for seg in segments]) for q in range(r)])


def _native(
    out: torch.Tensor,
    folded: torch.Tensor,
    rows: torch.Tensor | list[list[torch.Tensor]],
    components: Sequence[SketchComponent],
) -> bool:
    """The native kernel, where it runs and takes these tensors; False (nothing done) otherwise."""
    if isinstance(rows, torch.Tensor):
        if rows.dim() != 2 or (rows.shape[1] > 1 and rows.stride(1) != 1):
            return False
        r, n = rows.shape
        base, step = rows.data_ptr(), rows.stride(0) * rows.element_size()
        ptrs, starts, dtype, device = [base + q * step for q in range(r)], [0, n], rows.dtype, rows
    else:
        if not rows or not rows[0]:
            return False
        r, dtype, device = len(rows[0]), rows[0][0].dtype, rows[0][0]
        found = _native_build.segment_pointers(rows)
        if found is None:
            return False
        ptrs, starts = found
    if dtype not in _VALUE or len(components) > MAX_COMPONENTS:
        return False
    if _backend.default_backend(device, kernel="scatter") != "native":
        return False
    if out.dtype != torch.float32 or out.device.type != "cpu" or out.stride(1) != 1:
        return False
    if folded.dtype not in _INDEX or folded.device.type != "cpu" or not folded.is_contiguous():
        return False
    if folded.numel() != starts[-1] or max(c for c, *_ in components) >= out.shape[0]:
        return False
    kernels = _kernels()
    if kernels is None:
        return False
    n = starts[-1]
    if n == 0:
        return True
    if len({c for c, *_ in components}) != len(components):
        return False
    threads = max(1, min(torch.get_num_threads(), len(components), n // MIN_PER_THREAD or 1))
    code = _call(kernels, out, folded, ptrs, starts, r, components, dtype, threads)
    if code == 1:
        raise IndexError(
            f"a count-sketch table holds a column outside [0, {2 * out.shape[1]}]; the table "
            "and the output width disagree (rebuild the table for this output_dim)."
        )
    if code == -1:
        raise ValueError("the ordered count-sketch kernel refused its arguments")
    return True


def _call(
    kernels: dict[tuple[str, str], Any],
    out: torch.Tensor,
    folded: torch.Tensor,
    ptrs: list[int],
    starts: list[int],
    r: int,
    components: Sequence[SketchComponent],
    dtype: torch.dtype,
    threads: int,
) -> int:
    """The kernel over every component at once: one pass over the rows."""
    fn = kernels[_VALUE[dtype], _INDEX[folded.dtype]]
    nc = len(components)
    return int(
        fn(
            (ctypes.c_void_p * len(ptrs))(*ptrs),
            (ctypes.c_int64 * len(starts))(*starts),
            len(starts) - 1,
            r,
            nc,
            (ctypes.c_int64 * nc)(*(c for c, _, _, _ in components)),
            (ctypes.c_int64 * nc)(*(src for _, src, _, _ in components)),
            (ctypes.c_double * nc)(*(float(a) for _, _, a, _ in components)),
            (ctypes.c_double * nc)(*(float(b) for _, _, _, b in components)),
            folded.data_ptr(),
            out.data_ptr(),
            out.shape[1],
            out.stride(0),
            threads,
        )
    )
