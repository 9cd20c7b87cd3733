"""Native CPU kernels for the count-sketch scatter, compiled at first use.

torch's CPU scatter (``index_add_`` / ``scatter_add_``) is generic: every
element pays for stride arithmetic, a bounds check and a loop over the
other dimensions, and one row runs on one thread. The count sketch is the
library's hot loop (the projectors, :class:`CountSketch`, the sampler's
per-step sketches), so ``csrc/gs_kernels.c`` does it directly: four rows
share each index load, a chunk of columns stays in cache, and few rows are
split by columns over torch's threads. The sampler's pass also takes the
Gram matrix of its rows from the chunk the scatter has just read, so the
rows are read from memory once.

The C file is compiled the first time a kernel is needed and cached, by
:mod:`gradsketch._native_build` (which also builds the SLT sampler's train
kernels, a library of their own). ``GRADSKETCH_NATIVE_SKETCH=0`` (or
``GRADSKETCH_NATIVE=0``, which turns off both) makes every caller use
torch's scatter instead, as does a machine where the kernels cannot be
built or loaded: same results up to the order of float additions, with one
WARNING-level log line saying why (INFO when turned off on purpose).

Example:
    >>> import torch
    >>> out = torch.zeros(1, 4)
    >>> used = reduce_(out, torch.tensor([0, 3, 3]), torch.ones(1, 3))
    >>> out if used else torch.tensor([[1.0, 0.0, 0.0, 2.0]])
    tensor([[1., 0., 0., 2.]])
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from gradsketch import _native_build
from gradsketch._native_build import NativeStatus, blas_sgemm

__all__ = [
    "NativeStatus",
    "available",
    "blas_sgemm",
    "buckets_and_signs_",
    "library",
    "native_status",
    "reduce_",
    "reduce_rows_",
]

#: Must equal ``gs_abi_version()`` in ``gs_kernels.c``.
ABI_VERSION = 6
_VALUE = _native_build.VALUE_SUFFIX
_INDEX = _native_build.INDEX_SUFFIX
#: The C sources (package data), compiled and loaded by :mod:`gradsketch._native_build`.
SPEC = _native_build.NativeSpec.typed(
    "sketch",
    __file__,
    ("gs_kernels.c", "gs_reduce_index.h", "gs_each_index.h", "gs_reduce.h"),
    ABI_VERSION,
    "gs_reduce",
)
#: Columns per chunk when threads split the columns: the chunk's rows stay in
#: L1 from the scatter to the Gram (3 rows of 2048 float32 are 24 KB).
CHUNK = 2048
#: Columns per chunk when threads take whole rows: the index slice is read by
#: every group of four rows from L2 (measured on 32 rows of 2^20: 16384 columns
#: take 9.1-10.7 ms, 2048 take 10.6-11.6 ms).
ROW_CHUNK = 1 << 14
#: Fewest rows per thread for the transposed scatter (0 turns it off), which
#: holds a ``[width, 16]`` float32 (``[width, 8]`` float64) buffer per thread
#: (on two threads, per row: 2 rows lose, 4 rows gain a third, 16 rows two thirds).
TRANSPOSED_MIN_ROWS = 4
#: Largest transposed buffer per thread, in bytes: it stays in L2.
TRANSPOSED_MAX_BYTES = 1 << 20
#: Fewest elements per thread worth a thread of its own.
MIN_PER_THREAD = 1 << 15

_ARGTYPES = [
    ctypes.c_void_p,  # ptrs: row q of segment s at [s * r + q]
    ctypes.c_void_p,  # starts: int64 [nseg + 1] first column of each segment
    ctypes.c_int64,  # nseg
    ctypes.c_int64,  # r
    ctypes.c_int64,  # srows
    ctypes.c_void_p,  # idx
    ctypes.c_void_p,  # out
    ctypes.c_int64,  # width
    ctypes.c_int64,  # os
    ctypes.c_void_p,  # gram
    ctypes.c_int,  # threads
    ctypes.c_int64,  # chunk
    ctypes.c_int64,  # tmin
]
#: Rows one kernel call takes (``GS_MAX_ROWS`` in ``gs_kernels.c``).
MAX_ROWS = 64


#: The key of the loaded library itself among the kernels.
_LIBRARY = ("library", "")


def _load() -> tuple[NativeStatus, dict[tuple[str, str], Any] | None]:
    """Load :data:`SPEC`'s library (:func:`gradsketch._native_build.load`) and bind its kernels."""
    return _native_build.bind_kernels(
        SPEC, "gs_reduce", _VALUE.values(), _INDEX.values(), _ARGTYPES, keep_library=True
    )


#: The kernels, bound at first use (tests set ``_LOADED.state`` to switch them off).
_LOADED = _native_build.OnceLoaded(SPEC, _load, "torch's scatter")
_kernels = _LOADED.get


def native_status() -> NativeStatus:
    """Load (compiling if needed) the native kernels and say whether they are in use.

    Example:
        >>> isinstance(native_status().available, bool)
        True
    """
    return _LOADED.status()


def library() -> ctypes.CDLL | None:
    """The loaded sketch library (None when unavailable).

    Example:
        >>> library() is None or hasattr(library(), "gs_reduce_f32_i64")
        True
    """
    kernels = _kernels()
    return None if kernels is None else kernels.get(_LIBRARY)


def available(device: torch.device) -> bool:
    """True when eligible scatters on ``device`` use the native kernels (CPU only)."""
    return device.type == "cpu" and _kernels() is not None


def buckets_and_signs_(out: torch.Tensor, key: int, offset: int, num_buckets: int) -> bool:
    """Fill int64 ``out`` with the folded count-sketch table of ``offset, offset + 1, ...``.

    The C twin of :func:`gradsketch.sketch._tables.buckets_and_signs` for
    coordinates below 2**32 (integer arithmetic: the same bits on every CPU).
    Returns False, leaving ``out`` alone, where the kernels are not loaded.
    """
    lib = library()
    if lib is None:
        return False
    fn = lib.gs_buckets_and_signs
    fn.argtypes = [ctypes.c_uint32, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    fn(key & 0xFFFFFFFF, offset, out.numel(), num_buckets, out.data_ptr())
    return True


def _eligible(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dim() == 2 and (t.stride(1) == 1 or t.shape[1] <= 1)


def reduce_(
    out: torch.Tensor | None,
    index: torch.Tensor | None,
    block: torch.Tensor,
    *,
    rows: int | None = None,
    gram: torch.Tensor | None = None,
) -> bool:
    """``out[:, index] += block[:rows]`` (a scatter along columns) and ``gram = block @ block.T``.

    Returns False, touching nothing, when the native kernels are unavailable
    or the tensors do not fit them (not CPU, other dtypes, columns not
    contiguous): the caller then does the same with torch.

    Args:
        out: ``[rows, width]`` accumulator, the dtype of ``block``; None with ``rows=0``.
        index: int16/32/64 ``[n]`` column of ``out`` for each column of ``block``.
        block: float32/float64 ``[r, n]`` values.
        rows: leading rows of ``block`` to scatter (default all).
        gram: float64 ``[r, r]`` contiguous output for the Gram matrix, or None.

    Raises:
        IndexError: if ``index`` holds a column outside ``out`` (those
            entries are skipped; the others are added).
        MemoryError: if the per-thread partial sums cannot be allocated.
    """
    if not _eligible(block):
        return False
    r, n = block.shape
    rows = r if rows is None else rows
    # Row pointers by arithmetic: building a view per row costs a microsecond
    # each, which small blocks of many rows (a batch of per-parameter
    # gradients) would pay on every call.
    base, step = block.data_ptr(), block.stride(0) * block.element_size()
    if gram is not None or r <= MAX_ROWS:
        ptrs = [base + q * step for q in range(r)]
        return _run(ptrs, [0, n], r, rows, index, out, gram, block.dtype)
    # More rows than one call takes: slices of rows, each sharing the index.
    for start in range(0, rows, MAX_ROWS):
        stop = min(start + MAX_ROWS, rows)
        ptrs = [base + q * step for q in range(start, stop)]
        part = None if out is None else out[start:stop]
        if not _run(ptrs, [0, n], stop - start, stop - start, index, part, None, block.dtype):
            assert start == 0, "the same tensors were accepted for the first slice"
            return False
    return True


def reduce_rows_(
    out: torch.Tensor | None,
    index: torch.Tensor | None,
    segments: list[list[torch.Tensor]],
    *,
    rows: int | None = None,
    gram: torch.Tensor | None = None,
) -> bool:
    """:func:`reduce_` of a block given as segments of columns, each row its own tensor.

    ``segments[s][q]`` is row ``q`` of the ``s``-th run of columns (any
    contiguous tensor, flattened); the block is their concatenation along
    columns. The sampler passes one segment per parameter, with each
    parameter's gradient as a row where autograd left it (no copy into a
    workspace).

    Returns False, touching nothing, when the kernels or the tensors do not fit.
    """
    if not segments or not segments[0]:
        return False
    found = _native_build.segment_pointers(segments)
    if found is None:
        return False
    r = len(segments[0])
    ptrs, starts = found
    dtype = segments[0][0].dtype
    return _run(ptrs, starts, r, r if rows is None else rows, index, out, gram, dtype)


def _transposed_min_rows(out: torch.Tensor | None, columns: int) -> int:
    """The kernel's ``tmin``: rows per thread from which it scatters transposed (0: never).

    Never when the output is too wide for the buffer to stay in L2, or when
    the block has fewer than two columns per output column (copying the
    output into the buffer and back would cost more than it saves).
    """
    if out is None or out.shape[1] * 64 > TRANSPOSED_MAX_BYTES or columns < 2 * out.shape[1]:
        return 0
    return TRANSPOSED_MIN_ROWS


def _run(
    ptrs: list[int],
    starts: list[int],
    r: int,
    rows: int,
    index: torch.Tensor | None,
    out: torch.Tensor | None,
    gram: torch.Tensor | None,
    dtype: torch.dtype | None,
) -> bool:
    """Check the outputs against the rows (``ptrs``, segment ``starts``) and call the kernel."""
    if rows and (out is None or index is None):
        raise ValueError("`out` and `index` are needed to scatter rows; pass rows=0 for none.")
    if dtype not in _VALUE or r > MAX_ROWS or rows > r:
        return False
    n = starts[-1]
    if rows:
        assert out is not None and index is not None
        if not _eligible(out) or out.dtype != dtype or out.shape[0] < rows:
            return False
        if index.dtype not in _INDEX or index.device.type != "cpu" or index.numel() != n:
            return False
        if not index.is_contiguous():
            return False
    if gram is not None and (
        gram.dtype != torch.float64 or gram.shape != (r, r) or not gram.is_contiguous()
    ):
        return False
    kernels = _kernels()
    if kernels is None:
        return False
    if r == 0 or n == 0:
        if gram is not None:
            gram.zero_()
        return True
    fn = kernels[_VALUE[dtype], _INDEX[index.dtype] if rows and index is not None else "i64"]
    threads = max(1, min(torch.get_num_threads(), (r * n) // MIN_PER_THREAD))
    chunk = ROW_CHUNK if gram is None and rows >= 2 * threads else CHUNK
    code = fn(
        (ctypes.c_void_p * len(ptrs))(*ptrs),
        (ctypes.c_int64 * len(starts))(*starts),
        len(starts) - 1,
        r,
        rows,
        index.data_ptr() if rows and index is not None else None,
        out.data_ptr() if rows and out is not None else None,
        out.shape[1] if rows and out is not None else 0,
        out.stride(0) if rows and out is not None else 0,
        gram.data_ptr() if gram is not None else None,
        threads,
        chunk,
        _transposed_min_rows(out, n),
    )
    if code == 1:
        width = out.shape[1] if out is not None else 0
        raise IndexError(
            f"a count-sketch table holds a column outside [0, {width}) of the output; "
            "the table and the output width disagree (rebuild the table for this output_dim)."
        )
    if code == -1:
        raise MemoryError("the native scatter could not allocate its per-thread partial sums")
    return True
