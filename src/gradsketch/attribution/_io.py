"""Moving rows of features in and out of the kernels, and planning how many at once.

Rows are read from torch tensors, numpy arrays and memmaps, and zarr arrays
alike (anything with ``shape`` and row slicing). Reads from outside torch
are prefetched in a background thread; writes go through the ground floor's
:class:`gradsketch._writer.BackgroundWriter`. The block sizes keep the working
memory of the scoring kernel under a byte budget.
"""

from __future__ import annotations

import itertools
from collections.abc import Generator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import zarr
from torch import Tensor

from gradsketch._integrity import read_rows
from gradsketch._writer import BackgroundWriter

#: Bytes of one row block read at once when no memory budget is given: large
#: enough that every GEMM runs at full speed, small enough to stay far below
#: the size of an ``[n, k]`` store (50,000 x 2,048 float32 is 400 MB).
DEFAULT_BLOCK_BYTES = 64 << 20
#: Bytes of the targets' right-hand sides held at once when no memory budget is
#: given: every target of a projected store (k = 2,048: 131,072 targets), a few
#: of a model's dense per-layer gradients (GPT-2 small: 341 MB each).
DEFAULT_TARGET_BYTES = 1 << 30


def rows_as_tensor(
    array: Any, start: int, stop: int, *, device: torch.device, dtype: torch.dtype
) -> Tensor:
    """Rows ``start:stop`` of a tensor, numpy array, memmap or zarr array, as a tensor.

    A zarr array on local disk is read from its chunk files, each checked
    against its crc32c (:func:`gradsketch._integrity.read_rows`), else through zarr.
    """
    if isinstance(array, Tensor):
        block = array[start:stop]
    else:
        # A store's chunk files are read (and their checksums checked) directly.
        raw = read_rows(array, start, stop) if isinstance(array, zarr.Array) else None
        if raw is None:
            raw = np.ascontiguousarray(np.asarray(array[start:stop]))
        block = torch.from_numpy(raw)
    return block.to(device=device, dtype=dtype)


def default_block_rows(n: int, k: int, itemsize: int = 4) -> int:
    """Rows of ``k`` columns in :data:`DEFAULT_BLOCK_BYTES` (at least 1, at most ``n``)."""
    return max(1, min(max(n, 1), DEFAULT_BLOCK_BYTES // max(1, itemsize * k)))


def iter_row_blocks(
    array: Any,
    block_rows: int,
    *,
    device: torch.device,
    dtype: torch.dtype,
    start: int = 0,
    stop: int | None = None,
    prefetch: bool = True,
) -> Generator[tuple[int, int, Tensor], None, None]:
    """``(i0, i1, rows i0:i1 as a tensor)`` over ``start:stop`` in blocks of ``block_rows``.

    For arrays that live outside torch (zarr, memmaps, numpy) the next block is
    read in a background thread while the caller multiplies the current one,
    so reading a store from disk overlaps the GEMMs instead of adding to them.
    At most two blocks are held at once (one without ``prefetch``, for
    callers that budget memory for a single block).
    """
    stop = int(array.shape[0]) if stop is None else stop
    edges = [*range(start, stop, max(1, block_rows)), stop]
    spans = list(itertools.pairwise(edges))
    if not prefetch or isinstance(array, Tensor) or len(spans) < 2:
        for i0, i1 in spans:
            yield i0, i1, rows_as_tensor(array, i0, i1, device=device, dtype=dtype)
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradsketch-read") as pool:

        def read(span: tuple[int, int]) -> Tensor:
            return rows_as_tensor(array, span[0], span[1], device=device, dtype=dtype)

        pending: Future[Tensor] = pool.submit(read, spans[0])
        for i, (i0, i1) in enumerate(spans):
            block = pending.result()
            if i + 1 < len(spans):
                pending = pool.submit(read, spans[i + 1])
            yield i0, i1, block


def array_writer(array: Any) -> BackgroundWriter[tuple[slice, slice, np.ndarray]]:
    """A writer of ``array[rows, cols] = values`` jobs, one write in flight.

    Used for destinations outside memory (zarr arrays on disk): the write of
    one tile overlaps the multiplication of the next. ``close()`` waits for
    the last write and re-raises its error, if any.

    Example:
        >>> out = np.zeros((2, 3))
        >>> writer = array_writer(out)
        >>> writer.submit((slice(0, 1), slice(0, 3), np.ones((1, 3))))
        >>> writer.close()
        >>> out.sum()
        np.float64(3.0)
    """

    def write(job: tuple[slice, slice, np.ndarray]) -> None:
        rows, cols, values = job
        array[rows, cols] = values

    return BackgroundWriter(write, max_pending=1, name="gradsketch-write")


def block_plan(
    n: int, m: int, k: int, checkpoints: int, memory_budget: int | None, *, gram: bool = True
) -> tuple[int, int]:
    """Row block and target-column block sizes that keep working memory under the budget.

    Working memory (float32) per tile: the checkpoints' right-hand sides
    ``C * k * m_block``, one row block of gradients ``n_block * k``, and the
    accumulator plus one product ``2 * n_block * m_block``; with ``gram``
    (TRAK's XᵀX, ``k x k``) also that matrix and its float64 factorisation.
    Half the budget goes to the right-hand sides. Without a budget every row
    is one block and the right-hand sides take at most
    :data:`DEFAULT_TARGET_BYTES` (a model's dense per-layer gradients are
    hundreds of MB per target).
    """
    if memory_budget is None:
        m_block = DEFAULT_TARGET_BYTES // max(1, 4 * checkpoints * k)
        return max(n, 1), max(1, min(m, m_block))
    fixed = 24 * k * k if gram else 0
    avail = memory_budget - fixed
    if avail <= 4 * (checkpoints * k + k + 2):
        minimum = fixed + 4 * (checkpoints * k + k + 2) + 1
        raise ValueError(
            f"`memory_budget`={memory_budget} bytes is too small for proj_dim k={k} "
            f"({checkpoints} checkpoint(s)); it needs at least {minimum} bytes. Raise the "
            "budget or lower proj_dim."
        )
    m_block = max(1, min(m, (avail // 2) // (4 * checkpoints * k)))
    rest = avail - 4 * checkpoints * k * m_block
    n_block = max(1, min(n, rest // (4 * (k + 2 * m_block))))
    return n_block, m_block


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ints."""
    return -(-a // b)
