"""Damage in a zarr store, named by array, chunk, file and fix: what every store read checks.

A zarr (v3) array is a directory holding its metadata (``zarr.json``) and
one file per chunk (``c/<i>/<j>/...`` under zarr's default chunk key
encoding). A read can meet three kinds of damage, which zarr reports badly
or not at all:

* a **missing chunk** reads as the fill value without an error (NaN for
  gradsketch's floats), so an estimate computed from it is silently NaN;
* a **bit-flipped or truncated chunk** fails its crc32c checksum (or its
  decompression) with zarr's bare "Stored and computed checksum do not
  match", which names no array or file;
* a **truncated or garbled** ``zarr.json`` gives a bare ``JSONDecodeError``.

:func:`scan_array` finds all three in one array (in every chunk, or only in
those holding chosen rows of the leading axis: the rows a caller has flagged
done) and returns one :class:`ChunkDamage` per bad chunk or metadata file;
:func:`damage_message` turns them into one message naming each array, chunk
and file, then the fix (``by_rows=True``: grouped by array with the rows each
lost, for a store of rows); :func:`damaged_rows` gives the leading-axis rows
they cover, for a caller that can recompute them. A store adds its own checks
of a decoded chunk through ``scan_array(..., inspect=)`` (the row stores: a
row that reads NaN was never written). :func:`read_json` reads a
metadata file or says why it cannot; :func:`holds_data` tells a directory
that holds chunks from one that is provably empty.

Checking costs one read of each chunk, and only once: where a chunk file is
its raw bytes and a crc32c (gradsketch's uncompressed arrays),
:func:`scan_array` and :func:`read_rows` read the file themselves and check
the crc32c as zarr would, without zarr's decode copies (zarr still decodes,
and names, whatever fails); :class:`VerifiedChunks` remembers which chunks a
scan found intact, by file identity, so that a store checking the same
array again reads only what changed.

Imports no gradsketch package (the ground floor): every store uses it.

Example:
    >>> import tempfile, numpy as np, zarr
    >>> root = Path(tempfile.mkdtemp()) / "s.zarr"
    >>> arr = zarr.open_group(str(root), mode="w").create_array(
    ...     "x", shape=(2, 3), chunks=(1, 3), dtype="f4", fill_value=float("nan"))
    >>> arr[:] = np.ones((2, 3), np.float32)
    >>> (root / "x" / "c" / "1" / "0").unlink()
    >>> [(d.array, d.chunk, d.problem) for d in scan_array(root, "x")]
    [('x', (1, 0), 'missing')]
    >>> damaged_rows(scan_array(root, "x"), 2)
    [1]
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
import zarr

__all__ = [
    "RACY_NS",
    "ChunkDamage",
    "VerifiedChunks",
    "damage_message",
    "damaged_rows",
    "holds_data",
    "read_json",
    "read_rows",
    "rows_text",
    "scan_array",
]

#: What a chunk or metadata file may be called without holding data.
_EMPTY_NAMES = ("zarr.json", ".zattrs", ".zgroup", ".zarray", ".zmetadata")


@dataclass(frozen=True)
class ChunkDamage:
    """One damaged chunk (or metadata file) of an array in a store.

    Attributes:
        array: The array's path inside the store (``"sampling_loss"``).
        chunk: The chunk's grid coordinates; ``()`` for the array's metadata.
        file: The file on disk that is missing or damaged.
        problem: ``"missing"``, ``"checksum mismatch"``, what failed to decode, or
            what a store's own check found (``inspect`` of :func:`scan_array`).
        rows: The leading-axis indices the damage covers (the chunk's, the
            caller's rows among them, or those its own check found; none for metadata).
    """

    array: str
    chunk: tuple[int, ...]
    file: Path
    problem: str
    rows: Sequence[int]


def read_json(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """``(metadata, None)`` for a readable JSON object at ``path``, else ``(None, reason)``."""
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        return None, "missing"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"unreadable ({type(exc).__name__}: {exc}; truncated or garbled)"
    if not isinstance(data, dict):
        return None, f"unreadable (a JSON {type(data).__name__}, not an object)"
    return data, None


def holds_data(path: Path) -> bool:
    """Whether the directory ``path`` holds any file other than zarr metadata and temporaries.

    False only for what is provably empty: directories whose files are all
    ``zarr.json`` (or zarr v2 metadata) or ``.partial`` temporaries. A chunk
    file anywhere below makes it True.
    """
    if not path.is_dir():
        return path.exists() and not (path.name in _EMPTY_NAMES or path.name.endswith(".partial"))
    for entry in path.rglob("*"):
        if entry.is_dir():
            continue
        if entry.name in _EMPTY_NAMES or entry.name.endswith(".partial"):
            continue
        return True
    return False


def _chunk_key(metadata: dict[str, Any], coords: tuple[int, ...]) -> str | None:
    """The store key of chunk ``coords`` under the array's chunk key encoding (None: unknown)."""
    encoding = metadata.get("chunk_key_encoding", {})
    if not isinstance(encoding, dict):
        return None
    name = encoding.get("name")
    config = encoding.get("configuration", {}) or {}
    if name == "default":
        sep = config.get("separator", "/")
        return sep.join(["c", *map(str, coords)])
    if name == "v2":
        sep = config.get("separator", ".")
        return sep.join(map(str, coords)) if coords else "0"
    return None


def _raw_layout(metadata: dict[str, Any], grid: tuple[int, ...]) -> np.dtype | None:
    """The chunks' dtype where a chunk file is its raw bytes and a crc32c, else ``None``.

    That is the layout :func:`gradsketch._store.array_options` writes without
    compression: codecs exactly ``bytes`` (little-endian) then ``crc32c``, a
    regular grid of unsharded chunks, a plain numeric dtype. Every other
    layout is read through zarr.
    """
    codecs = metadata.get("codecs")
    if not isinstance(codecs, list) or len(codecs) != 2 or sys.byteorder != "little":
        return None
    first, second = codecs
    if not (isinstance(first, dict) and isinstance(second, dict)):
        return None
    endian = (first.get("configuration") or {}).get("endian", "little")
    if first.get("name") != "bytes" or endian != "little" or second.get("name") != "crc32c":
        return None
    chunk_grid = metadata.get("chunk_grid") or {}
    shape = ((chunk_grid.get("configuration") or {}).get("chunk_shape")) or []
    if chunk_grid.get("name") != "regular" or [int(c) for c in shape] != list(grid):
        return None
    try:
        dtype = np.dtype(str(metadata.get("data_type")))
    except TypeError:
        return None
    return dtype if dtype.kind in "biuf" else None


def _read_raw(
    file: Path,
    dtype: np.dtype,
    grid: tuple[int, ...],
    region: tuple[slice, ...],
    coords: tuple[int, ...],
) -> np.ndarray | None:
    """The chunk at ``file`` cut to ``region``, read and checked without zarr; ``None``: ask zarr.

    Reads the file once, checks its length and its crc32c (the one zarr's
    ``Crc32cCodec`` writes after the data), and views the bytes as the chunk
    (zarr v3 stores edge chunks at full size). Anything unexpected (a wrong
    length or checksum, an unreadable file) returns ``None``: the caller
    decodes the chunk through zarr, which names the problem as before.
    """
    try:
        data = file.read_bytes()
    except OSError:
        return None
    size = int(np.prod(grid, dtype=np.int64)) * dtype.itemsize
    if len(data) != size + 4:
        return None
    body = np.frombuffer(data, dtype=np.uint8, count=size)  # a view, not a copy
    if google_crc32c.value(body).to_bytes(4, "little") != data[size:]:
        return None
    block = body.view(dtype).reshape(grid)
    local = tuple(slice(r.start - c * g, r.stop - c * g) for r, c, g in zip(region, coords, grid))
    return block[local]


def _read_chunk_into(file: Path, dest: np.ndarray) -> bool:
    """Read the chunk file ``file`` into the bytes ``dest``; whether its crc32c checks out."""
    try:
        with open(file, "rb", buffering=0) as f:
            got = 0
            while got < dest.size:
                count = f.readinto(dest[got:].data)
                if not count:
                    return False
                got += count
            tail = f.read(5)
    except OSError:
        return False
    return len(tail) == 4 and google_crc32c.value(dest).to_bytes(4, "little") == tail


def read_rows(array: Any, start: int, stop: int) -> np.ndarray | None:
    """Rows ``start:stop`` of a zarr array on local disk, read from its chunk files and checked.

    For the layout of :func:`_raw_layout` with whole rows per chunk: each
    chunk file is read once, straight into the result where the chunk lies
    inside ``start:stop`` (else through one buffer), and its crc32c is
    checked as zarr's ``Crc32cCodec`` would, without zarr's decode copies
    and per-chunk overhead. ``None`` where the array is stored otherwise
    (not a local store, compressed, sharded) or any chunk is missing or
    fails its check: the caller then reads through zarr, which reads a
    missing chunk as its fill value and names a failed check as before.

    Example:
        >>> import tempfile
        >>> from zarr.codecs import Crc32cCodec
        >>> root = Path(tempfile.mkdtemp()) / "s.zarr"
        >>> arr = zarr.open_group(str(root), mode="w").create_array(
        ...     "y", shape=(5, 2), chunks=(2, 2), dtype="f4", compressors=(Crc32cCodec(),))
        >>> arr[:] = np.arange(10, dtype=np.float32).reshape(5, 2)
        >>> read_rows(arr, 1, 4).tolist()
        [[2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]
    """
    store_path = getattr(array, "store_path", None)
    root = getattr(getattr(store_path, "store", None), "root", None)
    if store_path is None or not isinstance(root, Path):
        return None
    base = root / str(store_path.path)
    metadata, _ = read_json(base / "zarr.json")
    if metadata is None or metadata.get("node_type") != "array":
        return None
    shape = [int(x) for x in metadata.get("shape") or []]
    config = (metadata.get("chunk_grid") or {}).get("configuration") or {}
    grid = tuple(int(x) for x in config.get("chunk_shape") or [])
    dtype = _raw_layout(metadata, grid)
    if (
        dtype is None
        or not shape
        or list(grid[1:]) != shape[1:]
        or tuple(array.shape) != tuple(shape)
    ):
        return None
    start, stop = max(0, int(start)), min(int(stop), shape[0])
    out = np.empty((max(0, stop - start), *shape[1:]), dtype=dtype)
    if not out.size:
        return out
    flat = out.reshape(-1).view(np.uint8)
    per = grid[0]
    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
    zeros = (0,) * (len(shape) - 1)
    buffer: np.ndarray | None = None
    for c in range(start // per, -(-stop // per)):
        key = _chunk_key(metadata, (c, *zeros))
        if key is None:
            return None
        a, b = max(start, c * per), min(stop, (c + 1) * per)
        dest = flat[(a - start) * row_bytes : (b - start) * row_bytes]
        if a == c * per and b == (c + 1) * per:
            if not _read_chunk_into(base / key, dest):
                return None
            continue
        if buffer is None:
            buffer = np.empty(per * row_bytes, dtype=np.uint8)
        if not _read_chunk_into(base / key, buffer):
            return None
        dest[...] = buffer[(a - c * per) * row_bytes : (b - c * per) * row_bytes]
    return out


def scan_array(
    store: Path,
    name: str,
    *,
    rows: Iterable[int] | None = None,
    missing: bool = True,
    inspect: Callable[[np.ndarray], tuple[np.ndarray, str]] | None = None,
) -> list[ChunkDamage]:
    """Every damaged chunk of the array ``name`` in the store at ``store``.

    Each chunk (restricted to those holding a leading-axis row in ``rows``
    when given) must exist as a file and decode (its crc32c checksum and
    compression check out); an array whose ``zarr.json`` is missing or
    unreadable is one :class:`ChunkDamage` with ``chunk=()`` covering every
    row. Reads one chunk at a time.

    Args:
        store: The store's root directory.
        name: The array's path inside it (``"progress/chain_done"``).
        rows: Leading-axis indices whose chunks are checked (None: all).
        missing: Count an absent chunk file as damage (False for stores written by
            others, whose writers may skip chunks that hold only the fill value).
        inspect: A store's own check of each decoded chunk: ``block -> (bad, problem)``
            with ``bad`` a boolean mask over the block's leading-axis rows; the rows it
            flags are one more :class:`ChunkDamage` (e.g. NaN holes, never written).

    Returns:
        One entry per damaged chunk, in grid order (empty: intact).
    """
    meta_path = store / name / "zarr.json"
    metadata, reason = read_json(meta_path)
    shape = metadata.get("shape") if metadata is not None else None
    if metadata is None or metadata.get("node_type") != "array" or not isinstance(shape, list):
        problem = reason or "not an array's metadata"
        return [ChunkDamage(name, (), meta_path, problem, range(0))]
    arr = zarr.open_array(str(store / name), mode="r")
    # The files are shards where the array is sharded, else chunks.
    grid = tuple(int(c) for c in (getattr(arr, "shards", None) or arr.chunks))
    raw = _raw_layout(metadata, grid)
    extents = [-(-int(n) // max(1, g)) for n, g in zip(arr.shape, grid)]
    wanted: set[int] | None = None
    if rows is not None:
        picked = np.asarray(rows if isinstance(rows, np.ndarray) else list(rows), dtype=np.int64)
        # The leading-axis chunks that hold a wanted row (0-d arrays: the row 0).
        picked = picked.reshape(-1)
        wanted = set((picked // max(1, grid[0])).tolist()) if grid else set(picked.tolist()) & {0}
    found: list[ChunkDamage] = []
    for coords in itertools.product(*(range(e) for e in extents)):
        region = tuple(
            slice(c * g, min((c + 1) * g, int(n))) for c, g, n in zip(coords, grid, arr.shape)
        )
        held = range(region[0].start, region[0].stop) if region else range(1)
        if wanted is not None and (coords[0] if coords else 0) not in wanted:
            continue
        key = _chunk_key(metadata, coords)
        file = store / name / Path(*key.split("/")) if key is not None else store / name
        if key is not None and not file.is_file():
            if not missing:
                continue
            found.append(ChunkDamage(name, coords, file, "missing", held))
            continue
        block = _read_raw(file, raw, grid, region, coords) if raw is not None else None
        try:
            if block is None:
                block = np.asarray(arr[region])
        except Exception as exc:  # zarr and its codecs raise many types for a bad chunk
            text = str(exc)
            problem = "checksum mismatch" if "checksum" in text.lower() else f"undecodable ({text})"
            found.append(ChunkDamage(name, coords, file, problem, held))
            continue
        if inspect is not None:
            bad, problem = inspect(block)
            hit = tuple(held[i] for i in np.flatnonzero(np.asarray(bad).reshape(-1)))
            if hit:
                found.append(ChunkDamage(name, coords, file, problem, hit))
    return found


#: How long after a file's last change its identity (:func:`file_identity`) is
#: trusted: two writes within one tick of the file system's clock can leave the
#: same size and times, so an identity taken sooner than this after the change
#: proves nothing. 2 s covers the coarsest clocks in use (FAT's 2 s; Linux
#: file systems tick every 1-10 ms).
RACY_NS = 2_000_000_000


def file_identity(path: Path) -> tuple[tuple[int, ...] | None, bool]:
    """``(identity, trusted)`` of the file at ``path`` (``(None, False)``: no such file).

    The identity is ``(device, inode, size, mtime_ns, ctime_ns)``. zarr
    replaces a chunk file by writing a new one and renaming it (a new inode);
    a write in place changes the size or the change time (ctime, which no
    user call can set back). ``trusted``: the file last changed more than
    :data:`RACY_NS` before the identity was taken, so any later change shows
    in a later ctime.
    """
    try:
        st = os.stat(path)
    except OSError:
        return None, False
    taken = time.time_ns()
    changed = max(st.st_ctime_ns, st.st_mtime_ns)
    identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return identity, taken - changed > RACY_NS


class VerifiedChunks:
    """Chunks of a store's row-chunked arrays that a scan found intact, by file identity.

    :func:`scan_array` reads and checks every chunk; a process that checks
    the same array again (each phase of a TRAKer) need not read unchanged
    chunks twice. :meth:`unverified` gives the rows whose chunks must be
    scanned: those not scanned before, those whose file or the array's
    ``zarr.json`` changed identity (:func:`file_identity`) since, and those
    whose identity was too fresh to trust. :meth:`record` remembers what a
    scan found intact. Only arrays chunked along rows alone (each chunk holds
    whole rows) are remembered; others are always scanned.

    Why skipping is safe: a chunk is skipped only when it was read and found
    intact (checksum, decoding, the store's own ``inspect``) with the rows
    now flagged among those checked, and its file has the same device,
    inode, size, mtime and ctime as when the scan began, taken at least
    :data:`RACY_NS` after its last change. Every writer changes one of them:
    zarr writes a new file and renames it (a new inode), a write in place or
    a truncation moves the ctime (or the size), and a deleted file has no
    identity. Rot below the file system, which changes none of them, still
    fails the crc32c check of the phase's own read of the chunk
    (:func:`read_rows`, or zarr's). The times are the file system's clock,
    compared with this machine's: a network file system whose server clock
    lags by more than :data:`RACY_NS` weakens the freshness rule (not the
    inode and size checks).
    """

    def __init__(self) -> None:
        #: name -> (zarr.json identity, rows per chunk, {chunk: identity}, verified rows)
        self._arrays: dict[
            str, tuple[tuple[int, ...], int, dict[int, tuple[int, ...]], np.ndarray]
        ] = {}

    def forget(self, name: str) -> None:
        """Drop what is known of ``name`` and every array below it."""
        for key in [k for k in self._arrays if k == name or k.startswith(f"{name}/")]:
            del self._arrays[key]

    def _layout(self, store: Path, name: str) -> tuple[dict[str, Any], int, int] | None:
        """``(metadata, rows, rows per chunk)`` of an array chunked along rows alone."""
        metadata, _ = read_json(store / name / "zarr.json")
        if metadata is None or metadata.get("node_type") != "array":
            return None
        grid = metadata.get("chunk_grid") or {}
        shape = metadata.get("shape") or []
        chunks = (grid.get("configuration") or {}).get("chunk_shape") or []
        if grid.get("name") != "regular" or len(shape) != len(chunks) or not shape:
            return None
        if list(chunks[1:]) != list(shape[1:]) or int(chunks[0]) < 1:
            return None
        return metadata, int(shape[0]), int(chunks[0])

    def unverified(
        self, store: Path, name: str, rows: np.ndarray
    ) -> tuple[np.ndarray, dict[int, tuple[int, ...]]]:
        """The rows among ``rows`` whose chunks must be scanned, and the identities taken now.

        Pass the identities to :meth:`record` after the scan (taken before it:
        a file replaced meanwhile then differs at the next check).
        """
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        meta_id, meta_trusted = file_identity(store / name / "zarr.json")
        found = self._layout(store, name)
        if found is None or meta_id is None or not meta_trusted:
            self._arrays.pop(name, None)
            return rows, {}
        metadata, n, per = found
        known = self._arrays.get(name)
        if known is None or known[0] != meta_id or known[1] != per or known[3].size != n:
            known = (meta_id, per, {}, np.zeros(n, dtype=bool))
            self._arrays[name] = known
        _, _, idents, verified = known
        rows = rows[(rows >= 0) & (rows < n)]
        taken: dict[int, tuple[int, ...]] = {}
        need = np.zeros(rows.size, dtype=bool)
        chunk_of = rows // per
        zeros = (0,) * (len(metadata.get("shape") or []) - 1)
        for c in np.unique(chunk_of).tolist():
            key = _chunk_key(metadata, (c, *zeros))
            ident, trusted = (None, False) if key is None else file_identity(store / name / key)
            here = chunk_of == c
            if ident is not None and trusted:
                taken[c] = ident
            if ident is None or not trusted or idents.get(c) != ident:
                idents.pop(c, None)
                verified[c * per : (c + 1) * per] = False
                need |= here
            elif not verified[rows[here]].all():
                need |= here
        return rows[need], taken

    def record(
        self,
        name: str,
        rows: np.ndarray,
        taken: dict[int, tuple[int, ...]],
        damage: Sequence[ChunkDamage],
    ) -> None:
        """Remember the chunks holding ``rows`` that a scan found intact (none of ``damage``)."""
        known = self._arrays.get(name)
        if known is None or not taken:
            return
        _, per, idents, verified = known
        bad = {d.chunk[0] for d in damage if d.chunk}
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        chunk_of = rows // per
        for c in np.unique(chunk_of).tolist():
            if c in bad or c not in taken:
                continue
            idents[c] = taken[c]
            verified[rows[chunk_of == c]] = True


def damaged_rows(damage: Sequence[ChunkDamage], n_rows: int) -> list[int]:
    """The sorted leading-axis rows the chunks in ``damage`` hold (metadata damage: all)."""
    rows: set[int] = set()
    for d in damage:
        rows.update(d.rows if d.chunk else range(n_rows))
    return sorted(r for r in rows if 0 <= r < n_rows)


def rows_text(rows: Sequence[int]) -> str:
    """``[3, 4, ...] (12 row(s))``: the first ten rows and how many there are."""
    shown = ", ".join(str(int(r)) for r in rows[:10])
    return f"[{shown}{', ...' if len(rows) > 10 else ''}] ({len(rows)} row(s))"


def _where(d: ChunkDamage) -> str:
    return f"{'its metadata' if not d.chunk else f'chunk {d.chunk}'} ({d.problem}): `{d.file}`"


def damage_message(
    damage: Sequence[ChunkDamage], *, what: str, fix: str, by_rows: bool = False
) -> str:
    """One message naming each damaged array, chunk and file (ten at most), then ``fix``.

    ``by_rows``: one part per array, naming the rows it lost before its chunks,
    as in ``grads: rows [4, 5] (2 row(s)) in chunk (1, 0) (missing): <file>``.
    """
    if not by_rows:
        parts = [f"`{d.array}` {_where(d)}" for d in damage[:10]]
        more = f"; and {len(damage) - 10} more" if len(damage) > 10 else ""
        return f"{what}: " + "; ".join(parts) + more + f". {fix}"
    arrays: dict[str, list[ChunkDamage]] = {}
    for d in damage:
        arrays.setdefault(d.array, []).append(d)
    parts = []
    for name, found in arrays.items():
        lost = sorted({int(r) for d in found for r in d.rows})
        chunks = ", ".join(_where(d) for d in found[:10])
        more = f", and {len(found) - 10} more chunks" if len(found) > 10 else ""
        parts.append(f"`{name}`: rows {rows_text(lost)} in {chunks}{more}")
    return f"{what}: " + "; ".join(parts) + f". {fix}"
