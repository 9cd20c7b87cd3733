"""Top-k proponents and opponents per target, streamed: never the ``[n, m]`` score matrix.

The scoring kernel (:func:`~gradsketch.attribution._scores.score_checkpoints`)
produces the scores tile by tile; here each tile is merged into, per target,
the ``k`` largest (proponents) and ``k`` smallest (opponents) scores seen so
far. Working memory is one tile plus ``4 k m`` numbers, ``O((block + k) m)``,
whatever the number of training rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gradsketch.attribution._scores import CheckpointGrads, score_checkpoints


@dataclass
class TopK:
    """The top-k training rows of each target.

    Attributes:
        proponents: ``[k, m]`` int64 training-row indices, highest score first.
        proponent_scores: ``[k, m]`` their scores.
        opponents: ``[k, m]`` indices, lowest (most negative) score first.
        opponent_scores: ``[k, m]`` their scores.
    """

    proponents: Tensor
    proponent_scores: Tensor
    opponents: Tensor
    opponent_scores: Tensor


class TopKCollector:
    """A write-only ``[n, m]`` destination that keeps each column's k extremes.

    Writes ``collector[rows, cols] = tile`` (slices, any order, each entry
    once) merge the tile into the running top-k of those columns.

    Example:
        >>> c = TopKCollector(4, 1, k=2)
        >>> c[0:2, 0:1] = np.array([[1.0], [5.0]])
        >>> c[2:4, 0:1] = np.array([[-3.0], [4.0]])
        >>> c.result().proponents[:, 0].tolist(), c.result().opponents[:, 0].tolist()
        ([1, 3], [2, 0])
    """

    def __init__(self, n: int, m: int, k: int) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"`k` must be a positive int, got {k!r}.")
        self.shape = (int(n), int(m))
        self.k = min(k, int(n))
        self._hi = torch.full((self.k, m), float("-inf"))
        self._hi_idx = torch.full((self.k, m), -1, dtype=torch.int64)
        self._lo = torch.full((self.k, m), float("inf"))
        self._lo_idx = torch.full((self.k, m), -1, dtype=torch.int64)

    def __setitem__(self, key: tuple[slice, slice], tile: Any) -> None:
        rows, cols = key
        values = torch.as_tensor(np.asarray(tile), dtype=torch.float32)
        idx = torch.arange(rows.start, rows.start + values.shape[0]).unsqueeze(1)
        idx = idx.expand(-1, values.shape[1])
        for best, best_idx, largest in (
            (self._hi, self._hi_idx, True),
            (self._lo, self._lo_idx, False),
        ):
            vals = torch.cat([best[:, cols], values])
            inds = torch.cat([best_idx[:, cols], idx])
            top, where = vals.topk(self.k, dim=0, largest=largest, sorted=True)
            best[:, cols] = top
            best_idx[:, cols] = inds.gather(0, where)

    def result(self) -> TopK:
        """The collected top-k (call after every tile was written)."""
        return TopK(self._hi_idx, self._hi, self._lo_idx, self._lo)


def topk_checkpoints(
    checkpoints: Sequence[CheckpointGrads],
    k: int,
    lambda_reg: float | str = 0.0,
    memory_budget: int | None = None,
    *,
    progress: bool = False,
    device: torch.device | str | None = None,
) -> TopK:
    """Top-k of the ensembled TRAK scores of several checkpoints (see :func:`trak_topk`)."""
    n, _, m = checkpoints[0].sizes
    collector = TopKCollector(n, m, k)
    score_checkpoints(
        checkpoints,
        lambda_reg,
        memory_budget,
        out=collector,
        device=device,
        progress=progress,
    )
    return collector.result()


def trak_topk(
    train_grads: Any,
    target_grads: Any,
    out_to_loss: Any,
    k: int,
    lambda_reg: float | str = 0.0,
    memory_budget: int | None = None,
    *,
    device: torch.device | str | None = None,
    progress: bool = False,
) -> TopK:
    """The ``k`` highest and lowest TRAK scores of each target, without the score matrix.

    Scores are those of :func:`~gradsketch.attribution.trak_scores`; they are
    produced in tiles (sized by ``memory_budget``) and merged into running
    top-k lists, so memory is ``O((block + k) * m)``.

    Args:
        train_grads: ``[n, k_proj]`` normalised projected training gradients.
        target_grads: ``[m, k_proj]`` target gradients.
        out_to_loss: ``[n]`` or ``[n, 1]`` out-to-loss terms.
        k: how many proponents and opponents per target (at most ``n``).
        lambda_reg: ridge damping λ >= 0, or ``"auto"``.
        memory_budget: bytes of working memory for the tiles (``None``: blocks
            of about 64 MB of gradients).
        device: where to multiply.
        progress: show a tqdm bar.

    Returns:
        :class:`TopK` with ``[k, m]`` indices and scores.

    Example:
        >>> from gradsketch.attribution import trak_scores
        >>> g = torch.randn(50, 8, generator=torch.Generator().manual_seed(0))
        >>> top = trak_topk(g, g[:3], torch.ones(50), k=5)
        >>> full = trak_scores(g, g[:3], torch.ones(50))
        >>> bool((top.proponents == torch.from_numpy((-full).argsort(0)[:5])).all())
        True
    """
    one = [CheckpointGrads(train_grads, target_grads, out_to_loss)]
    return topk_checkpoints(one, k, lambda_reg, memory_budget, device=device, progress=progress)
