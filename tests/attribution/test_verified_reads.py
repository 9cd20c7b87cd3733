"""Stores verify what they read, once: the raw chunk reader, the raw scan and the verified chunks.

Three fast paths, each compared with the path it replaces on the same files:

- :func:`gradsketch._integrity.read_rows` (what the TRAKer phases read rows
  with) against zarr's own read: bit-identical values, and ``None`` (so that
  the caller reads through zarr, which names the problem as before) for every
  layout it does not handle and every damaged chunk;
- :func:`gradsketch._integrity.scan_array` reading chunk files itself against
  the same scan through zarr: the same :class:`ChunkDamage` list for every
  kind of damage;
- :class:`gradsketch._integrity.VerifiedChunks` (a second ``damage()`` of a
  store skips chunks found intact whose files did not change) against a fresh
  store's scan: the same damage found after every kind of change, and nothing
  read again where nothing changed.

Values are compared exactly (a read copies bytes; no arithmetic), so no
tolerance is needed.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr

import gradsketch._integrity as integrity
import gradsketch._store as store_module
from gradsketch._integrity import read_rows, scan_array
from gradsketch._store import RowStore, array_options
from gradsketch.attribution import TRAKer
from gradsketch.attribution._io import rows_as_tensor
from gradsketch.errors import StoreIntegrityError
from helpers.benchmarks import load_benchmark

faults = load_benchmark("faults")

QUIET: dict[str, Any] = {"device": "cpu", "progress": False, "logging_level": logging.CRITICAL}

#: ``(start, stop)`` windows of a 10-row array in chunks of 4: aligned, straddling,
#: the padded edge chunk, one row, empty, past the end.
WINDOWS = [(0, 10), (0, 4), (2, 7), (8, 10), (5, 6), (3, 3), (6, 40)]


def _array(path: Path, dtype: str, *, compress: bool = False) -> tuple[zarr.Array, np.ndarray]:
    shape = (10, 3, 2)
    arr = zarr.open_group(str(path), mode="a").create_array(
        "x", shape=shape, chunks=(4, 3, 2), dtype=dtype, **array_options(dtype, compress=compress)
    )
    values = (np.arange(60).reshape(shape) - 17).astype(dtype)
    arr[:] = values
    return arr, values


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "uint8", "int64"])
@pytest.mark.parametrize("window", WINDOWS, ids=[f"{a}-{b}" for a, b in WINDOWS])
def test_read_rows_equals_zarr(tmp_path, dtype, window):
    arr, _ = _array(tmp_path, dtype)
    start, stop = window
    got = read_rows(arr, start, stop)
    assert got is not None
    want = np.asarray(arr[start:stop])
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(got, want)
    tensor = rows_as_tensor(arr, start, stop, device=torch.device("cpu"), dtype=torch.float64)
    assert torch.equal(tensor, torch.from_numpy(want.astype(np.float64)))


def test_read_rows_leaves_other_layouts_and_damage_to_zarr(tmp_path):
    """``None`` for compressed arrays and for missing or damaged chunks; zarr then reads
    a missing chunk as NaN and refuses a damaged one with its checksum error."""
    compressed, _ = _array(tmp_path / "z", "float32", compress=True)
    assert read_rows(compressed, 0, 10) is None
    arr, values = _array(tmp_path / "a", "float32")
    assert read_rows(np.asarray(values), 0, 2) is None  # not a zarr array
    chunk = tmp_path / "a" / "x" / "c" / "1" / "0" / "0"
    faults._damage(chunk, "flip")
    assert read_rows(arr, 0, 10) is None
    assert read_rows(arr, 0, 4) is not None  # other chunks still read directly
    with pytest.raises(ValueError, match="checksum"):
        rows_as_tensor(arr, 0, 10, device=torch.device("cpu"), dtype=torch.float32)
    chunk.unlink()
    assert read_rows(arr, 4, 6) is None
    read = rows_as_tensor(arr, 0, 10, device=torch.device("cpu"), dtype=torch.float32)
    assert torch.isnan(read[4:8]).all() and torch.equal(read[:4], torch.from_numpy(values[:4]))


@pytest.mark.parametrize("kind", ["delete", "garble", "truncate", "flip", "empty", "nan"])
def test_raw_scan_finds_what_the_zarr_scan_finds(tmp_path, kind, monkeypatch):
    store = RowStore(tmp_path, {"n": 10})
    store.require_array("x", (10, 3), np.float32, chunk_rows=4)
    store.require_done("x.done", 10, chunk_rows=4)
    rows = [0, 1, 2, 3, 4, 6, 7, 8, 9] if kind == "nan" else list(range(10))
    store.write_rows(np.array(rows), {"x": np.ones((len(rows), 3))}, done="x.done")
    if kind != "nan":
        faults._damage(tmp_path / "x" / "c" / "1" / "0", kind)

    def holes(block: np.ndarray) -> tuple[np.ndarray, str]:
        return np.isnan(block).any(axis=1), "holds NaN"

    raw = scan_array(tmp_path, "x", inspect=holes)
    monkeypatch.setattr(integrity, "_raw_layout", lambda *_: None)
    through_zarr = scan_array(tmp_path, "x", inspect=holes)
    assert raw == through_zarr and len(raw) == 1
    assert [list(d.rows) for d in raw] == [[5] if kind == "nan" else [4, 5, 6, 7]]


def _rowstore(path: Path) -> RowStore:
    store = RowStore(path, {"n": 12})
    store.require_array("x", (12, 3), np.float32, chunk_rows=4)
    store.require_done("x.done", 12, chunk_rows=4)
    return store


def _spy(monkeypatch) -> list[list[int]]:
    """The rows each ``scan_array`` call of the store was asked to check."""
    calls: list[list[int]] = []
    real = store_module.scan_array

    def spy(path, name, *, rows=None, **kw):
        calls.append(sorted(int(r) for r in rows))
        return real(path, name, rows=rows, **kw)

    monkeypatch.setattr(store_module, "scan_array", spy)
    return calls


def test_a_second_check_reads_only_what_changed(tmp_path, monkeypatch):
    """Identities trusted at once (``RACY_NS`` < 0): the second ``damage()`` reads nothing,
    a rewritten chunk and a chunk with a newly flagged row are read again."""
    monkeypatch.setattr(integrity, "RACY_NS", -1)
    calls = _spy(monkeypatch)
    store = _rowstore(tmp_path)
    store.write_rows(np.arange(10), {"x": np.ones((10, 3))}, done="x.done")
    assert store.damage(["x"], "x.done") == []
    assert calls == [list(range(10))]
    assert store.damage(["x"], "x.done") == []
    assert calls[1:] == []
    store.write_rows(np.array([1]), {"x": np.full((1, 3), 2.0)}, done="x.done")
    store.write_rows(np.array([10]), {"x": np.ones((1, 3))}, done="x.done")
    assert store.damage(["x"], "x.done") == []
    assert calls[1:] == [[0, 1, 2, 3, 8, 9, 10]]
    assert store.damage(["x"], "x.done") == []
    assert len(calls) == 2


def test_fresh_files_are_read_at_every_check(tmp_path, monkeypatch):
    """A file changed less than ``RACY_NS`` ago could change again with the same times:
    its chunk is read at every check until it is older."""
    calls = _spy(monkeypatch)
    store = _rowstore(tmp_path)
    store.write_rows(np.arange(12), {"x": np.ones((12, 3))}, done="x.done")
    for _ in range(2):
        assert store.damage(["x"], "x.done") == []
    assert calls == [list(range(12))] * 2


@pytest.mark.parametrize("kind", ["delete", "garble", "truncate", "flip", "empty", "unwritten"])
def test_damage_after_a_check_is_found_as_by_a_fresh_store(tmp_path, monkeypatch, kind):
    monkeypatch.setattr(integrity, "RACY_NS", -1)
    store = _rowstore(tmp_path)
    store.write_rows(np.arange(10), {"x": np.ones((10, 3))}, done="x.done")
    assert store.damage(["x"], "x.done") == []
    # Past the file system's clock tick, as RACY_NS guarantees outside this test.
    time.sleep(0.05)
    if kind == "unwritten":
        store.write_rows(np.array([10]), {}, done="x.done")  # no data arrays: nothing written
        store._array("x.done")[10] = 1
    else:
        faults._damage(tmp_path / "x" / "c" / "1" / "0", kind)
    fresh = _rowstore(tmp_path).damage(["x"], "x.done")
    assert fresh and store.damage(["x"], "x.done") == fresh


@pytest.fixture
def pipeline(tmp_path, monkeypatch):
    """A featurized, finalized TRAKer over 24 rows, its chunks trusted at once."""
    monkeypatch.setattr(integrity, "RACY_NS", -1)
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(8, 3, bias=False)
    x, y = torch.randn(24, 8, generator=gen), torch.randint(0, 3, (24,), generator=gen)
    traker = TRAKer(model, "image_classification", 24, save_dir=tmp_path, proj_dim=16, **QUIET)
    traker.load_checkpoint(model.state_dict(), model_id=0)
    traker.featurize((x, y), num_samples=24)
    traker.finalize_features()
    return traker, model, (x[:5], y[:5])


def _score(traker, model, batch, name: str) -> np.ndarray:
    traker.start_scoring_checkpoint(name, model.state_dict(), model_id=0, num_targets=5)
    traker.score(batch, num_samples=5)
    return np.asarray(traker.finalize_scores(name))


def test_traker_phases_read_the_training_rows_once(pipeline, monkeypatch, tmp_path):
    """After finalize_features checked them, scoring two query sets checks only their targets;
    the scores equal those of a fresh TRAKer on the same store, which checks everything."""
    traker, model, batch = pipeline
    calls = _spy(monkeypatch)
    first = _score(traker, model, batch, "first")
    second = _score(traker, model, batch, "second")
    assert [len(c) for c in calls] == [5, 5]  # each experiment's targets, nothing else
    model_b = torch.nn.Linear(8, 3, bias=False)
    model_b.load_state_dict(model.state_dict())
    fresh = TRAKer(model_b, "image_classification", 24, save_dir=tmp_path, proj_dim=16, **QUIET)
    assert np.array_equal(np.asarray(fresh.finalize_scores("first")), first)
    assert np.array_equal(first, second)


@pytest.mark.parametrize("kind", ["flip", "delete"])
def test_traker_refuses_rows_damaged_after_a_check(pipeline, kind):
    """Damage after finalize_features checked the rows is refused at scoring with the
    message and unflagging of a first check."""
    traker, model, batch = pipeline
    _score(traker, model, batch, "first")
    time.sleep(0.05)
    chunks = (traker.save_dir / "checkpoints" / "0" / "grads" / "c").rglob("*")
    faults._damage(min(p for p in chunks if p.is_file()), kind)
    match = (
        r"model id 0: stored rows are missing or damaged .*`checkpoints/0/grads`: rows "
        r"\[0, 1, .*They were unflagged: call load_checkpoint"
    )
    with pytest.raises(StoreIntegrityError, match=match):
        _score(traker, model, batch, "second")
    assert not traker.records.store.done_rows("checkpoints/0/done")[0]
