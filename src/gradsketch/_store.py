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
* **Several writers.** Processes may write disjoint rows concurrently when
  they split the work on chunk boundaries (``chunk_rows``): two writers never
  touch the same chunk file, of the data or of the flags.

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
import logging
import shutil
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from gradsketch._settings import (
    SettingsMismatchError,
    read_record,
    require_same_settings,
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

__all__ = ["SETTINGS_FILE", "RowStore", "SettingsMismatchError", "default_chunk_rows"]


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
        self.path.mkdir(parents=True, exist_ok=True)
        record = settings_record(settings, packages=packages)
        settings_path = self.path / SETTINGS_FILE
        if settings_path.exists():
            stored = read_record(settings_path)
            require_same_settings(stored, record, where=f"{what} at `{self.path}`")
            self.settings = stored
        else:
            write_record(settings_path, record)
            self.settings = record
        self.root = zarr.open_group(str(self.path), mode="a")
        # Opened arrays, by name: a lookup through the group re-reads metadata
        # from disk (~1.5 ms), and an array's shape never changes once created.
        self._arrays: dict[str, zarr.Array] = {}
        self._writer: BackgroundWriter[_Job] | None = None

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
        atexit.register(_flush_at_exit, weakref.ref(self))
        return self._writer

    # -- arrays -------------------------------------------------------------
    def has(self, name: str) -> bool:
        """Whether an array (or group) called ``name`` exists."""
        self.flush()
        return name in self.root

    def array(self, name: str) -> zarr.Array:
        """The existing array ``name`` (after any background writes are on disk)."""
        self.flush()
        return self._array(name)

    def _array(self, name: str) -> zarr.Array:
        cached = self._arrays.get(name)
        if cached is not None:
            return cached
        if name not in self.root:
            raise KeyError(
                f"`name`={name!r} is not in the {self.what} at `{self.path}`; it holds "
                f"{self._entries()}. Create it with require_array(...) first."
            )
        node = self.root[name]
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
        fill_value: float = 0,
    ) -> zarr.Array:
        """Open the array ``name``, creating it if absent.

        Args:
            name: ``/``-separated path inside the store.
            shape: the array's shape; rows are the first axis.
            dtype: numpy dtype.
            chunk_rows: rows per chunk (default: about 1 MiB per chunk).
            fill_value: value of never-written entries.

        Raises:
            SettingsMismatchError: an array of that name exists with another
                shape or dtype (both shown).
        """
        self.flush()
        shape = tuple(int(s) for s in shape)
        dtype = np.dtype(dtype)
        if name in self.root:
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
        # Floating-point gradients barely compress; skipping the codec keeps
        # row writes at memcpy speed.
        created = group.create_array(
            leaf,
            shape=shape,
            dtype=dtype,
            chunks=chunks,
            compressors=None,
            fill_value=fill_value,
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
        if target.exists():
            shutil.rmtree(target)
            self.root = zarr.open_group(str(self.path), mode="a")

    # -- done flags ----------------------------------------------------------
    def require_done(self, name: str, n_rows: int, *, chunk_rows: int | None = None) -> None:
        """Create (or open) the done flags ``name``: uint8 ``[n_rows]``, all 0 at first.

        Use the data arrays' ``chunk_rows`` so that writers splitting work on
        chunk boundaries never share a flag chunk.
        """
        self.require_array(name, (n_rows,), np.uint8, chunk_rows=chunk_rows or 4096)

    def done_rows(self, name: str) -> np.ndarray:
        """Boolean ``[n_rows]``: which rows are complete."""
        return np.asarray(self.array(name)[:], dtype=bool)

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


def _flush_at_exit(ref: weakref.ref[RowStore]) -> None:
    """Write what is queued before the interpreter exits (daemon threads are not joined)."""
    store = ref()
    if store is not None:
        try:
            store.close()
        except RuntimeError as exc:
            logger.error("%s", exc)
