"""The Gram/sketch pass over a sampler step's workspace.

A recording step writes, per parameter, the vectors it records into the rows
of one ``[r, numel]`` workspace. :class:`Reduction` reads that workspace:
``tile @ tile.T`` per tile gives every norm and inner product (float64
across tiles) and ``index_add_`` into a ``[rows, 2k + 1]`` scratch sketches
the leading rows at once.

It runs on the calling thread, after the update. Reducing on a second thread
while the noise is drawn (torch draws it on one core) was measured slower
once that thread runs with one intra-op thread (see :mod:`gradsketch._parallel`):
after each parallel op, torch's idle OpenMP worker keeps the second core
busy-waiting for a few milliseconds, so the second thread starts late and
then shares a core. Giving that thread a team of its own had made every
parallel op of the process slower instead.
"""

from __future__ import annotations

import torch

__all__ = ["REDUCE_TILE", "Reduction"]

#: Columns per tile: tiles bound the float32 partial sums of the Gram
#: (accumulated in float64), and a narrow table is widened one tile at a time.
REDUCE_TILE = 1 << 16


class Reduction:
    """Gram matrix and count sketch of a workspace, advanced tile by tile.

    Args:
        block: ``[r, n]`` workspace.
        gram: accumulate the ``[r, r]`` float64 Gram matrix of the rows.
        scratch: ``[rows, 2k + 1]`` sketch accumulator (zeroed by the caller), or
            ``None`` for no sketch.
        folded: ``[n]`` integer count-sketch table (sign folded into the bucket).
        rows: leading rows of ``block`` to sketch.
        index_buffer: int64 ``[REDUCE_TILE]`` buffer into which tiles of a
            narrower ``folded`` are widened (``index_add_`` is fast with int64
            only); kept by the caller across steps.
    """

    def __init__(
        self,
        block: torch.Tensor,
        *,
        gram: bool,
        scratch: torch.Tensor | None,
        folded: torch.Tensor | None,
        rows: int,
        index_buffer: torch.Tensor | None = None,
    ) -> None:
        self.block = block
        self.n = block.shape[1]
        self.gram = (
            torch.zeros(block.shape[0], block.shape[0], dtype=torch.float64, device=block.device)
            if gram
            else None
        )
        self.scratch, self.folded, self.rows = scratch, folded, rows
        self.index_buffer = index_buffer

    def _index_tile(self, start: int, end: int) -> torch.Tensor:
        assert self.folded is not None
        index = self.folded[start:end]
        if index.dtype == torch.int64:
            return index
        # Narrow tables take less memory and memory traffic; each tile is
        # widened in cache.
        assert self.index_buffer is not None and self.index_buffer.numel() >= index.numel()
        return self.index_buffer[: index.numel()].copy_(index)

    def run(self) -> Reduction:
        """Reduce the whole workspace; returns ``self``.

        The Gram: one batched ``bmm`` over the full tiles (a loop of ``mm``
        took twice as long) plus the last, partial tile. The sketch: one
        ``index_add_`` over every column with an int64 table, or tile by
        tile with a narrow one (widening narrow tiles in the step cost 0.7
        ms per million columns).

        Splitting the sketch into one ``scatter_add_`` piece per thread was
        faster alone (1.03 ms against 1.45 ms per million columns of three
        rows) but slower inside a sampling loop, and was left out.

        Example:
            >>> red = Reduction(torch.ones(2, 10), gram=True, scratch=None, folded=None, rows=0)
            >>> red.run().gram
            tensor([[10., 10.],
                    [10., 10.]], dtype=torch.float64)
        """
        n, size = self.n, REDUCE_TILE
        if self.gram is not None:
            full = n // size
            if full:
                tiles = self.block[:, : full * size].view(-1, full, size).transpose(0, 1)
                self.gram += torch.bmm(tiles, tiles.transpose(1, 2)).sum(0, dtype=torch.float64)
            rest = self.block[:, full * size :]
            if rest.shape[1]:
                self.gram += (rest @ rest.T).to(torch.float64)
        if self.scratch is not None:
            assert self.folded is not None
            rows = self.block[: self.rows]
            if self.folded.dtype == torch.int64:
                self.scratch.index_add_(1, self.folded, rows)
            else:
                for start in range(0, n, size):
                    end = min(start + size, n)
                    index = self._index_tile(start, end)
                    self.scratch.index_add_(1, index, rows[:, start:end])
        return self
