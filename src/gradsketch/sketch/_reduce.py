"""The Gram/sketch pass over a workspace of rows (a sampler step's).

A recording step writes, per parameter, the vectors it records into the rows
of one ``[r, numel]`` workspace. :func:`reduce_workspace` reads that workspace:
``tile @ tile.T`` per tile gives every norm and inner product (float64
across tiles) and one scatter into a ``[rows, 2k + 1]`` scratch sketches
the leading rows at once.

It runs on the calling thread, after the update: a second thread would
start late behind torch's busy-waiting OpenMP worker and then share its core
(see :mod:`gradsketch._parallel`).
"""

from __future__ import annotations

import torch

from gradsketch.sketch import _backend
from gradsketch.sketch._countsketch import scatter_folded_

__all__ = ["REDUCE_TILE", "reduce_workspace"]

#: Columns per tile: tiles bound the float32 partial sums of the Gram
#: (accumulated in float64), and a narrow table is widened one tile at a time.
REDUCE_TILE = 1 << 16


def reduce_workspace(
    block: torch.Tensor | list[list[torch.Tensor]],
    *,
    gram: bool,
    scratch: torch.Tensor | None,
    folded: torch.Tensor | None,
    rows: int,
    index_buffer: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Gram matrix of a workspace's rows, and their count sketch added into ``scratch``.

    With the native kernels (CPU; :mod:`gradsketch.sketch._backend` chooses) both come
    from one pass: each chunk of columns is scattered, then its Gram taken
    while it is still in cache, and any table width is read as it is. Otherwise:
    the Gram is one batched ``bmm`` over the full tiles (a loop of ``mm`` took
    twice as long) plus the last, partial tile. The sketch: one
    scatter (:func:`~gradsketch.sketch._countsketch.scatter_folded_`) over every column
    with an int64 table, or tile by tile with a narrow one, each tile widened
    into ``index_buffer`` (widening narrow tiles in the step cost 0.7 ms per
    million columns).

    Args:
        block: ``[r, n]`` workspace, or its columns as segments: ``block[s][q]``
            is row ``q`` of the ``s``-th run of columns, each row a contiguous
            tensor of its own (a sampler's gradients, read where autograd
            left them; see :func:`gradsketch.sketch._backend.reduce_rows_`).
            Without the native kernels the segments are copied into one block.
        gram: compute the ``[r, r]`` float64 Gram matrix of the rows.
        scratch: ``[rows, 2k + 1]`` sketch accumulator, or ``None`` for no sketch.
        folded: ``[n]`` integer count-sketch table (sign folded into the bucket).
        rows: leading rows of ``block`` to sketch.
        index_buffer: int64 buffer of at least :data:`REDUCE_TILE` entries
            (needed for a narrower ``folded``; kept by the caller across steps).

    Returns:
        The Gram matrix, or ``None`` without ``gram``.

    Example:
        >>> reduce_workspace(torch.ones(2, 10), gram=True, scratch=None, folded=None, rows=0)
        tensor([[10., 10.],
                [10., 10.]], dtype=torch.float64)
    """
    r = len(block[0]) if isinstance(block, list) else block.shape[0]
    result = torch.empty(r, r, dtype=torch.float64) if gram else None
    sketch_rows = rows if scratch is not None else 0
    if gram or sketch_rows:
        if isinstance(block, list):
            used = _backend.reduce_rows_(scratch, folded, block, rows=sketch_rows, gram=result)
        else:
            used = _backend.reduce_(scratch, folded, block, rows=sketch_rows, gram=result)
        if used:
            return result
    if isinstance(block, list):
        block = torch.stack([torch.cat([seg[q] for seg in block]) for q in range(r)])
    n, size = block.shape[1], REDUCE_TILE
    result = None
    if gram:
        result = torch.zeros(r, r, dtype=torch.float64, device=block.device)
        full = n // size
        if full:
            tiles = block[:, : full * size].view(-1, full, size).transpose(0, 1)
            result += torch.bmm(tiles, tiles.transpose(1, 2)).sum(0, dtype=torch.float64)
        rest = block[:, full * size :]
        if rest.shape[1]:
            result += (rest @ rest.T).to(torch.float64)
    if scratch is not None:
        assert folded is not None
        sketched = block[:rows]
        if folded.dtype == torch.int64:
            scatter_folded_(scratch, folded, sketched)
        else:
            assert index_buffer is not None and index_buffer.numel() >= min(size, n)
            for start in range(0, n, size):
                end = min(start + size, n)
                index = index_buffer[: end - start].copy_(folded[start:end])
                scatter_folded_(scratch, index, sketched[:, start:end])
    return result
