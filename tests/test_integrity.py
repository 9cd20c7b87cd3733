"""``gradsketch._integrity``: damage in a zarr store named by array, chunk, file and fix."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import zarr

from gradsketch._integrity import damage_message, damaged_rows, holds_data, read_json, scan_array
from gradsketch._store import array_options


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """Four rows of one chunk each (two columns of chunks), Blosc and crc32c as slt's."""
    root = tmp_path / "s.zarr"
    group = zarr.open_group(str(root), mode="w")
    arr = group.create_array(
        "x", shape=(4, 6), chunks=(1, 3), dtype="f4", **array_options("f4", compress=True)
    )
    arr[:] = np.arange(24, dtype=np.float32).reshape(4, 6)
    return root


def _flip(file: Path) -> None:
    raw = bytearray(file.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    file.write_bytes(bytes(raw))


def test_an_intact_array_has_no_damage(store: Path) -> None:
    assert scan_array(store, "x") == []


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda f: f.unlink(), "missing"),
        (_flip, "checksum mismatch"),
        (lambda f: f.write_bytes(f.read_bytes()[:7]), "checksum mismatch"),
    ],
    ids=["missing", "bit-flipped", "truncated"],
)
def test_each_damaged_chunk_is_named_with_its_rows(
    store: Path, damage: Callable[[Path], object], problem: str
) -> None:
    file = store / "x" / "c" / "2" / "1"
    damage(file)
    (found,) = scan_array(store, "x")
    assert (found.array, found.chunk, found.file, found.problem) == ("x", (2, 1), file, problem)
    assert damaged_rows([found], 4) == [2]
    text = damage_message([found], what="the store", fix="Rerun it.")
    assert f"`x` chunk (2, 1) ({problem}): `{file}`. Rerun it." in text


def test_only_the_chosen_rows_are_checked(store: Path) -> None:
    (store / "x" / "c" / "3" / "0").unlink()
    assert scan_array(store, "x", rows=[0, 1, 2]) == []
    assert damaged_rows(scan_array(store, "x", rows=[3]), 4) == [3]


def test_a_truncated_zarr_json_is_named_and_covers_every_row(store: Path) -> None:
    meta = store / "x" / "zarr.json"
    meta.write_text(meta.read_text()[:40])
    (found,) = scan_array(store, "x")
    assert found.chunk == () and found.file == meta and "unreadable" in found.problem
    assert damaged_rows([found], 4) == [0, 1, 2, 3]
    assert read_json(meta)[0] is None and read_json(store / "nothing.json")[1] == "missing"


def test_holds_data_tells_chunks_from_metadata(tmp_path: Path, store: Path) -> None:
    assert holds_data(store)
    empty = tmp_path / "empty.zarr"
    (empty / "a").mkdir(parents=True)
    (empty / "zarr.json").write_text("{")
    (empty / "a" / "zarr.json.1.partial").write_text("{")
    assert not holds_data(empty)
