"""The sample store's writer: one process at a time, chains written data first, resume.

* :func:`store_lock` holds the store's advisory lock (:func:`lock_path`, an
  ``flock`` beside it) while a call reads, creates or writes it.
* :func:`check_existing` decides what an existing ``output_path`` is to this
  call: new, to resume, or done (refusing a store made with other settings).
* :class:`ChainWriter` writes finished chains behind the sampler, each
  chain's rows before its done flag.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from filelock import FileLock, Timeout

from gradsketch._hash import digest_scheme_refusal
from gradsketch._integrity import holds_data
from gradsketch._settings import settings_diff
from gradsketch._writer import BackgroundWriter
from gradsketch.errors import OutputPathMismatchError
from gradsketch.slt._schema import LAYOUT_NAMES, LAYOUT_PREFIXES, SETTINGS_ATTR, array
from gradsketch.slt._store_checks import judge_without_root

__all__ = ["ChainWriter", "check_existing", "lock_path", "store_lock"]

#: One logger for the whole of sample(): what a user sees is named after the entry point.
logger = logging.getLogger("gradsketch.slt._sample")


def lock_path(path: Path) -> Path:
    """The advisory lock file of the store at ``path``, held by the one process writing it.

    Hidden beside the store: zarr warns of any foreign file inside one.
    """
    return path.with_name(f".{path.name}.lock")


class ChainWriter:
    """Writes finished chains behind the sampler, data first and its done flag last.

    The rule of :mod:`gradsketch._store`: a chain's flag is set only after all
    its arrays are on disk (zarr replaces each chunk file atomically), so a
    killed run leaves every chain either flagged and complete or unflagged
    and redone. The sampler hands a chain over and goes on with the next; the
    writes run on gradsketch's one background writer.
    """

    def __init__(self, root: zarr.Group) -> None:
        self.root = root
        self._arrays: dict[str, zarr.Array] = {}
        self._writer: BackgroundWriter[tuple[int, dict[str, np.ndarray], str]] = BackgroundWriter(
            self._write, max_pending=2, name="gradsketch-slt"
        )

    def _array(self, name: str) -> zarr.Array:
        if name not in self._arrays:
            self._arrays[name] = array(self.root, name, write=True)
        return self._arrays[name]

    def _write(self, job: tuple[int, dict[str, np.ndarray], str]) -> None:
        chain, values, flag = job
        for name, value in values.items():
            self._array(name)[chain] = value
        self._array(flag)[chain] = 1

    def write(self, chain: int, values: dict[str, np.ndarray], flag: str) -> None:
        """Queue chain ``chain``'s rows of every array in ``values``, then its ``flag``."""
        self._writer.submit((chain, values, flag))

    def close(self) -> None:
        """Wait for every queued write; raise the first failure."""
        self._writer.close()


def _looks_like_store(path: Path) -> bool:
    """Whether ``path`` holds an entry of a sample store's layout (an array or ``progress``)."""
    return any(
        e.name in LAYOUT_NAMES or e.name == "progress" or e.name.startswith(LAYOUT_PREFIXES)
        for e in path.iterdir()
    )


def check_existing(path: Path, record: dict[str, Any], sampler: dict[str, Any]) -> str:
    """``"new"``, ``"resume"`` or ``"done"`` for an existing ``output_path``; refuse mismatches.

    A store whose root ``zarr.json`` is unreadable, or records no settings,
    is judged by its arrays' own records
    (:func:`~gradsketch.slt._store_checks.judge_without_root`); only a
    provably empty one (a kill while it was created) is cleared and made
    again (``"new"``). A request without the observables
    (``"evaluate_observables": False``) takes a store made with them, which
    holds more, the same chains: ``record`` then loses that key, and the run
    evaluates them (resuming, all the store's chains stay alike).
    """
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        return "new"
    try:
        attrs: dict[str, Any] = dict(zarr.open_group(str(path), mode="r").attrs)
    except Exception as exc:
        if _looks_like_store(path):
            return judge_without_root(path, record, f"zarr.json is unreadable ({exc!r})")
        raise OutputPathMismatchError(
            f"`output_path`={str(path)!r} exists but is not a zarr store ({exc!r}); pass "
            "another path or delete it."
        ) from exc
    if SETTINGS_ATTR in attrs:
        refusal = digest_scheme_refusal(
            attrs[SETTINGS_ATTR],
            fields=("model", "dataset"),
            where=f"`output_path`={str(path)!r}",
            legacy="blake2b/16",
            fix="Pass another output_path, or delete it to sample again (its samples still "
            "open with xarray.open_zarr).",
        )
        if refusal is not None:
            raise OutputPathMismatchError(refusal)
        if record.get("evaluate_observables", True) is False and attrs[SETTINGS_ATTR].get(
            "evaluate_observables", True
        ):
            del record["evaluate_observables"]
        diffs = settings_diff(attrs[SETTINGS_ATTR], record)
        if diffs:
            raise OutputPathMismatchError(
                f"`output_path`={str(path)!r} has a different sampler config (samples made with "
                "other settings):\n  "
                + "\n  ".join(diffs)
                + "\nPass another output_path for the new settings, delete the old samples, "
                "or rerun with the stored settings."
            )
        return "done" if attrs.get("completed") == 1 else "resume"
    # Written by devinterp: reuse it when complete and made with the same sampler settings.
    stored = attrs.get("metadata", {}).get("config", {}).get("sampler")
    # A kill before the first array leaves a bare root (no node below it, no chunk):
    # provably empty, made again. A foreign group with arrays of its own is refused below.
    bare = not holds_data(path) and all(e.is_file() for e in path.iterdir())
    if stored is None and (_looks_like_store(path) or bare):
        return judge_without_root(path, record, "zarr.json records no settings")
    if stored is None:
        raise OutputPathMismatchError(
            f"`output_path`={str(path)!r} is a zarr store but holds no samples (no "
            "metadata.config.sampler); pass another path or delete it."
        )
    diffs = settings_diff(stored, sampler)
    if diffs or attrs.get("completed") != 1:
        state = "is incomplete" if not diffs else "has a different sampler config"
        raise OutputPathMismatchError(
            f"`output_path`={str(path)!r} holds devinterp samples; the store {state}:\n  "
            + "\n  ".join(diffs or ["completed: stored <missing>, requested 1"])
            + "\nPass another output_path or delete it."
        )
    return "done"


@contextlib.contextmanager
def store_lock(path: Path) -> Iterator[None]:
    """Hold ``path``'s advisory lock: one process writes a store at a time.

    A second process asking for a store another one is writing waits for
    it (logging that it waits, and on which lock), then finds it complete
    and reuses it, or resumes it where the other stopped. The lock is an
    ``flock`` on :func:`lock_path` beside the store, released by the
    operating system when its holder dies, so a killed run leaves none held.
    """
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(
            f"`output_path`={str(path)!r} is a file, not a directory; pass a directory path "
            "for the zarr store (it is created) or move the file away."
        )
    lock: FileLock | None = FileLock(str(lock_path(path)))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        assert lock is not None
        try:
            lock.acquire(timeout=0)
        except Timeout:
            logger.warning(
                "sample(): another process is writing %s; waiting for it to finish (lock %s)",
                path,
                lock_path(path),
            )
            lock.acquire()
    except OSError as exc:
        if not (path.is_dir() and not os.access(path.parent, os.W_OK)):
            raise OSError(
                f"`output_path`={str(path)!r} cannot be locked for writing ({exc}); pass a "
                "writable directory."
            ) from exc
        # A read-only store can only be read (a complete one is reused; else writing fails).
        lock = None
    try:
        yield
    finally:
        if lock is not None:
            lock.release()
