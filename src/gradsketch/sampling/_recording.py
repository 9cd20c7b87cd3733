"""Per-draw recording of an LLC run: loss trace, sketches and metrics in a zarr v3 store.

The store is a :class:`gradsketch._store.RowStore` (one row per chain) with
the run's :class:`LLCRecordSettings` as its settings record. Layout::

    settings.json                     the settings record (+ package versions)
    loss          [chains, draws]     float64 sampled loss per draw
    sketch/<q>    [chains, draws, k]  float32, q in SKETCH_QUANTITIES (when sketched)
    metrics/<m>   [chains, draws]     float64, m in Metrics fields (when recorded)
    chains.done   [chains]            uint8; 1 = every array holds the chain

Every array is chunked one chain per chunk, so processes running different
chains write disjoint chunks, and a chain's flag is set only after all its
rows are on disk: a killed run resumes at the first unfinished chain.
Reopening with different settings raises
:class:`~gradsketch._settings.SettingsMismatchError` showing both values.

No estimate is computed from a missing or damaged draw: before a finished
chain is reused, :meth:`DrawStore.repair` checks its chunks in every array
(the row store's checks, on :mod:`gradsketch._integrity`) and unflags a
chain whose chunk is missing, fails its checksum, cannot be decoded or reads
NaN, naming the array, chunk and file; the chain is sampled again (its bits
are the first run's: a chain depends only on the run's seed).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gradsketch._checks import nonnegative_int, positive_int
from gradsketch._integrity import ChunkDamage, damage_message
from gradsketch._settings import (
    SettingsMismatchError,
    require_same_settings,
    settings_from_record,
)
from gradsketch._store import RowStore
from gradsketch.sampling._metrics import DOT_FIELDS, NORM_FIELDS
from gradsketch.sketch import SKETCH_QUANTITIES

__all__ = ["DrawStore", "LLCRecordSettings", "SettingsMismatchError", "open_draw_store"]

#: Metric arrays, in the order of :meth:`DrawStore.write_chain`'s ``metrics`` columns.
METRIC_FIELDS: tuple[str, ...] = (*NORM_FIELDS, *DOT_FIELDS)

#: Name of the per-chain completion flags.
DONE = "chains.done"

logger = logging.getLogger(__name__)


@dataclass
class LLCRecordSettings:
    """Everything that determines the contents of an LLC draw store.

    Attributes:
        num_chains: Chains (rows of every array).
        num_draws: Draws per chain.
        seed: The run's seed (None: not reproducible, so never resumed).
        nbeta: Inverse temperature used by the sampler and the estimate.
        sampling_method: Name of the sampler factory.
        optimizer_kwargs: The sampler's keyword arguments (JSON-able repr).
        num_burnin_steps: Steps discarded before the first draw.
        num_steps_bw_draws: Steps between draws.
        sketch_fingerprint: JSON of the sketch's fingerprint, or None.
        record_metrics: Whether metrics are stored.

    Example:
        >>> s = LLCRecordSettings(num_chains=2, num_draws=5, seed=0, nbeta=3.0)
        >>> LLCRecordSettings.from_dict(s.to_dict()) == s
        True
    """

    num_chains: int
    num_draws: int
    seed: int | None
    nbeta: float
    sampling_method: str = "sgld"
    optimizer_kwargs: dict[str, Any] = field(default_factory=dict)
    num_burnin_steps: int = 0
    num_steps_bw_draws: int = 1
    sketch_fingerprint: str | None = None
    record_metrics: bool = False

    def __post_init__(self) -> None:
        for name in ("num_chains", "num_draws", "num_steps_bw_draws"):
            positive_int(name, getattr(self, name))
        nonnegative_int("num_burnin_steps", self.num_burnin_steps)
        if not (isinstance(self.nbeta, (int, float)) and self.nbeta > 0):
            raise ValueError(f"`nbeta` must be a positive number, got {self.nbeta!r}.")
        self.nbeta = float(self.nbeta)
        # Round-trip through JSON now, so equality compares what is stored.
        self.optimizer_kwargs = json.loads(json.dumps(self.optimizer_kwargs, default=repr))

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LLCRecordSettings:
        """Inverse of :meth:`to_dict`; also reads a store's ``settings.json`` (versions ignored).

        Raises:
            SettingsMismatchError: ``data`` has fields this class does not know.
        """
        return settings_from_record(cls, data)  # type: ignore[no-any-return]

    def require_same(self, other: LLCRecordSettings) -> None:
        """Raise :class:`SettingsMismatchError` listing both values of every differing field.

        ``other`` is the stored side, ``self`` the requested one.
        """
        require_same_settings(other.to_dict(), self.to_dict(), where="the LLC draw store")


class DrawStore:
    """One LLC run's draws on a :class:`~gradsketch._store.RowStore` (layout: module docstring).

    Attributes:
        path: Directory of the store.
        settings: The settings it was opened with (equal to the stored ones).
        rows: The underlying row store.
    """

    def __init__(self, rows: RowStore, settings: LLCRecordSettings) -> None:
        self.rows = rows
        self.path = rows.path
        self.settings = settings

    @property
    def sketch_dim(self) -> int | None:
        """Size k of the stored sketches, or None."""
        name = f"sketch/{SKETCH_QUANTITIES[0]}"
        if not self.rows.has(name):
            return None
        return int(self.rows.array(name).shape[-1])

    def chain_done(self, chain: int) -> bool:
        """Whether ``chain`` was written completely."""
        return bool(self.rows.done_rows(DONE)[chain])

    def _arrays(self) -> list[str]:
        names = ["loss", *(f"sketch/{q}" for q in SKETCH_QUANTITIES)]
        names += [f"metrics/{m}" for m in METRIC_FIELDS]
        return [name for name in names if self.rows.has(name)]

    def repair(self) -> list[ChunkDamage]:
        """Unflag the finished chains whose draws are missing or damaged (they are sampled again).

        Returns:
            The damaged chunks (empty: every finished chain is intact).

        Raises:
            StoreIntegrityError: an array's ``zarr.json`` or the done flags are unreadable
                (named, with the directory to delete).
        """
        found = self.rows.unflag_damaged(self._arrays(), DONE)
        if found:
            chains = sorted({r for d in found for r in d.rows})
            logger.warning(
                "%s",
                damage_message(
                    found,
                    what=f"the LLC draw store `{self.path}` has missing or damaged draws",
                    fix=f"Sampling chains {chains} again (the bits of the first run).",
                    by_rows=True,
                ),
            )
        return found

    def write_chain(
        self,
        chain: int,
        losses: np.ndarray,
        sketches: np.ndarray | None = None,
        metrics: np.ndarray | None = None,
    ) -> None:
        """Write one chain's rows, then mark it done (so a crash mid-write is redone).

        Args:
            chain: Row index.
            losses: ``[draws]``.
            sketches: ``[draws, 5, k]`` in :data:`SKETCH_QUANTITIES` order, or None.
            metrics: ``[draws, 9]`` in norm-then-dot field order, or None.
        """
        data: dict[str, np.ndarray] = {"loss": np.asarray(losses, dtype=np.float64)[None]}
        if sketches is not None:
            for i, q in enumerate(SKETCH_QUANTITIES):
                data[f"sketch/{q}"] = sketches[None, :, i, :].astype(np.float32)
        if metrics is not None:
            for i, name in enumerate(METRIC_FIELDS):
                data[f"metrics/{name}"] = np.asarray(metrics[None, :, i], dtype=np.float64)
        self.rows.write_rows(slice(chain, chain + 1), data, done=DONE)

    def losses(self) -> np.ndarray:
        """``[chains, draws]`` loss trace (NaN where not yet written)."""
        return np.asarray(self.rows.array("loss")[:])

    def chain_losses(self, chain: int) -> np.ndarray:
        """``[draws]`` loss trace of one chain (read alone: another chain may be damaged)."""
        return np.asarray(self.rows.array("loss")[chain])

    def sketches(self, quantity: str) -> np.ndarray:
        """``[chains, draws, k]`` sketches of one component."""
        if quantity not in SKETCH_QUANTITIES:
            raise ValueError(
                f"`quantity` must be one of {list(SKETCH_QUANTITIES)}, got {quantity!r}."
            )
        if self.sketch_dim is None:
            raise RuntimeError(
                "this store holds no sketches; record with optimizer_kwargs={'sketch_dim': k}."
            )
        return np.asarray(self.rows.array(f"sketch/{quantity}")[:])

    def metrics(self, name: str) -> np.ndarray:
        """``[chains, draws]`` values of one metric."""
        if name not in METRIC_FIELDS:
            raise ValueError(f"`name` must be one of {list(METRIC_FIELDS)}, got {name!r}.")
        if not self.rows.has(f"metrics/{name}"):
            raise RuntimeError(
                "this store holds no metrics; record with optimizer_kwargs={'save_metrics': True}."
            )
        return np.asarray(self.rows.array(f"metrics/{name}")[:])

    def __repr__(self) -> str:
        return f"DrawStore({str(self.path)!r}, chains={self.settings.num_chains})"


def open_draw_store(
    path: str | os.PathLike[str], settings: LLCRecordSettings, *, sketch_dim: int | None = None
) -> DrawStore:
    """Create the store at ``path``, or reopen it if it was written with equal settings.

    Args:
        path: Directory of the zarr v3 store.
        settings: The run's settings; compared with ``settings.json`` on reopen.
        sketch_dim: k when sketches are recorded.

    Returns:
        The store.

    Raises:
        SettingsMismatchError: ``path`` holds a store with other settings, or
            arrays of another shape (both shown).

    Example:
        >>> import tempfile
        >>> s = LLCRecordSettings(num_chains=2, num_draws=3, seed=0, nbeta=1.0)
        >>> with tempfile.TemporaryDirectory() as d:
        ...     store = open_draw_store(os.path.join(d, "run"), s)
        ...     store.write_chain(0, np.arange(3.0))
        ...     reopened = open_draw_store(os.path.join(d, "run"), s)
        ...     reopened.chain_done(0), reopened.chain_done(1)
        (True, False)
    """
    rows = RowStore(os.fspath(path), settings, what="LLC draw store")
    c, d = settings.num_chains, settings.num_draws
    # One chain per chunk (data and flags): writers of different chains never share a file.
    rows.require_array("loss", (c, d), np.float64, chunk_rows=1, fill_value=np.nan)
    if sketch_dim is not None:
        for q in SKETCH_QUANTITIES:
            rows.require_array(
                f"sketch/{q}", (c, d, sketch_dim), np.float32, chunk_rows=1, fill_value=np.nan
            )
    if settings.record_metrics:
        for name in METRIC_FIELDS:
            rows.require_array(
                f"metrics/{name}", (c, d), np.float64, chunk_rows=1, fill_value=np.nan
            )
    rows.require_done(DONE, c, chunk_rows=1)
    return DrawStore(rows, settings)
