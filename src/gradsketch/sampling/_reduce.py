"""The fused Gram/sketch pass over a sampler step's workspace, optionally on a second core.

A recording step writes, per parameter, the vectors it records into the rows
of one ``[r, numel]`` workspace. :class:`Reduction` reads that workspace tile
by tile: ``tile @ tile.T`` gives every norm and inner product (float64
across tiles) and one ``index_add_`` into a ``[rows, 2k + 1]`` scratch
sketches the leading rows at once.

Drawing the noise (``normal_``) runs on one core. :class:`Pipeline` lets a
background thread reduce the tiles whose columns are already written while
the step draws the rest of the noise, so the recording uses the core the
noise leaves idle. The tiles, and the order in which they are added, are the
same with or without the pipeline, so the results are bit for bit equal.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import torch

from gradsketch._parallel import background

__all__ = ["NOISE_CHUNK", "REDUCE_TILE", "Pipeline", "Reduction", "chunked_normal_"]

#: Columns per tile: a ``[r, tile]`` float32 tile and its slice of the table
#: stay in a core's L2 cache while both reductions read them, and tiles bound
#: the float32 partial sums of the Gram (accumulated in float64).
REDUCE_TILE = 1 << 16
#: Entries of noise drawn per call when a pipeline is waiting for them (a
#: multiple of 16, see :func:`chunked_normal_`).
NOISE_CHUNK = 1 << 16
#: Steps with fewer recorded columns reduce on the calling thread: handing
#: work to another thread costs tens of microseconds.
PIPELINE_MIN_COLUMNS = 1 << 17


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
        self.done = 0  # columns reduced so far
        self.gram = (
            torch.zeros(block.shape[0], block.shape[0], dtype=torch.float64, device=block.device)
            if gram
            else None
        )
        self.scratch, self.folded, self.rows = scratch, folded, rows
        self.index_buffer = index_buffer

    def next_end(self) -> int:
        """The column the next tile ends at."""
        return min(self.done + REDUCE_TILE, self.n)

    def _index_tile(self, start: int, end: int) -> torch.Tensor:
        assert self.folded is not None
        index = self.folded[start:end]
        if index.dtype == torch.int64:
            return index
        # Narrow tables take less memory and memory traffic; each tile is
        # widened in cache.
        assert self.index_buffer is not None and self.index_buffer.numel() >= index.numel()
        return self.index_buffer[: index.numel()].copy_(index)

    def advance(self, ready: int) -> None:
        """Reduce every whole tile whose columns all lie below ``ready``."""
        while self.done < self.n:
            end = self.next_end()
            if end > ready:
                return
            tile = self.block[:, self.done : end]
            if self.gram is not None:
                self.gram += (tile @ tile.T).to(torch.float64)
            if self.scratch is not None:
                self.scratch.index_add_(1, self._index_tile(self.done, end), tile[: self.rows])
            self.done = end


class Pipeline:
    """Runs :meth:`Reduction.advance` on the background thread as columns get written.

    The writer calls :meth:`ready` with the number of leading columns it has
    finished (in every row), then :meth:`finish` once all are written; until
    then it must not write below the last ``ready`` column again.
    :meth:`abort` stops the reduction when the step fails.

    Example:
        >>> block = torch.ones(2, 10)
        >>> pipe = Pipeline(Reduction(block, gram=True, scratch=None, folded=None, rows=0))
        >>> pipe.ready(4)
        >>> pipe.finish().gram
        tensor([[10., 10.],
                [10., 10.]], dtype=torch.float64)
    """

    def __init__(self, reduction: Reduction) -> None:
        self.reduction = reduction
        self._cond = threading.Condition()
        self._ready = 0
        self._closed = False
        self._aborted = False
        self._future = background().submit(self._run)

    def _run(self) -> None:
        red = self.reduction
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._ready >= red.next_end())
                if self._aborted:
                    return
                ready, closed = self._ready, self._closed
            red.advance(ready)
            if closed:
                return

    def ready(self, columns: int) -> None:
        """The first ``columns`` columns of every row are written."""
        with self._cond:
            self._ready = columns
            self._cond.notify()

    def finish(self) -> Reduction:
        """All columns are written: wait for the reduction and return it."""
        with self._cond:
            self._ready, self._closed = self.reduction.n, True
            self._cond.notify()
        self._future.result()
        return self.reduction

    def abort(self) -> None:
        """Stop early (the step failed); waits until the thread has let go of the block."""
        with self._cond:
            self._aborted = self._closed = True
            self._cond.notify()
        try:
            self._future.result()
        except Exception:
            pass


@functools.cache
def _chunks_match_whole(dtype: torch.dtype) -> bool:
    """Whether ``normal_`` drawn in :data:`NOISE_CHUNK`-sized pieces equals one draw.

    torch's CPU ``normal_`` fills blocks of 16 from the generator in order,
    so pieces that are multiples of 16 draw exactly what one call draws.
    Checked once per dtype on this torch build (on small sizes, with pieces
    of 32); where it does not hold the noise is drawn whole.
    """
    whole, pieces = torch.empty(117, dtype=dtype), torch.empty(117, dtype=dtype)
    whole.normal_(0.0, 2.0, generator=torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(3)
    for start in range(0, 117 - 32, 32):
        pieces[start : start + 32].normal_(0.0, 2.0, generator=gen)
    pieces[96:].normal_(0.0, 2.0, generator=gen)
    return torch.equal(whole, pieces)


def chunked_normal_(
    out: torch.Tensor,
    std: float,
    generator: torch.Generator | None,
    ready: Callable[[int], None] | None,
    offset: int,
) -> None:
    """Fill ``out`` (contiguous) with N(0, std²) exactly as one ``normal_`` would.

    With ``ready``, the noise is drawn :data:`NOISE_CHUNK` entries at a time
    and ``ready(offset + end)`` is called after each piece (the last piece
    takes the remainder, so it is never shorter than 16 entries).
    """
    flat = out.view(-1)
    n = flat.numel()
    chunked = ready is not None and n >= 2 * NOISE_CHUNK and out.device.type == "cpu"
    if not chunked or not _chunks_match_whole(out.dtype):
        out.normal_(0.0, std, generator=generator)
        return
    assert ready is not None
    start = 0
    while start < n:
        end = n if n - start < 2 * NOISE_CHUNK else start + NOISE_CHUNK
        flat[start:end].normal_(0.0, std, generator=generator)
        ready(offset + end)
        start = end
