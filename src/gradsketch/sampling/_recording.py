"""Per-draw recording of an LLC run: loss trace, sketches and metrics in a zarr v3 store.

Layout of the store (a directory)::

    settings.json                     the LLCRecordSettings that made it
    loss          [chains, draws]     float64 sampled loss per draw
    sketch/<q>    [chains, draws, k]  float32, q in SKETCH_QUANTITIES (when sketched)
    metrics/<m>   [chains, draws]     float64, m in Metrics fields (when recorded)
    chain_done    [chains]            bool; a rerun skips finished chains

Every array is chunked one chain per chunk, so processes running different
chains write disjoint chunks and a killed run resumes at the first unfinished
chain. Reopening with different settings is refused, showing both.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from gradsketch.sampling._metrics import DOT_FIELDS, NORM_FIELDS
from gradsketch.sketch import SKETCH_QUANTITIES

__all__ = ["DrawStore", "LLCRecordSettings", "SettingsMismatchError", "open_draw_store"]

SETTINGS_FILE = "settings.json"
METRIC_FIELDS: tuple[str, ...] = (*NORM_FIELDS, *DOT_FIELDS)


class SettingsMismatchError(ValueError):
    """A store was reopened with settings that differ from the ones that wrote it."""


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
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive int, got {value!r}.")
        if not isinstance(self.num_burnin_steps, int) or self.num_burnin_steps < 0:
            raise ValueError(
                f"`num_burnin_steps` must be a non-negative int, got {self.num_burnin_steps!r}."
            )
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
        """Inverse of :meth:`to_dict`; unknown fields are an error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"`data` has unknown settings fields {unknown}; allowed: {sorted(known)}."
            )
        return cls(**data)

    def require_same(self, other: LLCRecordSettings) -> None:
        """Raise :class:`SettingsMismatchError` listing both values of every differing field."""
        if self == other:
            return
        diffs = [
            f"  {f.name}: stored {getattr(other, f.name)!r}, requested {getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]
        raise SettingsMismatchError(
            "the store was written with different settings:\n"
            + "\n".join(diffs)
            + "\nUse a new store path, delete the old store, or rerun with the stored settings."
        )


class DrawStore:
    """A zarr v3 group holding one LLC run's draws (see the module docstring for the layout)."""

    def __init__(self, path: Path, settings: LLCRecordSettings, group: zarr.Group) -> None:
        self.path = path
        self.settings = settings
        self._group = group

    def _array(self, name: str) -> Any:
        # zarr's Group.__getitem__ is typed for groups and arrays alike; ours are arrays.
        return self._group[name]

    @property
    def sketch_dim(self) -> int | None:
        """Size k of the stored sketches, or None."""
        if "sketch" not in self._group:
            return None
        return int(self._array(f"sketch/{SKETCH_QUANTITIES[0]}").shape[-1])

    def chain_done(self, chain: int) -> bool:
        """Whether ``chain`` was written completely."""
        return bool(self._array("chain_done")[chain])

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
        self._array("loss")[chain, :] = np.asarray(losses, dtype=np.float64)
        if sketches is not None:
            for i, q in enumerate(SKETCH_QUANTITIES):
                self._array(f"sketch/{q}")[chain, :, :] = sketches[:, i, :].astype(np.float32)
        if metrics is not None:
            for i, name in enumerate(METRIC_FIELDS):
                self._array(f"metrics/{name}")[chain, :] = metrics[:, i]
        self._array("chain_done")[chain] = True

    def losses(self) -> np.ndarray:
        """``[chains, draws]`` loss trace (NaN where not yet written)."""
        return np.asarray(self._array("loss")[:])

    def sketches(self, quantity: str) -> np.ndarray:
        """``[chains, draws, k]`` sketches of one component."""
        if quantity not in SKETCH_QUANTITIES:
            raise ValueError(
                f"`quantity` must be one of {list(SKETCH_QUANTITIES)}, got {quantity!r}."
            )
        if "sketch" not in self._group:
            raise RuntimeError(
                "this store holds no sketches; record with optimizer_kwargs={'sketch_dim': k}."
            )
        return np.asarray(self._array(f"sketch/{quantity}")[:])

    def metrics(self, name: str) -> np.ndarray:
        """``[chains, draws]`` values of one metric."""
        if name not in METRIC_FIELDS:
            raise ValueError(f"`name` must be one of {list(METRIC_FIELDS)}, got {name!r}.")
        if "metrics" not in self._group:
            raise RuntimeError(
                "this store holds no metrics; record with optimizer_kwargs={'save_metrics': True}."
            )
        return np.asarray(self._array(f"metrics/{name}")[:])


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
        SettingsMismatchError: ``path`` holds a store with other settings.

    Example:
        >>> import tempfile
        >>> s = LLCRecordSettings(num_chains=2, num_draws=3, seed=0, nbeta=1.0)
        >>> with tempfile.TemporaryDirectory() as d:
        ...     store = open_draw_store(Path(d) / "run", s)
        ...     store.write_chain(0, np.arange(3.0))
        ...     reopened = open_draw_store(Path(d) / "run", s)
        ...     reopened.chain_done(0), reopened.chain_done(1)
        (True, False)
    """
    root = Path(path)
    settings_path = root / SETTINGS_FILE
    if settings_path.exists():
        stored = LLCRecordSettings.from_dict(json.loads(settings_path.read_text()))
        settings.require_same(stored)
        return DrawStore(root, settings, zarr.open_group(str(root), mode="r+"))
    root.mkdir(parents=True, exist_ok=True)
    group = zarr.open_group(str(root), mode="w")
    c, d = settings.num_chains, settings.num_draws
    group.create_array("loss", shape=(c, d), chunks=(1, d), dtype="float64", fill_value=np.nan)
    group.create_array("chain_done", shape=(c,), chunks=(1,), dtype="bool", fill_value=False)
    if sketch_dim is not None:
        for q in SKETCH_QUANTITIES:
            group.create_array(
                f"sketch/{q}",
                shape=(c, d, sketch_dim),
                chunks=(1, d, sketch_dim),
                dtype="float32",
                fill_value=np.nan,
            )
    if settings.record_metrics:
        for name in METRIC_FIELDS:
            group.create_array(
                f"metrics/{name}", shape=(c, d), chunks=(1, d), dtype="float64", fill_value=np.nan
            )
    group.attrs["settings"] = settings.to_dict()
    # settings.json last: its presence means the arrays exist.
    settings_path.write_text(json.dumps(settings.to_dict(), indent=2, sort_keys=True))
    return DrawStore(root, settings, group)
