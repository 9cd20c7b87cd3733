"""TRAKer's inputs: batches and their rows, and loaders fed batch by batch."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from gradsketch._device import to_device
from gradsketch.attribution._distributed import rank_and_world, shard_loader, shardable_size
from gradsketch.attribution._integrity import check_batch_rows
from gradsketch.attribution._lm_data import as_task_batch


def whole_parameters(mask: Any) -> bool:
    """Whether a ParamMask selects whole parameters only (names, not entries)."""
    return all(c in (0, mask[n].numel()) for n, c in mask.counts().items())


def resolve_inds(inds: Any, num_samples: int | None, last: int, n: int, what: str) -> np.ndarray:
    """The rows of a batch: ``inds``, or ``num_samples`` rows after ``last``, in ``[0, n)``."""
    if (inds is None) == (num_samples is None):
        raise ValueError(
            f"{what}: pass exactly one of `inds` (row indices) or `num_samples` (rows follow the "
            f"previous batch), got inds={inds!r}, num_samples={num_samples!r}."
        )
    if num_samples is not None:
        idx = np.arange(last, last + int(num_samples), dtype=np.int64)
    else:
        idx = np.asarray(inds.cpu() if isinstance(inds, Tensor) else inds, dtype=np.int64)
        idx = idx.reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise IndexError(
            f"{what}: rows {idx.min()}..{idx.max()} fall outside [0, {n}); check `inds` / "
            f"`num_samples` against the size given to the TRAKer ({n})."
        )
    if np.unique(idx).size != idx.size:
        raise ValueError(f"{what}: `inds` has repeated rows; each row is written once.")
    return idx


def batch_rows(
    task: Any,
    batch: Any,
    inds: Any,
    num_samples: int | None,
    last: int,
    n: int,
    what: str,
    device: torch.device,
) -> tuple[tuple[Tensor, ...], np.ndarray]:
    """``batch`` as the task's tuple on ``device``, and its rows.

    The rows are ``inds``, or ``num_samples`` after ``last``. A CPU batch
    reaches a CUDA model without the caller moving it.
    """
    batch = to_device(as_task_batch(task, batch), device)
    idx = resolve_inds(inds, num_samples, last, n, what)
    check_batch_rows(batch, idx, "inds" if num_samples is None else "num_samples", what)
    return batch, idx


def select_rows(
    batch: tuple[Tensor, ...], idx: np.ndarray, todo: np.ndarray
) -> tuple[tuple[Tensor, ...], np.ndarray]:
    """The rows ``todo`` (a mask over the batch) of ``batch`` and of ``idx``."""
    if todo.all():
        return batch, idx
    keep = torch.as_tensor(np.nonzero(todo)[0])
    return tuple(t.index_select(0, keep.to(t.device)) for t in batch), idx[todo]


def check_per_token(task: Any, per_token: bool) -> None:
    """Refuse ``per_token=True`` for a task without per-token outputs."""
    if per_token and not callable(getattr(task, "per_token_batch", None)):
        raise ValueError(
            f"`per_token`=True needs a task with per-token outputs (a `per_token_batch` "
            f"method, as 'language_modeling' has); {type(task).__name__} has none."
        )


def run_loader(
    task: Any,
    loader: Iterable[Any],
    step: Callable[..., None],
    done: np.ndarray,
    owned: np.ndarray,
    first_row: int,
    desc: str,
    progress: bool,
) -> int:
    """Feed ``loader``'s batches to ``step``; returns the row after the last one.

    Under ``torch.distributed``, an in-order map-style ``DataLoader`` is
    re-batched over this rank's rows still to do (``owned`` and not
    ``done``); other iterables are read in full.
    """
    rank, world = rank_and_world()
    disable = not progress or rank != 0
    size = shardable_size(loader) if world > 1 else None
    sharded = None
    if size is not None and first_row + size <= done.size:
        window = slice(first_row, first_row + size)
        rows = np.nonzero(owned[window] & ~done[window])[0]
        sharded = shard_loader(loader, rows)
    if sharded is None:
        for raw in tqdm(loader, desc=desc, disable=disable):
            batch = as_task_batch(task, raw)
            step(batch, num_samples=int(batch[0].shape[0]))
            first_row += int(batch[0].shape[0])
        return first_row
    start = 0
    for raw in tqdm(sharded, desc=desc, disable=disable):
        batch = as_task_batch(task, raw)
        count = int(batch[0].shape[0])
        step(batch, inds=first_row + rows[start : start + count])
        start += count
    assert size is not None
    return first_row + size
