"""What a TRAKer reuses across query sets, per checkpoint: the damped factor and the rows.

Each :meth:`~gradsketch.attribution.TRAKer.finalize_scores` of TRAK solves
its targets against ``XᵀX + λI`` and streams the ``[n, k]`` rows X of each
checkpoint. Neither depends on the targets, so a second query set of the
same checkpoints redoes both for nothing: the factorisation and its
spectrum check (two float64 Choleskys, 0.13 s at k = 2,048 on one Xeon
core) and the read of X from the store (0.16 s at n = 20,000).
:class:`ScoringCache` keeps them in memory between calls, counted in the
plan (:attr:`~gradsketch.attribution.AttributionPlan.cache_bytes`):

- the factor: ``8 k²`` bytes per checkpoint (float64 ``L``, or the float32
  inverse where the solver falls back to it);
- the rows: ``n k`` numbers per checkpoint in the scoring dtype, kept only
  where the factor is kept too.

Admission (:func:`~gradsketch.attribution._plan.cache_refusal`): with
``memory_budget`` the cache holds at most half of it and the scoring blocks
are planned in what it leaves; without one, the plan's finalize stage plus
the cache must fit the available memory. What does not fit is not cached
(logged once per TRAKer) and is recomputed as before.

Invalidation: an entry is keyed by the checkpoint, a CRC-32 of the ``XᵀX``
it was made from (read from the store each call, so a refinalized
checkpoint misses), λ, the dtype and the device; the TRAKer forgets a
checkpoint's entry when it loads that checkpoint for featurizing and when
it finalizes it (the rows may change while ``XᵀX`` does not, e.g. rows
featurized again in another order). A TRAKer resumed with other settings
is a new object with an empty cache. The scores are the uncached path's.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["CheckpointCache", "ScoringCache"]

#: ``(model_id, crc32 of XᵀX, λ, XᵀX dtype, device)``.
Key = tuple[int, int, float, str, str]


def gram_crc(xtx: Tensor) -> int:
    """CRC-32 of ``xtx``'s bytes (about 10 ms for a 16 MB float32 ``[2048, 2048]``)."""
    data = np.ascontiguousarray(xtx.detach().cpu().numpy()).reshape(-1).view(np.uint8)
    return zlib.crc32(data.data)


@dataclass
class _Entry:
    key: Key
    solve: Callable[[Tensor], Tensor]
    factor_bytes: int
    rows: Tensor | None = None

    @property
    def nbytes(self) -> int:
        held = 0 if self.rows is None else self.rows.numel() * self.rows.element_size()
        return self.factor_bytes + held


class ScoringCache:
    """Per-checkpoint damped factors (and rows) kept between query sets, within an allowance.

    Args:
        admit: ``admit(held, extra)`` is ``None`` where ``extra`` more bytes
            beside the ``held`` ones fit, else the reason they do not
            (:func:`~gradsketch.attribution._plan.cache_refusal`).
        logger: where a refusal is logged (once).
        enabled: ``False``: never cache (every call recomputes).

    Example:
        >>> cache = ScoringCache(lambda held, extra: None, logging.getLogger("x"))
        >>> x = torch.randn(30, 4, generator=torch.Generator().manual_seed(0))
        >>> handle = cache.handle(0)
        >>> from gradsketch.attribution._linalg import damped_solver
        >>> solve = handle.solver(x.T @ x, 0.0, lambda: damped_solver(x.T @ x, 0.0))
        >>> cache.nbytes
        128
        >>> handle.solver(x.T @ x, 0.0, lambda: None) is solve
        True
    """

    def __init__(
        self,
        admit: Callable[[int, int], str | None],
        logger: logging.Logger,
        *,
        enabled: bool = True,
    ) -> None:
        self.admit, self.logger, self.enabled = admit, logger, enabled
        self._entries: dict[int, _Entry] = {}
        self._refused_logged = False
        #: Factorisations made and reused (what the tests count).
        self.made = 0
        self.reused = 0

    @property
    def nbytes(self) -> int:
        """Bytes held: every checkpoint's factor and rows."""
        return sum(e.nbytes for e in self._entries.values())

    def forget(self, model_id: int | None = None) -> None:
        """Drop ``model_id``'s entry (``None``: every entry)."""
        if model_id is None:
            self._entries.clear()
        else:
            self._entries.pop(int(model_id), None)

    def handle(self, model_id: int, *, rows: bool = True) -> CheckpointCache:
        """The entry point of one checkpoint's scoring (``rows=False``: never keep its rows)."""
        return CheckpointCache(self, int(model_id), rows)

    def _refused(self, what: str, reason: str) -> None:
        if not self._refused_logged:
            self._refused_logged = True
            self.logger.info(
                "not caching %s between query sets: %s; it is recomputed for each "
                "finalize_scores (logged once)",
                what,
                reason,
            )


class CheckpointCache:
    """One checkpoint's view of a :class:`ScoringCache` (see :func:`score_checkpoints`)."""

    def __init__(self, cache: ScoringCache, model_id: int, rows: bool) -> None:
        self.cache, self.model_id, self.keep_rows = cache, model_id, rows
        self._key: Key | None = None

    @property
    def held(self) -> int:
        """Bytes the whole cache holds."""
        return self.cache.nbytes

    @property
    def kept(self) -> bool:
        """Whether this checkpoint's factor is held by the cache (after :meth:`solver`)."""
        return self._key is not None and self._entry() is not None

    def forget(self) -> None:
        """Drop this checkpoint's entry (its solve stays usable by whoever holds it)."""
        self.cache.forget(self.model_id)

    def _entry(self) -> _Entry | None:
        entry = self.cache._entries.get(self.model_id)
        return entry if entry is not None and entry.key == self._key else None

    def solver(
        self, xtx: Tensor, lam: float, make: Callable[[], Callable[[Tensor], Tensor]]
    ) -> Callable[[Tensor], Tensor]:
        """The cached solve of ``(xtx + lam I)``, else ``make()`` (kept where it fits)."""
        cache = self.cache
        self._key = (
            self.model_id,
            gram_crc(xtx),
            float(lam),
            str(xtx.dtype),
            str(xtx.device),
        )
        entry = self._entry()
        if entry is not None:
            cache.reused += 1
            return entry.solve
        cache.forget(self.model_id)  # a stale entry of this checkpoint
        solve = make()
        cache.made += 1
        k = int(xtx.shape[0])
        factor_bytes = 8 * k * k
        if not cache.enabled:
            return solve
        reason = cache.admit(cache.nbytes, factor_bytes)
        if reason is None:
            cache._entries[self.model_id] = _Entry(self._key, solve, factor_bytes)
        else:
            cache._refused("the factor of XᵀX + λI", reason)
        return solve

    def rows(self, train: Any, dtype: torch.dtype, read: Callable[[], Tensor]) -> Any:
        """The checkpoint's rows held in memory (read once by ``read()``), else ``train``.

        Only where the factor is cached (call :meth:`solver` first), the rows
        live outside torch (a store or an array) and they fit beside it.
        """
        entry = self._entry()
        if entry is None or not self.keep_rows or isinstance(train, Tensor):
            return train
        if entry.rows is not None and entry.rows.dtype == dtype:
            return entry.rows
        entry.rows = None
        n, k = (int(s) for s in train.shape)
        reason = self.cache.admit(self.cache.nbytes, n * k * dtype.itemsize)
        if reason is not None:
            self.cache._refused("the training rows", reason)
            return train
        entry.rows = read()
        return entry.rows
