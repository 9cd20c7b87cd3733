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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zarr

__all__ = [
    "ChunkDamage",
    "damage_message",
    "damaged_rows",
    "holds_data",
    "read_json",
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
    extents = [-(-int(n) // max(1, g)) for n, g in zip(arr.shape, grid)]
    wanted = None if rows is None else {int(r) for r in rows}
    found: list[ChunkDamage] = []
    for coords in itertools.product(*(range(e) for e in extents)):
        region = tuple(
            slice(c * g, min((c + 1) * g, int(n))) for c, g, n in zip(coords, grid, arr.shape)
        )
        held = range(region[0].start, region[0].stop) if region else range(1)
        if wanted is not None and not wanted.intersection(held):
            continue
        key = _chunk_key(metadata, coords)
        file = store / name / Path(*key.split("/")) if key is not None else store / name
        if key is not None and not file.is_file():
            if not missing:
                continue
            found.append(ChunkDamage(name, coords, file, "missing", held))
            continue
        try:
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
