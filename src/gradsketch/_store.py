"""A zarr (v3) directory of row-chunked arrays with a settings record and done flags.

Layout of a store at ``path``::

    path/settings.json      the settings record (see :mod:`gradsketch._settings`)
    path/zarr.json          the root zarr group
    path/<name>/...         arrays, chunked along rows (the first axis)
    path/<name>.done        uint8 [n_rows] flags: 1 = the row's data is on disk

Rules that make runs resumable:

* **Data first, flags second.** :meth:`RowStore.write_rows` writes every
  array's rows, then sets the rows' flags. A process killed at any point
  leaves rows either flagged with their data on disk, or unflagged (and
  recomputed by the next run). zarr's local store replaces each chunk file
  atomically (temp file + rename), so a kill never leaves a torn chunk.
* **Different settings are refused.** Opening a store whose
  ``settings.json`` differs from the requested settings raises
  :class:`~gradsketch._settings.SettingsMismatchError` with both values of every
  differing field (package versions are recorded, never compared).
* **Write-behind keeps the order.** ``write_rows(..., background=True)``
  hands the write to one writer thread and returns at once, so the next
  batch is computed while zarr writes this one. The thread writes in call
  order, data before flags, so the first rule still holds: a kill loses at
  most the queued rows, unflagged. Every read (:meth:`RowStore.array`,
  :meth:`RowStore.done_rows`, ...) first waits for the queue
  (:meth:`RowStore.flush`), and a failed background write is raised there.
* **One writer at a time.** Every write (data and flags of a batch, array
  creation, deletion) holds an advisory file lock, ``path/.write.lock``
  (:class:`WriteLock`), so processes writing rows of the same chunk take
  turns instead of overwriting each other's rows with a stale copy of the
  chunk: any split of the rows between processes loses nothing. Processes
  that split the work on chunk boundaries (``chunk_rows``) never wait on
  each other for long.
* **Checked data.** Every array is created with :func:`array_options`: a
  crc32c checksum on every chunk (zarr v3's ``Crc32cCodec``) and, for float
  arrays, a NaN fill value that cannot pass for data. :meth:`RowStore.damage`
  finds, with every store's checks (:func:`gradsketch._integrity.scan_array`),
  rows flagged done whose chunk is missing, fails its checksum, cannot be
  decoded, or reads NaN, each named by array, chunk and file;
  :meth:`RowStore.unflag_damaged` marks them for recomputation. Arrays
  written by gradsketch before checksums (no ``crc32c`` codec) still open
  and are checked for missing and undecodable chunks. A store checks each
  chunk once: a later :meth:`RowStore.damage` of the same object reads only
  chunks whose files changed since they were found intact
  (:class:`gradsketch._integrity.VerifiedChunks` says why that is safe), and
  every read of rows checks each chunk's crc32c as it reads it.

Example:
    >>> import tempfile, numpy as np
    >>> tmp = tempfile.mkdtemp()
    >>> store = RowStore(tmp, {"proj_dim": 4})
    >>> _ = store.require_array("grads", (10, 4), "float32")
    >>> store.require_done("grads.done", 10)
    >>> store.write_rows(np.array([2, 3]), {"grads": np.ones((2, 4))}, done="grads.done")
    >>> store.done_rows("grads.done").nonzero()[0].tolist()
    [2, 3]
    >>> RowStore(tmp, {"proj_dim": 8})  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    SettingsMismatchError: ... proj_dim: stored 4, requested 8 ...
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import filelock
import numpy as np
import zarr
from zarr.codecs import BloscCodec, Crc32cCodec

from gradsketch._hash import text_digest
from gradsketch._integrity import ChunkDamage, VerifiedChunks, read_json, scan_array
from gradsketch._json import jsonable
from gradsketch._settings import (
    VERSIONS_KEY,
    SettingsMismatchError,
    StoreIntegrityError,
    read_record,
    require_same_settings,
    settings_diff,
    settings_record,
    write_record,
)
from gradsketch._writer import BackgroundWriter

logger = logging.getLogger(__name__)

#: File name of the settings record at the store's root.
SETTINGS_FILE = "settings.json"

#: One queued background write: ``(rows, {array_name: values}, done)``.
_Job = tuple[Any, dict[str, np.ndarray], str | None]

#: Default bytes per chunk when ``chunk_rows`` is not given.
DEFAULT_CHUNK_BYTES = 1 << 20
#: Background writes queued at most besides the one being written (each a
#: batch; the caller waits beyond).
WRITE_QUEUE = 4
#: Queued writes are merged into one while their data stay under this size.
MERGE_MAX_BYTES = 64 << 20

#: File name of the advisory lock held while writing (see :class:`WriteLock`).
LOCK_FILE = ".write.lock"

#: Attribute in which every array records the fingerprint of the settings that made it.
SETTINGS_ATTRIBUTE = "settings_fingerprint"
#: Attribute of the root group that keeps a copy of the settings record.
SETTINGS_COPY = "settings"

__all__ = [
    "LOCK_FILE",
    "SETTINGS_ATTRIBUTE",
    "SETTINGS_COPY",
    "SETTINGS_FILE",
    "RowStore",
    "SettingsMismatchError",
    "StoreIntegrityError",
    "WriteLock",
    "array_options",
    "default_chunk_rows",
    "settings_fingerprint",
]


def settings_fingerprint(record: Mapping[str, Any]) -> str:
    """Digest of a settings record, package versions left out.

    Example:
        >>> settings_fingerprint({"n": 1, "versions": {"torch": "2"}}) == settings_fingerprint(
        ...     {"n": 1})
        True
    """
    data = {k: v for k, v in record.items() if k != VERSIONS_KEY}
    return text_digest(json.dumps(jsonable(data), sort_keys=True))


def array_options(
    dtype: Any, fill_value: float | None = None, *, compress: bool = False
) -> dict[str, Any]:
    """Keyword arguments for every zarr array gradsketch creates.

    A crc32c checksum after each chunk (zarr v3's ``Crc32cCodec``: a torn,
    truncated or bit-flipped chunk fails to read instead of passing as
    data), no compression (gradients barely compress; writes stay at memcpy
    speed), and a fill value that cannot pass for data: NaN for floats, so a
    chunk that is missing reads NaN, not zeros.

    Args:
        dtype: the array's numpy dtype.
        fill_value: overrides the fill value (``None``: NaN for floats, else 0).
        compress: Blosc-zstd (level 3, byte shuffle) before the checksum, for
            data that compresses (the slt sample stores' losses and token
            ids: 8 % below devinterp's plain zstd on losses, 30 % on token ids).

    Example:
        >>> opts = array_options("float32")
        >>> opts["fill_value"], [type(c).__name__ for c in opts["compressors"]]
        (nan, ['Crc32cCodec'])
    """
    if fill_value is None:
        fill_value = float("nan") if np.dtype(dtype).kind in "fc" else 0
    codecs: tuple[Any, ...] = (Crc32cCodec(),)
    if compress:
        codecs = (BloscCodec(cname="zstd", clevel=3, shuffle="shuffle"), *codecs)
    return {"compressors": codecs, "fill_value": fill_value}


#: One in-process lock per lock file: threads of one process take turns on it.
_THREAD_LOCKS: dict[str, threading.RLock] = {}
_THREAD_LOCKS_GUARD = threading.Lock()


class WriteLock:
    """An advisory lock on a file, exclusive across processes and across threads.

    ``filelock`` (``flock`` on POSIX) excludes other processes; a re-entrant
    thread lock per lock file excludes other threads of this process (several
    stores opened on one directory in one process share it). Held only while
    writing; a process killed while holding it releases it (the OS drops
    ``flock`` locks with the process).

    Example:
        >>> import tempfile, os
        >>> lock = WriteLock(os.path.join(tempfile.mkdtemp(), ".write.lock"))
        >>> with lock.held():
        ...     with lock.held():  # re-entrant within a thread
        ...         pass
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        key = str(self.path.resolve())
        with _THREAD_LOCKS_GUARD:
            self._thread = _THREAD_LOCKS.setdefault(key, threading.RLock())
        # One FileLock object per file in this process (is_singleton), shared
        # across threads (thread_local=False): the thread lock above orders them.
        self._file = filelock.FileLock(key, thread_local=False, is_singleton=True)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold the lock for the ``with`` block (waits for other holders)."""
        with self._thread, self._file:
            yield


def _read_settings(path: Path) -> tuple[dict[str, Any] | None, str]:
    """The settings record at ``path``, or ``(None, what is wrong with it)``."""
    if not path.exists():
        return None, "is missing"
    try:
        return read_record(path), ""
    except (StoreIntegrityError, SettingsMismatchError) as exc:
        return None, f"is unreadable ({exc.__cause__ or 'not a JSON object'})"


def _unreadable(path: Path) -> bool:
    """Whether the zarr metadata ``path`` exists but cannot be read (truncated, garbled)."""
    return read_json(path)[1] not in (None, "missing")


def _nan_holes(block: np.ndarray) -> tuple[np.ndarray, str]:
    """Rows of a decoded chunk holding NaN: never written (callers store finite data only)."""
    return np.isnan(block.reshape(block.shape[0], -1)).any(axis=1), "holds NaN (never written)"


def default_chunk_rows(row_shape: tuple[int, ...], dtype: Any) -> int:
    """Rows per chunk so that a chunk holds about 1 MiB."""
    row_bytes = int(np.prod(row_shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    return max(1, DEFAULT_CHUNK_BYTES // max(row_bytes, 1))


def _row_indices(rows: Any) -> np.ndarray | None:
    """The rows as int64 indices, or ``None`` for an open-ended or strided slice."""
    if isinstance(rows, slice):
        if not (isinstance(rows.start, int) and isinstance(rows.stop, int)) or rows.step not in (
            None,
            1,
        ):
            return None
        return np.arange(rows.start, rows.stop, dtype=np.int64)
    return np.asarray(rows, dtype=np.int64).reshape(-1)


def _merge_jobs(first: _Job, second: _Job) -> _Job | None:
    """One write equal to ``first`` then ``second``, or ``None`` when they must stay apart.

    They merge when they write the same arrays (same row shape and dtype) and
    the same flags, to disjoint rows (with a shared row, the later write must
    win), within :data:`MERGE_MAX_BYTES`. Consecutive slices stay a slice.
    """
    rows_a, data_a, done_a = first
    rows_b, data_b, done_b = second
    idx_a, idx_b = _row_indices(rows_a), _row_indices(rows_b)
    if done_a != done_b or data_a.keys() != data_b.keys() or idx_a is None or idx_b is None:
        return None
    nbytes = 0
    for name, a in data_a.items():
        b = data_b[name]
        # A job whose values do not fit its rows stays alone, to fail alone.
        if a.shape[:1] != idx_a.shape or b.shape[:1] != idx_b.shape:
            return None
        if a.shape[1:] != b.shape[1:] or a.dtype != b.dtype:
            return None
        nbytes += a.nbytes + b.nbytes
    if nbytes > MERGE_MAX_BYTES:
        return None
    rows: slice | np.ndarray
    if isinstance(rows_a, slice) and isinstance(rows_b, slice) and rows_a.stop == rows_b.start:
        rows = slice(rows_a.start, rows_b.stop)
    else:
        rows = np.concatenate([idx_a, idx_b])
        if np.unique(rows).size != rows.size:
            return None
    data = {name: np.concatenate([a, data_b[name]]) for name, a in data_a.items()}
    return rows, data, done_a


def _rows_selection(rows: slice | np.ndarray | range, n: int) -> slice | np.ndarray:
    """A slice when ``rows`` are consecutive (fast path), else sorted int64 indices."""
    if isinstance(rows, slice):
        return rows
    idx = np.asarray(rows, dtype=np.int64).reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise IndexError(
            f"`rows` must lie in [0, {n}), got values from {idx.min()} to {idx.max()}; "
            "check the indices you pass (inds=...) against the array's length."
        )
    if idx.size and np.all(np.diff(idx) == 1):
        return slice(int(idx[0]), int(idx[-1]) + 1)
    return idx


class RowStore:
    """Row-chunked zarr arrays under one directory, with a settings record.

    Args:
        path: directory of the store (created if missing).
        settings: the settings that produced (or will produce) the data: a
            dataclass or a mapping of JSON values. Written to
            ``settings.json`` on creation and compared on reopening.
        what: how the store is named in error messages.
        packages: packages whose versions are recorded.

    Raises:
        SettingsMismatchError: the directory holds a store written with other
            settings (the message shows both values of every difference).
    """

    def __init__(
        self,
        path: str | Path,
        settings: Any,
        *,
        what: str = "store",
        packages: tuple[str, ...] | None = ("gradsketch", "torch", "numpy", "zarr"),
    ) -> None:
        self.path = Path(path)
        self.what = what
        if self.path.exists() and not self.path.is_dir():
            raise NotADirectoryError(
                f"the {what} path `{self.path}` is a file, not a directory; pass the path of a "
                "directory (it is created if missing), or move the file away."
            )
        self.path.mkdir(parents=True, exist_ok=True)
        self.lock = WriteLock(self.path / LOCK_FILE)
        record = settings_record(settings, packages=packages)
        self.fingerprint = settings_fingerprint(record)
        settings_path = self.path / SETTINGS_FILE
        with self.lock.held():
            stored, problem = _read_settings(settings_path)
            if stored is not None:
                require_same_settings(stored, record, where=f"{what} at `{self.path}`")
            else:
                # Lost or unreadable: judged from the fingerprints the arrays carry.
                self._check_arrays_made_by(record, problem)
                write_record(settings_path, record)
                stored = record
            self.settings = stored
            self.root = self._open_group()
            if SETTINGS_COPY not in self.root.attrs:
                self.root.attrs[SETTINGS_COPY] = jsonable(
                    {k: v for k, v in record.items() if k != VERSIONS_KEY}
                )
        # Opened arrays, by name: a lookup through the group re-reads metadata
        # from disk (~1.5 ms), and an array's shape never changes once created.
        self._arrays: dict[str, zarr.Array] = {}
        self._writer: BackgroundWriter[_Job] | None = None
        # Chunks found intact by damage(), by file identity: a later check in this
        # process reads only what changed (see VerifiedChunks for why that is safe).
        self._verified = VerifiedChunks()

    # -- the settings record, kept redundantly ----------------------------------
    def _array_fingerprints(self) -> dict[str, str | None]:
        """Each stored array's settings fingerprint (``None``: it records none)."""
        found: dict[str, str | None] = {}
        for folder, dirs, files in os.walk(self.path):
            here = Path(folder)
            # A nested store (its own settings record) answers for its own arrays.
            dirs[:] = [d for d in dirs if not (here / d / SETTINGS_FILE).exists()]
            if "zarr.json" not in files:
                continue
            meta, _ = read_json(here / "zarr.json")
            if meta is None:
                meta = {"node_type": "array"}  # damaged metadata: made by unknown settings
            if meta.get("node_type") == "array":
                name = here.relative_to(self.path).as_posix()
                found[name] = (meta.get("attributes") or {}).get(SETTINGS_ATTRIBUTE)
        return found

    def _settings_copy(self) -> dict[str, Any] | None:
        """The copy of the settings record kept in the root group's attributes."""
        meta, _ = read_json(self.path / "zarr.json")
        if meta is None:
            return None
        copy = (meta.get("attributes") or {}).get(SETTINGS_COPY)
        return copy if isinstance(copy, dict) else None

    def _check_arrays_made_by(self, record: Mapping[str, Any], problem: str) -> None:
        """Refuse to record ``record`` over arrays that other settings made.

        Raises:
            SettingsMismatchError: an array records another settings fingerprint
                (both settings shown where the root keeps a copy).
            StoreIntegrityError: an array records no fingerprint (written
                before arrays recorded one), so its settings cannot be checked.
        """
        other = {k: v for k, v in self._array_fingerprints().items() if v != self.fingerprint}
        where = f"the {self.what} at `{self.path}`: its settings record `{SETTINGS_FILE}` {problem}"
        if not other:
            if problem != "is missing" or (self.path / "zarr.json").exists():
                logger.warning(
                    "%s; every array in it was made with the settings requested now, so the "
                    "record is written again.",
                    where,
                )
            return
        unknown = sorted(name for name, fp in other.items() if fp is None)
        if unknown:
            raise StoreIntegrityError(
                f"{where}, and arrays {unknown[:3]} record no settings fingerprint (written by an "
                "older gradsketch), so the settings that made them cannot be checked. Fix: "
                "restore the record from a copy, or use another directory and recompute."
            )
        copy = self._settings_copy()
        if copy is not None and settings_fingerprint(copy) in other.values():
            shown = settings_diff(copy, record)
        else:
            stored = sorted({str(v) for v in other.values()})
            shown = [
                f"settings fingerprint: stored {stored}, requested {self.fingerprint!r} (arrays "
                f"{sorted(other)[:3]})"
            ]
        raise SettingsMismatchError(
            f"{where}, and its arrays were made with other settings:\n  "
            + "\n  ".join(shown)
            + "\nRerun with the settings they were made with (the record is then written "
            "again), or use another directory for the new settings."
        )

    # -- write-behind -------------------------------------------------------
    def flush(self) -> None:
        """Wait until every background write is on disk; raise the first that failed.

        Raises:
            RuntimeError: a background write failed (the original exception is
                chained); its rows stay unflagged and are redone by a rerun.
        """
        if self._writer is None:
            return
        try:
            self._writer.wait()
        except BaseException as failure:
            raise RuntimeError(
                f"a background write to the {self.what} at `{self.path}` failed: "
                f"{failure!r}. Its rows were not flagged done; rerun to redo them."
            ) from failure

    def close(self) -> None:
        """Flush, then stop the writer thread (a later background write starts a new one)."""
        try:
            self.flush()
        finally:
            writer, self._writer = self._writer, None
            if writer is not None:
                writer.close()

    def _background(self) -> BackgroundWriter[_Job]:
        if self._writer is not None:
            return self._writer
        store_ref = weakref.ref(self)

        def write(job: _Job) -> None:
            # A weak reference: the thread must not keep a dropped store alive.
            store = store_ref()
            if store is not None:
                store.write_rows(job[0], job[1], done=job[2])

        # A few queued batches: enough to overlap compute with writing and to
        # merge small batches (zarr's cost per write call, ~1 ms per array and
        # per partly written chunk, dwarfs a small batch's), while a kill loses
        # little and memory stays bounded.
        self._writer = BackgroundWriter(
            write,
            max_pending=WRITE_QUEUE + 1,
            merge=_merge_jobs,
            name=f"gradsketch-store-{id(self):x}",
        )
        _at_exit(_flush_at_exit, weakref.ref(self))
        return self._writer

    # -- arrays -------------------------------------------------------------
    def has(self, name: str) -> bool:
        """Whether an array (or group) called ``name`` exists."""
        self.flush()
        return self._contains(name)

    def _contains(self, name: str) -> bool:
        try:
            return name in self.root
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise self._damaged_metadata(name, exc) from exc

    def _damaged_metadata(self, name: str, cause: object) -> StoreIntegrityError:
        # zarr reads the metadata of every node on the way to ``name``.
        damaged = [
            p
            for p in (self.path / name).parents
            if p.is_relative_to(self.path) and _unreadable(p / "zarr.json")
        ]
        where = damaged[0] if damaged else self.path / name
        if _unreadable(self.path / name / "zarr.json"):
            where = self.path / name
        return StoreIntegrityError(
            f"the {self.what} at `{self.path}` has a damaged zarr record `{where / 'zarr.json'}` "
            f"({cause!r}). Fix: delete the directory `{where}` and rerun; what it held is "
            "recomputed."
        )

    def array(self, name: str) -> zarr.Array:
        """The existing array ``name`` (after any background writes are on disk)."""
        self.flush()
        return self._array(name)

    def _array(self, name: str) -> zarr.Array:
        cached = self._arrays.get(name)
        if cached is not None:
            return cached
        if not self._contains(name):
            raise KeyError(
                f"`name`={name!r} is not in the {self.what} at `{self.path}`; it holds "
                f"{self._entries()}. Create it with require_array(...) first."
            )
        try:
            node = self.root[name]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError) as exc:
            raise self._damaged_metadata(name, exc) from exc
        if not isinstance(node, zarr.Array):
            raise KeyError(f"`name`={name!r} in `{self.path}` is a group, not an array.")
        self._arrays[name] = node
        return node

    def _entries(self) -> list[str]:
        # Listing the directory, not the zarr group: settings.json is no zarr node.
        return sorted(p.name for p in self.path.iterdir() if (p / "zarr.json").exists())

    def require_array(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: Any,
        *,
        chunk_rows: int | None = None,
        fill_value: float | None = None,
    ) -> zarr.Array:
        """Open the array ``name``, creating it if absent.

        Args:
            name: ``/``-separated path inside the store.
            shape: the array's shape; rows are the first axis.
            dtype: numpy dtype.
            chunk_rows: rows per chunk (default: about 1 MiB per chunk).
            fill_value: value of never-written entries (default: NaN for
                floats, 0 otherwise; see :func:`array_options`).

        Raises:
            SettingsMismatchError: an array of that name exists with another
                shape or dtype (both shown).
        """
        self.flush()
        shape = tuple(int(s) for s in shape)
        dtype = np.dtype(dtype)
        with self.lock.held():
            # Under the lock: another process may have created it meanwhile.
            if self._contains(name):
                arr = self._array(name)
                if tuple(arr.shape) != shape or np.dtype(arr.dtype) != dtype:
                    raise SettingsMismatchError(
                        f"array {name!r} in the {self.what} at `{self.path}` has shape "
                        f"{tuple(arr.shape)} and dtype {arr.dtype}, but shape {shape} and dtype "
                        f"{dtype} were requested. Use another directory or delete the array."
                    )
                return arr
            rows = chunk_rows or default_chunk_rows(shape[1:], dtype)
            chunks = (max(1, min(rows, max(shape[0], 1))), *shape[1:])
            parent, _, leaf = name.rpartition("/")
            group = self.root.require_group(parent) if parent else self.root
            created = group.create_array(
                leaf,
                shape=shape,
                dtype=dtype,
                chunks=chunks,
                attributes={SETTINGS_ATTRIBUTE: self.fingerprint},
                **array_options(dtype, fill_value),
            )
        self._arrays[name] = created
        return created

    def delete(self, name: str) -> None:
        """Remove an array or group (no error if absent)."""
        self.flush()
        target = self.path / name
        # Forget cached arrays at or below ``name``.
        for key in [k for k in self._arrays if k == name or k.startswith(f"{name}/")]:
            del self._arrays[key]
        self._verified.forget(name)
        with self.lock.held():
            if target.exists():
                shutil.rmtree(target)
                self.root = self._open_group()

    def _open_group(self) -> zarr.Group:
        try:
            return zarr.open_group(str(self.path), mode="a")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise StoreIntegrityError(
                f"the {self.what} at `{self.path}` has a damaged zarr record "
                f"`{self.path / 'zarr.json'}` ({exc}). Fix: delete that file and rerun (it is "
                "written again; the arrays are kept)."
            ) from exc

    # -- done flags ----------------------------------------------------------
    def require_done(self, name: str, n_rows: int, *, chunk_rows: int | None = None) -> None:
        """Create (or open) the done flags ``name``: uint8 ``[n_rows]``, all 0 at first.

        Use the data arrays' ``chunk_rows`` so that writers splitting work on
        chunk boundaries never share a flag chunk.
        """
        self.require_array(name, (n_rows,), np.uint8, chunk_rows=chunk_rows or 4096)

    def done_rows(self, name: str) -> np.ndarray:
        """Boolean ``[n_rows]``: which rows are complete."""
        flags = self.array(name)
        try:
            return np.asarray(flags[:], dtype=bool)
        except ValueError as exc:
            raise StoreIntegrityError(
                f"the done flags {name!r} of the {self.what} at `{self.path}` are damaged "
                f"({exc}). Fix: delete the directory `{self.path / name}` and rerun; every row "
                "it flagged is recomputed."
            ) from exc

    def damage(
        self, names: Sequence[str], done: str, only: np.ndarray | None = None
    ) -> list[ChunkDamage]:
        """Each damaged chunk of ``names`` that holds rows flagged in ``done``, with those rows.

        ``only`` (boolean, one per row): only those rows' chunks are read (a
        ``torch.distributed`` rank checks the rows it wrote; ``None``: every row).

        Every store's checks (:func:`gradsketch._integrity.scan_array`): a
        chunk file that is missing, fails its checksum or cannot be decoded
        (truncated, garbled); and this store's own: in a float array whose
        fill value is NaN, a row holding NaN (never-written entries read NaN;
        callers store finite data only). Only flagged rows are reported.
        Reads one chunk at a time, and only chunks not already found intact
        by an earlier call on this object whose files are unchanged since
        (:class:`~gradsketch._integrity.VerifiedChunks`: same inode, size,
        mtime and ctime), so that each phase of a run does not read the whole
        store again before reading it.

        Raises:
            StoreIntegrityError: an array's ``zarr.json`` is unreadable (its rows
                cannot be rewritten; the message names the directory to delete).
        """
        flags = self.done_rows(done)
        if only is not None:
            flags &= np.asarray(only, dtype=bool)
        flagged = np.flatnonzero(flags)
        found: list[ChunkDamage] = []
        if not flagged.size:
            return found
        for name in names:
            arr = self.array(name)
            fill = arr.fill_value
            nan_fill = arr.dtype.kind == "f" and fill is not None and bool(np.isnan(fill))
            # Chunks this store found intact before, unchanged since, are not read again.
            todo, taken = self._verified.unverified(self.path, name, flagged)
            if not todo.size:
                continue
            scanned = scan_array(
                self.path, name, rows=todo, inspect=_nan_holes if nan_fill else None
            )
            here: list[ChunkDamage] = []
            for d in scanned:
                if not d.chunk:
                    raise self._damaged_metadata(name, d.problem)
                rows = tuple(r for r in d.rows if flags[r])
                if rows:
                    here.append(dataclasses.replace(d, rows=rows))
            self._verified.record(name, todo, taken, here)
            found.extend(here)
        return found

    def damaged_rows(self, names: Sequence[str], done: str) -> dict[str, np.ndarray]:
        """Rows flagged in ``done`` whose data in an array of ``names`` is not intact.

        :meth:`damage` by array: ``{array_name: sorted row indices}`` for each
        array with damaged rows.
        """
        rows: dict[str, set[int]] = {}
        for d in self.damage(names, done):
            rows.setdefault(d.array, set()).update(d.rows)
        return {name: np.array(sorted(r), dtype=np.int64) for name, r in rows.items()}

    def unflag_damaged(
        self, names: Sequence[str], done: str, only: np.ndarray | None = None
    ) -> list[ChunkDamage]:
        """:meth:`damage`, its rows unflagged in ``done`` (so that a rerun recomputes them)."""
        found = self.damage(names, done, only)
        if found:
            self.unflag(done, np.array([r for d in found for r in d.rows], dtype=np.int64))
        return found

    def unflag(self, name: str, rows: np.ndarray) -> None:
        """Clear the done flags ``name`` of ``rows`` (so that a rerun recomputes them)."""
        self.flush()
        idx = np.unique(np.asarray(rows, dtype=np.int64).reshape(-1))
        if idx.size:
            with self.lock.held():
                self._array(name).oindex[idx] = np.zeros(idx.size, dtype=np.uint8)

    def write_rows(
        self,
        rows: slice | np.ndarray | range,
        data: Mapping[str, Any],
        *,
        done: str | None = None,
        background: bool = False,
    ) -> None:
        """Write the same rows of several arrays, then flag them done.

        Args:
            rows: a slice, or integer indices (sorted or not; duplicates are an
                error of the caller).
            data: ``{array_name: values}`` with ``values.shape[0]`` rows each.
            done: name of the flags to set once every array is written.
            background: return at once and let the writer thread write (in
                call order; see the module docstring). The values are copied
                first, so the caller may reuse its buffers.
        """
        if background:
            writer = self._background()
            if writer.failed:
                self.flush()  # raises
            copies = {name: np.array(values, copy=True) for name, values in data.items()}
            if isinstance(rows, np.ndarray):
                rows = rows.copy()
            writer.submit((rows, copies, done))
            return
        names = list(data)
        if not names:
            return
        with self.lock.held():
            self._write_rows(rows, data, names, done)

    def _write_rows(
        self,
        rows: slice | np.ndarray | range,
        data: Mapping[str, Any],
        names: list[str],
        done: str | None,
    ) -> None:
        n = self._array(names[0]).shape[0]
        sel = _rows_selection(rows, n)
        order: np.ndarray | None = None
        if isinstance(sel, np.ndarray) and sel.size:
            # zarr's orthogonal indexing wants increasing indices.
            order = np.argsort(sel, kind="stable")
            sel = sel[order]
        for name in names:
            values = np.asarray(data[name])
            if order is not None:
                values = values[order]
            arr = self._array(name)
            count = sel.stop - sel.start if isinstance(sel, slice) else sel.size
            expected = (count, *arr.shape[1:])
            if values.shape != expected:
                # zarr would broadcast or reshape some mismatches silently.
                raise ValueError(
                    f"`data[{name!r}]` has shape {values.shape}, but {count} rows of array "
                    f"{name!r} (shape {tuple(arr.shape)}) take shape {expected}. Fix: pass "
                    "one row of values per selected row."
                )
            if isinstance(sel, slice):
                arr[sel] = values
            elif sel.size:
                arr.oindex[sel] = values
        if done is not None:
            flags = self._array(done)
            if isinstance(sel, slice):
                flags[sel] = np.ones(sel.stop - sel.start, dtype=np.uint8)
            elif sel.size:
                flags.oindex[sel] = np.ones(sel.size, dtype=np.uint8)

    def __repr__(self) -> str:
        return f"RowStore({str(self.path)!r}, what={self.what!r})"


def _at_exit(fn: Any, *args: Any) -> None:
    """Run ``fn(*args)`` at interpreter exit, before thread pools shut down.

    zarr writes chunk files through an executor, and Python shuts executors
    down (``threading._register_atexit``) before ``atexit`` handlers run: a
    flush from a plain ``atexit`` handler would fail and lose the queued rows.
    Handlers registered the same way run newest first, so ours runs while
    zarr's executor still takes work.
    """
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is not None:
            register(fn, *args)
            return
    except RuntimeError:  # registered during shutdown
        pass
    atexit.register(fn, *args)


def _flush_at_exit(ref: weakref.ref[RowStore]) -> None:
    """Write what is queued before the interpreter exits (daemon threads are not joined)."""
    store = ref()
    if store is not None:
        try:
            store.close()
        except RuntimeError as exc:
            logger.error("%s", exc)
