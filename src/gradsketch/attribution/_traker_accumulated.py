"""Curvature statistics accumulated while featurizing, saved per rank with the rows they cover.

K-FAC and EK-FAC (and any preconditioner with ``accumulates``) add each
training batch to running statistics. They live in
``checkpoints/{model_id}/accumulated.{rank}.npz`` beside the rows, with the
rows they cover, so that a killed run resumes without adding a row twice;
one process per checkpoint holds them (a file lock), since a second would
overwrite them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import filelock
import numpy as np

from gradsketch.attribution import _layout as layout
from gradsketch.attribution._distributed import rank_and_world
from gradsketch.attribution._integrity import load_npz
from gradsketch.attribution._preconditioners import CurvaturePreconditioner, FeatureBatch
from gradsketch.attribution._traker_records import TRAKRecords, atomic_save
from gradsketch.errors import SettingsMismatchError


class Accumulated:
    """The loaded checkpoint's accumulating preconditioner and the rows it covers.

    Args:
        records: the store's records.
        new: makes a fresh preconditioner.
        train_set_size: n.
        save_every: rows added between saves.
        logger: where damaged statistics are reported.
    """

    def __init__(
        self,
        records: TRAKRecords,
        new: Callable[[], CurvaturePreconditioner],
        train_set_size: int,
        save_every: int,
        logger: logging.Logger,
    ) -> None:
        self.records, self.new = records, new
        self.n, self.save_every, self.logger = train_set_size, save_every, logger
        self.model_id: int | None = None
        self.precond: CurvaturePreconditioner | None = None
        self.covered: np.ndarray | None = None
        self.covered_any: np.ndarray | None = None
        self._since_save = 0
        self._lock: filelock.BaseFileLock | None = None

    def _folder(self, model_id: int) -> Path:
        return self.records.save_dir / layout.checkpoint_dir(model_id)

    def _path(self, model_id: int, rank: int) -> Path:
        return self._folder(model_id) / f"accumulated.{rank}.npz"

    def files(self, model_id: int) -> list[Path]:
        """Every rank's statistics file of ``model_id``."""
        # Exactly accumulated.<rank>.npz: never another rank's file being written.
        return sorted(
            p
            for p in self._folder(model_id).glob("accumulated.*.npz")
            if p.name.split(".")[1].isdigit()
        )

    def read(self, model_id: int) -> tuple[CurvaturePreconditioner, np.ndarray, np.ndarray]:
        """The accumulated preconditioner and covered rows of this rank, and every rank's.

        Raises:
            SettingsMismatchError: the store's accumulated state was written by
                another number of ranks.
        """
        rank, world = rank_and_world()
        precond = self.new()
        mine = np.zeros(self.n, dtype=bool)
        every = np.zeros(self.n, dtype=bool)
        for path in self.files(model_id):
            z, problem = load_npz(path)
            if z is None or "__world__" not in z or "__covered__" not in z:
                # Recomputed: its rows count as not yet in the statistics.
                self.logger.warning(
                    "curvature statistics `%s` are damaged (%s); discarding them: featurize "
                    "adds their rows again.",
                    path,
                    problem or "incomplete",
                )
                with self.records.store.lock.held():
                    path.unlink(missing_ok=True)
                continue
            written_by = int(z["__world__"])
            if written_by != world:
                raise SettingsMismatchError(
                    f"model id {model_id} in `{self.records.save_dir}` has curvature statistics "
                    f"accumulated by {written_by} process(es), but this run has {world}. "
                    f"Resume with {written_by}, or pass load_from_save_dir=False to refit."
                )
            covered = z["__covered__"].astype(bool)
            every |= covered
            if path == self._path(model_id, rank):
                mine = covered
                precond.load_state_dict({k: v for k, v in z.items() if not k.startswith("__")})
        return precond, mine, every

    def start(self, model_id: int) -> None:
        """Resume ``model_id``'s statistics (call while holding its lock)."""
        self.model_id = model_id
        self.precond, self.covered, self.covered_any = self.read(model_id)
        self._since_save = 0

    def forget(self) -> None:
        """Hold no statistics (a method that accumulates none, or another checkpoint)."""
        self.model_id, self.precond, self.covered, self.covered_any = None, None, None, None
        self._since_save = 0

    def add(self, batch: FeatureBatch) -> None:
        """Add a batch's rows ``batch.rows``; saved every ``save_every`` rows."""
        assert self.precond is not None and self.covered is not None
        assert self.covered_any is not None
        self.precond.accumulate(batch)
        self.covered[batch.rows] = True
        self.covered_any[batch.rows] = True
        self._since_save += len(batch.rows)
        if self._since_save >= self.save_every:
            self.save()

    def save(self) -> None:
        """Write this rank's statistics, if rows were added since the last save."""
        if self.model_id is None or self.precond is None or not self._since_save:
            return
        assert self.covered is not None
        rank, world = rank_and_world()
        arrays = dict(self.precond.state_dict())
        arrays["__covered__"] = self.covered.astype(np.uint8)
        arrays["__world__"] = np.array(world, dtype=np.int64)
        atomic_save(self._path(self.model_id, rank), arrays)
        self._since_save = 0

    def hold(self, model_id: int) -> None:
        """Hold ``model_id``'s featurizing lock (one process at a time).

        The statistics live in one file per rank that a second process would
        overwrite, so a second process featurizing the same checkpoint waits
        here until the first moves on (or exits).
        """
        self.release()
        rank, _ = rank_and_world()
        folder = self._folder(model_id)
        folder.mkdir(parents=True, exist_ok=True)
        lock = filelock.FileLock(
            str(folder / f".featurize.{rank}.lock"), thread_local=False, is_singleton=True
        )
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            self.logger.warning(
                "model id %d in `%s` is being featurized by another process; waiting until it "
                "loads another checkpoint, finalizes or exits (curvature statistics are "
                "accumulated by one process per checkpoint).",
                model_id,
                self.records.save_dir,
            )
            lock.acquire()
        self._lock = lock

    def release(self) -> None:
        """Save the statistics and let another process featurize the checkpoint."""
        self.save()
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()
