"""The shared zarr row store and settings records."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest

from gradsketch._settings import (
    SettingsMismatchError,
    read_record,
    settings_diff,
    settings_from_record,
    settings_record,
)
from gradsketch._store import RowStore, _merge_jobs


@dataclass
class _S:
    proj_dim: int = 4
    name: str = "a"


def test_settings_round_trip_and_versions():
    rec = settings_record(_S(8, "b"))
    assert rec["versions"]["numpy"] == np.__version__
    assert settings_from_record(_S, rec) == _S(8, "b")
    with pytest.raises(SettingsMismatchError, match=r"fields \['extra'\].*allowed fields"):
        settings_from_record(_S, {**rec, "extra": 1})
    with pytest.raises(TypeError, match="`settings` must be a dataclass"):
        settings_record(3)


def test_diff_ignores_versions_and_shows_both_values():
    a = {"proj_dim": 4, "versions": {"torch": "1"}}
    b = {"proj_dim": 8, "versions": {"torch": "2"}, "new": 1}
    assert settings_diff(a, b) == [
        "new: stored '<missing>', requested 1",
        "proj_dim: stored 4, requested 8",
    ]


def test_reopen_refuses_other_settings(tmp_path):
    RowStore(tmp_path, _S())
    assert read_record(tmp_path / "settings.json")["proj_dim"] == 4
    RowStore(tmp_path, _S())  # same settings: fine
    with pytest.raises(SettingsMismatchError, match="name: stored 'a', requested 'b'"):
        RowStore(tmp_path, _S(name="b"))


def test_write_rows_data_then_flags(tmp_path):
    store = RowStore(tmp_path, _S())
    store.require_array("g", (10, 3), np.float32, chunk_rows=4)
    store.require_array("q", (10, 1), np.float32, chunk_rows=4)
    store.require_done("g.done", 10, chunk_rows=4)
    store.write_rows(
        np.array([7, 2, 5]),
        {"g": np.arange(9.0).reshape(3, 3), "q": np.ones((3, 1))},
        done="g.done",
    )
    store.write_rows(slice(0, 2), {"g": np.full((2, 3), 9.0), "q": np.ones((2, 1))}, done="g.done")
    np.testing.assert_array_equal(store.done_rows("g.done"), [1, 1, 1, 0, 0, 1, 0, 1, 0, 0])
    g = store.array("g")[:]
    np.testing.assert_array_equal(g[7], [0, 1, 2])
    np.testing.assert_array_equal(g[2], [3, 4, 5])
    np.testing.assert_array_equal(g[0], [9, 9, 9])


def test_store_errors(tmp_path):
    store = RowStore(tmp_path, _S())
    store.require_array("g", (10, 3), np.float32)
    with pytest.raises(SettingsMismatchError, match=r"shape \(10, 3\).*shape \(10, 4\)"):
        store.require_array("g", (10, 4), np.float32)
    with pytest.raises(KeyError, match="is not in the store"):
        store.array("missing")
    with pytest.raises(IndexError, match=r"`rows` must lie in \[0, 10\)"):
        store.write_rows(np.array([11]), {"g": np.zeros((1, 3))})
    store.delete("g")
    assert not store.has("g")


def test_background_writes_equal_synchronous_writes(tmp_path):
    """Write-behind: same bytes on disk as synchronous writes, once flushed."""
    rng = np.random.default_rng(0)
    batches = [(np.array(rng.permutation(40)[:7]), rng.normal(size=(7, 3))) for _ in range(5)]
    stores = {}
    for mode in ("sync", "background"):
        store = RowStore(tmp_path / mode, {"k": 3})
        store.require_array("x", (40, 3), np.float64, chunk_rows=4)
        store.require_done("x.done", 40, chunk_rows=4)
        for rows, values in batches:
            buffer = values.copy()
            store.write_rows(rows, {"x": buffer}, done="x.done", background=mode == "background")
            buffer[:] = np.nan  # the caller may reuse its buffer at once
        stores[mode] = store
    for name in ("x", "x.done"):  # reads flush first
        expected = stores["sync"].array(name)[:]
        np.testing.assert_array_equal(stores["background"].array(name)[:], expected)
    # close() stops the writer thread (it is named after the store).
    thread_name = f"gradsketch-store-{id(stores['background']):x}"
    assert any(t.name == thread_name for t in threading.enumerate())
    stores["background"].close()
    assert not any(t.name == thread_name for t in threading.enumerate())


def test_failed_background_write_raises_at_flush_and_flags_nothing(tmp_path):
    store = RowStore(tmp_path, {"k": 3})
    store.require_array("x", (8, 3), np.float64, chunk_rows=4)
    store.require_done("x.done", 8, chunk_rows=4)
    store.write_rows(np.array([0, 1]), {"x": np.ones((2, 3))}, done="x.done", background=True)
    # Wrong row width: refused inside the writer thread.
    store.write_rows(np.array([4, 5]), {"x": np.ones((2, 5))}, done="x.done", background=True)
    with pytest.raises(RuntimeError, match=r"background write .* failed") as info:
        store.flush()
    assert info.value.__cause__ is not None
    assert store.done_rows("x.done").nonzero()[0].tolist() == [0, 1]
    store.flush()  # reported once
    with pytest.raises(ValueError, match=r"`data\['x'\]` has shape \(2, 5\)"):
        store.write_rows(np.array([4, 5]), {"x": np.ones((2, 5))})


def test_merge_jobs_rules():
    """Queued writes merge only into a write equal to doing them in turn."""
    a = (slice(0, 2), {"x": np.ones((2, 3))}, "x.done")
    b = (slice(2, 5), {"x": np.zeros((3, 3))}, "x.done")
    rows, data, done = _merge_jobs(a, b)
    assert rows == slice(0, 5) and done == "x.done"
    np.testing.assert_array_equal(data["x"], np.r_[np.ones((2, 3)), np.zeros((3, 3))])
    rows, _, _ = _merge_jobs(a, (np.array([7, 5]), {"x": np.zeros((2, 3))}, "x.done"))
    assert rows.tolist() == [0, 1, 7, 5]
    shared_row = (np.array([1, 4]), {"x": np.zeros((2, 3))}, "x.done")
    assert _merge_jobs(a, shared_row) is None  # the later write must win on row 1
    assert _merge_jobs(a, (slice(2, 4), {"x": np.zeros((2, 5))}, "x.done")) is None
    assert _merge_jobs(a, (slice(2, 4), {"x": np.zeros((2, 3))}, None)) is None
    assert _merge_jobs(a, (slice(2, 4), {"y": np.zeros((2, 3))}, "x.done")) is None
    assert _merge_jobs(a, (slice(2, 4), {"x": np.zeros((3, 3))}, "x.done")) is None
    assert _merge_jobs(a, (slice(2, None), {"x": np.zeros((3, 3))}, "x.done")) is None


def test_queued_background_writes_merge(tmp_path, monkeypatch):
    """Batches queued while the writer is busy go to disk in fewer zarr writes, same bytes."""
    store = RowStore(tmp_path, {"k": 3})
    store.require_array("x", (64, 3), np.float32, chunk_rows=8)
    store.require_done("x.done", 64, chunk_rows=8)
    gate, calls = threading.Event(), []
    write = RowStore.write_rows

    def slow_write(self, rows, data, **kwargs):
        if not kwargs.get("background"):
            calls.append(rows)
            gate.wait(10)
        return write(self, rows, data, **kwargs)

    monkeypatch.setattr(RowStore, "write_rows", slow_write)
    expected = np.arange(64 * 3, dtype=np.float32).reshape(64, 3)
    order = [slice(0, 5), slice(5, 16), np.array([20, 16]), np.array([17, 18, 19, 21])]
    for i, rows in enumerate(order):
        store.write_rows(rows, {"x": expected[rows]}, done="x.done", background=True)
        while i == 0 and not calls:  # the writer holds the first job; the rest queue up
            time.sleep(0.001)
    gate.set()
    store.flush()
    # The first job was taken before the rest were queued; the other three merged.
    assert len(calls) == 2
    assert store.done_rows("x.done").nonzero()[0].tolist() == list(range(22))
    np.testing.assert_array_equal(store.array("x")[:22], expected[:22])
    store.close()
