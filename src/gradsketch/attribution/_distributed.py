"""torch.distributed support for TRAK: chunk-aligned row shards and the collectives.

Launch any TRAKer script with ``torchrun`` (gloo on CPU, NCCL on GPU) and call
``torch.distributed.init_process_group`` (or
:func:`gradsketch._distributed.init_from_env`) before building the
:class:`TRAKer`; it then splits the work by itself:

* **featurizing** (and computing target features): rank ``r`` computes only
  the rows of its :func:`chunk_shard`, a contiguous run of whole chunks of the
  zarr store, so two ranks never write the same chunk file (of the data or of
  the done flags); per-layer rows keep one process's compact form (each layer's
  ``[a, g]``, :mod:`~gradsketch.attribution._traker_rows`), which the first rank
  to need a wider one records for all and ``finalize_features`` makes every
  rank's rows take;
* **XᵀX** of each checkpoint: every rank multiplies its own rows and the
  ``[k, k]`` partial sums are added with ``all_reduce`` (``k²`` floats per
  checkpoint on the wire, whatever ``n`` is);
* **the Kronecker factors' eigendecompositions** (K-FAC, EK-FAC): each layer's
  pair is decomposed on one rank, the layers dealt out by cost (``d³``,
  :func:`balanced_owners`), and the bases are broadcast, so every rank holds
  the same bits (:func:`split_over_ranks`);
* **scoring**: rank ``r`` computes the score columns of the targets in its
  :func:`column_shard`; the ``[n, m]`` matrix is assembled with ``all_gather``
  (in memory) or written straight into disjoint column chunks of the zarr
  score array (when it exceeds ``memory_budget``).

Nothing here is needed in a single process: every helper falls back to rank
0 of a world of 1 when no process group is initialised. Rank, barrier and
agreement checks come from the ground-floor :mod:`gradsketch._distributed`
(re-exported here under their old names); the sharding is TRAK's own.

Example:
    >>> chunk_shard(10, 3, rank=0, world_size=2), chunk_shard(10, 3, rank=1, world_size=2)
    (range(0, 6), range(6, 10))
    >>> column_shard(5, rank=1, world_size=2)
    range(3, 5)
    >>> list(ChunkShardSampler(10, 3, rank=1, world_size=2))
    [6, 7, 8, 9]
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import BatchSampler, DataLoader, Sampler, SequentialSampler, Subset

from gradsketch._checks import nonnegative_int, positive_int
from gradsketch._distributed import (
    DistributedMismatchError,
    all_gather_object,
    barrier,
    is_distributed,
    rank_and_world,
    rank_zero_first,
    require_same_across_ranks,
)

__all__ = [
    "ChunkShardSampler",
    "DistributedMismatchError",
    "all_gather_columns",
    "all_reduce_sum_",
    "balanced_owners",
    "barrier",
    "chunk_shard",
    "column_shard",
    "is_distributed",
    "rank_and_world",
    "rank_zero_first",
    "require_same_across_ranks",
    "split_over_ranks",
]


def _check_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Explicit ``rank``/``world_size``, or the process group's when both are ``None``."""
    if rank is None and world_size is None:
        return rank_and_world()
    if rank is None or world_size is None:
        raise ValueError(
            f"pass both `rank` and `world_size` or neither (neither: the process group's), "
            f"got rank={rank!r}, world_size={world_size!r}."
        )
    world_size = positive_int("world_size", world_size)
    rank = nonnegative_int("rank", rank)
    if rank >= world_size:
        raise ValueError(
            f"`rank` must lie in [0, {world_size}) for world_size={world_size}, got {rank}."
        )
    return rank, world_size


def chunk_shard(
    n_rows: int, chunk_rows: int, *, rank: int | None = None, world_size: int | None = None
) -> range:
    """The rows rank ``rank`` owns: a contiguous run of whole chunks.

    The ``ceil(n_rows / chunk_rows)`` chunks are split into ``world_size``
    contiguous runs whose lengths differ by at most one chunk; rank ``r``
    gets chunks ``[r c / W, (r + 1) c / W)`` (integer division). Shards start
    and end on chunk boundaries, so ranks writing their own shards never
    touch the same chunk file.

    Args:
        n_rows: rows of the array.
        chunk_rows: rows per chunk of the array (``zarr_array.chunks[0]``).
        rank: this rank (default: the process group's).
        world_size: number of ranks (default: the process group's).

    Returns:
        A ``range`` of row indices (empty when there are fewer chunks than ranks).

    Example:
        >>> [chunk_shard(7, 2, rank=r, world_size=3) for r in range(3)]
        [range(0, 2), range(2, 4), range(4, 7)]
    """
    n_rows = nonnegative_int("n_rows", n_rows)
    chunk_rows = positive_int("chunk_rows", chunk_rows)
    rank, world_size = _check_rank(rank, world_size)
    n_chunks = -(-n_rows // chunk_rows)
    first = rank * n_chunks // world_size
    last = (rank + 1) * n_chunks // world_size
    return range(min(n_rows, first * chunk_rows), min(n_rows, last * chunk_rows))


def column_shard(
    n_columns: int, *, rank: int | None = None, world_size: int | None = None
) -> range:
    """Columns ``[r w, (r + 1) w)`` with ``w = ceil(n_columns / world_size)``.

    Every rank's block is one column chunk of width ``w`` of the score array,
    so ranks writing their own columns never share a chunk file. The last
    ranks may get fewer columns, or none.

    Example:
        >>> [column_shard(5, rank=r, world_size=3) for r in range(3)]
        [range(0, 2), range(2, 4), range(4, 5)]
    """
    n_columns = nonnegative_int("n_columns", n_columns)
    rank, world_size = _check_rank(rank, world_size)
    width = -(-n_columns // world_size)
    return range(min(n_columns, rank * width), min(n_columns, (rank + 1) * width))


class ChunkShardSampler(Sampler[int]):
    """A ``DistributedSampler`` for TRAK: this rank's chunk-aligned rows, in order.

    Unlike ``torch.utils.data.DistributedSampler`` it never shuffles, pads or
    interleaves: TRAK needs every row exactly once, in the store's row order,
    and each rank's rows must fill whole chunks of the store.

    Args:
        n_rows: size of the dataset.
        chunk_rows: rows per chunk of the store (``TRAKer(chunk_rows=...)``).
        rank: this rank (default: the process group's).
        world_size: number of ranks (default: the process group's).

    Example:
        >>> sampler = ChunkShardSampler(10, 4, rank=1, world_size=2)
        >>> list(sampler), len(sampler)
        ([4, 5, 6, 7, 8, 9], 6)
    """

    def __init__(
        self,
        n_rows: int,
        chunk_rows: int,
        *,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        self.rows = chunk_shard(n_rows, chunk_rows, rank=rank, world_size=world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)


def owned_mask(n_rows: int, chunk_rows: int) -> np.ndarray:
    """Boolean ``[n_rows]``: the rows of this rank's :func:`chunk_shard`."""
    mask = np.zeros(n_rows, dtype=bool)
    shard = chunk_shard(n_rows, chunk_rows)
    mask[shard.start : shard.stop] = True
    return mask


def shardable_size(loader: Any) -> int | None:
    """``len(dataset)`` of a loader :func:`shard_loader` can split, else ``None``.

    Splittable: a map-style ``DataLoader`` that reads its dataset in order
    (no shuffling, no custom sampler, ``drop_last=False``).
    """
    if not isinstance(loader, DataLoader) or not isinstance(loader.sampler, SequentialSampler):
        return None
    batches = loader.batch_sampler
    if type(batches) is not BatchSampler or batches.drop_last or loader.batch_size is None:
        return None
    return len(loader.sampler)


def shard_loader(loader: Any, rows: np.ndarray) -> DataLoader[Any] | None:
    """A loader over only ``rows`` of ``loader``'s dataset, or ``None`` if not possible.

    Possible when :func:`shardable_size` is not ``None``: the new loader has
    the same batch size, collate function and workers, so each rank loads
    only the examples it featurizes.
    """
    if shardable_size(loader) is None:
        return None
    return DataLoader(
        Subset(loader.dataset, rows.tolist()),
        batch_size=loader.batch_size,
        shuffle=False,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
    )


def _comm_device() -> torch.device:
    # NCCL only moves CUDA tensors; gloo moves CPU ones.
    if is_distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum_(tensor: Tensor) -> Tensor:
    """Sum ``tensor`` over ranks in place (``dist.all_reduce``); identity in one process.

    With 2 ranks each entry is one IEEE addition ``a + b``, which is
    commutative, so every rank gets bit-identical results. With more ranks
    the backend's reduction order applies (the same on every rank).
    """
    if not is_distributed() or dist.get_world_size() == 1:
        return tensor
    dev = _comm_device()
    buf = tensor if tensor.device == dev else tensor.to(dev)
    dist.all_reduce(buf, op=dist.ReduceOp.SUM)
    if buf is not tensor:
        tensor.copy_(buf)
    return tensor


def balanced_owners(costs: Sequence[float], world: int) -> list[int]:
    """The rank that does each job: the costliest first, each to the least loaded rank.

    Deterministic (ties go to the lower job index and the lower rank), so every
    rank computes the same assignment from the same costs without a message.

    Example:
        >>> balanced_owners([27.0, 1.0, 27.0, 8.0], 2)
        [0, 1, 1, 0]
    """
    load = [0.0] * world
    owner = [0] * len(costs)
    for job in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owner[job] = rank
        load[rank] += float(costs[job])
    return owner


def split_over_ranks(
    compute: Callable[[int], Sequence[Tensor]], costs: Sequence[float], device: torch.device
) -> list[list[Tensor]]:
    """``compute(i)`` for every job ``i``, each done on one rank and broadcast to all.

    Jobs go to ranks by :func:`balanced_owners`; a rank first does all of its
    own, then the results travel in job order (``dist.broadcast`` from the
    owner: bits copied, no arithmetic), so every rank holds the owner's exact
    tensors on ``device``. In one process every job is computed here, as a
    plain loop would.

    Args:
        compute: job index to its tensors (any shapes and dtypes, the same
            kinds whichever rank runs it).
        costs: one relative cost per job (e.g. ``d³`` for an ``eigh``).
        device: where results the owner made off the CPU are kept on every
            rank (CPU results stay on the CPU, as in one process).

    Raises:
        RuntimeError: a job failed on some rank; every rank raises it, naming
            the rank and the error, instead of the others waiting for it.
    """
    rank, world = rank_and_world()
    if world == 1:
        return [list(compute(i)) for i in range(len(costs))]
    owner = balanced_owners(costs, world)
    mine: dict[int, list[Tensor]] = {}
    failed = ""
    try:
        for i in range(len(costs)):
            if owner[i] == rank:
                mine[i] = list(compute(i))
    except Exception as exc:  # shared below, so that every rank stops with it
        failed = f"{type(exc).__name__}: {exc}"
    shapes = {i: [(tuple(t.shape), t.dtype, t.device.type) for t in ts] for i, ts in mine.items()}
    every: dict[int, list[tuple[tuple[int, ...], torch.dtype, str]]] = {}
    errors = []
    for r, (theirs, error) in enumerate(all_gather_object((shapes, failed))):
        every.update(theirs)
        if error:
            errors.append(f"rank {r}: {error}")
    if errors:
        raise RuntimeError("a job split over the ranks failed on " + "; ".join(errors))
    dev = _comm_device()
    out = []
    for i in range(len(costs)):
        parts = []
        for j, (shape, dtype, kind) in enumerate(every[i]):
            if owner[i] == rank:
                buf = mine[i][j].to(dev).contiguous()
            else:
                buf = torch.empty(shape, dtype=dtype, device=dev)
            dist.broadcast(buf, src=owner[i])
            parts.append(buf.to("cpu" if kind == "cpu" else device))
        out.append(parts)
    return out


def all_gather_columns(local: Tensor, n_columns: int) -> Tensor:
    """Concatenate every rank's :func:`column_shard` block of a ``[n, *]`` matrix.

    Args:
        local: ``[n, len(column_shard(n_columns))]`` this rank's columns.
        n_columns: total columns m.

    Returns:
        ``[n, m]`` on every rank, on ``local``'s device (bits copied, no arithmetic).
    """
    world = rank_and_world()[1]
    if world == 1:
        return local
    width = -(-n_columns // world)
    dev = _comm_device()
    padded = torch.zeros(local.shape[0], width, dtype=local.dtype, device=dev)
    padded[:, : local.shape[1]] = local.to(dev)
    pieces = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(pieces, padded)
    return torch.cat(pieces, dim=1)[:, :n_columns].to(local.device)


class RowWindow:
    """Rows ``[start, stop)`` of a tensor, numpy or zarr array, read lazily.

    Supports ``shape``, ``dtype`` and slicing by a step-1 ``slice`` (what the
    streaming kernels need), so a rank can stream its own rows of an on-disk array.
    """

    def __init__(self, array: Any, start: int, stop: int) -> None:
        self.array, self.start, self.stop = array, int(start), int(stop)

    @property
    def shape(self) -> tuple[int, ...]:
        """``(stop - start, *array.shape[1:])``."""
        return (self.stop - self.start, *(int(s) for s in self.array.shape[1:]))

    @property
    def dtype(self) -> Any:
        """The array's dtype (the replay's float64 score rows stay float64 in a rank's window)."""
        return self.array.dtype

    def __getitem__(self, key: slice) -> Any:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError(f"RowWindow supports step-1 slices only, got {key!r}.")
        a, b, _ = key.indices(self.stop - self.start)
        return self.array[self.start + a : self.start + max(a, b)]


class ColumnWindow:
    """Columns ``[start, stop)`` of a writable 2-d array (numpy or zarr), for writes."""

    def __init__(self, array: Any, start: int, stop: int) -> None:
        self.array, self.start, self.stop = array, int(start), int(stop)

    @property
    def shape(self) -> tuple[int, int]:
        """``(array.shape[0], stop - start)``."""
        return (int(self.array.shape[0]), self.stop - self.start)

    def __setitem__(self, key: tuple[slice, slice], value: Any) -> None:
        rows, cols = key
        a, b, _ = cols.indices(self.stop - self.start)
        self.array[rows, self.start + a : self.start + b] = value


def shard_checkpoint_targets(ckpts: Sequence[Any], cols: range) -> list[Any]:
    """Copies of ``CheckpointGrads`` whose targets are only the rows ``cols``."""
    import dataclasses

    return [
        dataclasses.replace(ck, targets=RowWindow(ck.targets, cols.start, cols.stop))
        for ck in ckpts
    ]
