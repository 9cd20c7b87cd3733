"""Store integrity, one writer at a time, finite-or-named inputs: the fast fault cases.

Every case either recovers bit-identically to an uninterrupted run or fails
with an error naming the problem and the fix. The whole table (kills, two
processes, tmpfs, every damage kind on both models) runs in
``benchmarks/faults.py``; the slow test below runs it all.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from gradsketch._settings import SettingsMismatchError, StoreIntegrityError
from gradsketch._store import RowStore, WriteLock
from gradsketch.attribution import BatchFormatError, NonFiniteFeaturesError, TRAKer
from gradsketch.attribution._linalg import damped_inverse
from helpers.benchmarks import load_benchmark

faults = load_benchmark("faults")

QUIET = {"device": "cpu", "progress": False, "logging_level": logging.CRITICAL}


def _store(path: Path, chunk: int = 4) -> RowStore:
    store = RowStore(path, {"n": 12})
    store.require_array("x", (12, 3), np.float32, chunk_rows=chunk)
    store.require_done("x.done", 12, chunk_rows=chunk)
    return store


def test_arrays_carry_a_checksum_and_a_fill_that_cannot_pass_for_data(tmp_path):
    store = _store(tmp_path)
    store.require_array("n", (12,), np.int64)
    meta = json.loads((tmp_path / "x" / "zarr.json").read_text())
    assert [c["name"] for c in meta["codecs"]] == ["bytes", "crc32c"]
    assert meta["fill_value"] == "NaN"
    assert np.isnan(store.array("x")[:]).all()
    assert json.loads((tmp_path / "n" / "zarr.json").read_text())["fill_value"] == 0


@pytest.mark.parametrize("kind", ["delete", "garble", "truncate", "flip", "empty"])
def test_damaged_chunks_are_found_and_unflagged(tmp_path, kind):
    store = _store(tmp_path)
    values = np.arange(36, dtype=np.float32).reshape(12, 3)
    store.write_rows(slice(0, 12), {"x": values}, done="x.done")
    faults._damage(tmp_path / "x" / "c" / "1" / "0", kind)
    found = store.damaged_rows(["x"], "x.done")
    assert list(found) == ["x"] and found["x"].tolist() == [4, 5, 6, 7]
    store.unflag("x.done", found["x"])
    assert store.done_rows("x.done").nonzero()[0].tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    # Rows not flagged done are never reported.
    assert store.damaged_rows(["x"], "x.done") == {}


def test_a_store_written_without_checksums_still_opens_and_is_checked(tmp_path):
    """Stores from before checksums (no crc32c codec, zero fill) open; missing chunks are found."""
    store = _store(tmp_path)
    zarr.open_group(str(tmp_path), mode="a").create_array(
        "old", shape=(12, 3), dtype="float32", chunks=(4, 3), compressors=None, fill_value=0
    )
    store.require_done("old.done", 12, chunk_rows=4)
    store.write_rows(slice(0, 12), {"old": np.ones((12, 3))}, done="old.done")
    reopened = RowStore(tmp_path, {"n": 12})
    assert np.array_equal(reopened.array("old")[:], np.ones((12, 3)))
    (tmp_path / "old" / "c" / "2" / "0").unlink()
    assert reopened.damaged_rows(["old"], "old.done")["old"].tolist() == [8, 9, 10, 11]


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ("zarr.json", r"damaged zarr record `.*zarr\.json`.*Fix: delete"),
        ("x/zarr.json", r"damaged zarr record `.*x/zarr\.json`.*Fix: delete the directory `.*x`"),
    ],
)
def test_damaged_records_are_named_with_the_fix(tmp_path, record, match):
    _store(tmp_path)
    faults._damage(tmp_path / record, "truncate")
    with pytest.raises(StoreIntegrityError, match=match):
        _store(tmp_path)


@pytest.mark.parametrize("damage", ["delete", "truncate", "garble"])
def test_a_lost_settings_record_is_judged_from_the_arrays_fingerprints(tmp_path, damage):
    """Each array records the fingerprint of the settings that made it: a store whose
    settings.json is lost or unreadable is refused under other settings (both shown, the
    damaged record left as it is) and restored under the same ones (arrays kept)."""
    store = RowStore(tmp_path, {"n": 12, "seed": 0})
    store.require_array("x", (12, 3), "float32")
    store.require_done("x.done", 12)
    store.write_rows(slice(0, 12), {"x": np.ones((12, 3))}, done="x.done")
    record = tmp_path / "settings.json"
    if damage == "delete":
        record.unlink()
    else:
        faults._damage(record, damage)
    left = record.read_bytes() if record.exists() else None
    match = (
        r"settings\.json` is (missing|unreadable).*other settings:\n  seed: stored 0, requested 1"
    )
    with pytest.raises(SettingsMismatchError, match=match) as info:
        RowStore(tmp_path, {"n": 12, "seed": 1})
    assert "delete" not in str(info.value)
    assert (record.read_bytes() if record.exists() else None) == left
    reopened = RowStore(tmp_path, {"n": 12, "seed": 0})
    assert json.loads(record.read_text())["seed"] == 0
    assert reopened.done_rows("x.done").all()
    assert np.array_equal(reopened.array("x")[:], np.ones((12, 3)))


def test_a_lost_settings_record_without_its_copy_is_judged_by_fingerprint(tmp_path):
    """Where the root group's copy of the record is gone too, the refusal shows the
    fingerprints: the arrays' and the requested settings'."""
    store = RowStore(tmp_path, {"n": 12, "seed": 0})
    store.require_array("x", (12, 3), "float32")
    root = zarr.open_group(str(tmp_path), mode="a")
    del root.attrs["settings"]
    (tmp_path / "settings.json").unlink()
    match = r"other settings:\n  settings fingerprint: stored \['[0-9a-f]+'\], requested"
    with pytest.raises(SettingsMismatchError, match=match):
        RowStore(tmp_path, {"n": 12, "seed": 1})


def test_a_lost_settings_record_over_arrays_without_fingerprints_is_refused(tmp_path):
    """Arrays written before arrays recorded their settings cannot vouch for a lost record."""
    RowStore(tmp_path, {"n": 12})
    zarr.open_group(str(tmp_path), mode="a").create_array(
        "old", shape=(12, 3), dtype="float32", chunks=(4, 3)
    )
    (tmp_path / "settings.json").unlink()
    with pytest.raises(
        StoreIntegrityError, match=r"arrays \['old'\] record no settings fingerprint"
    ):
        RowStore(tmp_path, {"n": 12})
    assert not (tmp_path / "settings.json").exists()


def test_a_file_as_store_path_is_refused(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(NotADirectoryError, match=r"`.*f` is a file, not a directory"):
        RowStore(tmp_path / "f", {"n": 1})


def test_a_writer_waits_for_another_process_holding_the_lock(tmp_path):
    store = _store(tmp_path)
    code = (
        "import filelock, sys, time\n"
        "with filelock.FileLock(sys.argv[1]):\n"
        "    print('held', flush=True); time.sleep(1.0)\n"
    )
    lock_file = str(tmp_path / ".write.lock")
    with subprocess.Popen(
        [sys.executable, "-c", code, lock_file], stdout=subprocess.PIPE
    ) as holder:
        assert holder.stdout.readline().strip() == b"held"
        start = time.perf_counter()
        store.write_rows(slice(0, 2), {"x": np.ones((2, 3))}, done="x.done")
        waited = time.perf_counter() - start
    assert waited > 0.3, f"the write did not wait for the lock ({waited:.2f} s)"
    assert store.done_rows("x.done")[:2].all()


@pytest.mark.slow  # a fresh interpreter importing torch
def test_background_writes_queued_at_exit_reach_the_disk(tmp_path):
    """Python stops executors (zarr's file I/O) before atexit handlers; the flush runs first."""
    code = (
        "import sys, numpy as np\n"
        "from gradsketch._store import RowStore\n"
        "s = RowStore(sys.argv[1], {'n': 64})\n"
        "s.require_array('x', (64, 50), 'float32', chunk_rows=4)\n"
        "s.require_done('x.done', 64, chunk_rows=4)\n"
        "for r in range(0, 64, 4):\n"
        "    v = {'x': np.ones((4, 50))}\n"
        "    s.write_rows(slice(r, r + 4), v, done='x.done', background=True)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "failed" not in out.stderr, out.stderr
    store = RowStore(tmp_path, {"n": 64})
    assert store.done_rows("x.done").all()
    assert np.array_equal(store.array("x")[:], np.ones((64, 50)))


def test_the_write_lock_is_reentrant_in_a_thread(tmp_path):
    lock = WriteLock(tmp_path / "l")
    with lock.held(), lock.held():
        pass


# -- TRAKer ----------------------------------------------------------------------------------
def _mlp_traker(tmp_path, **kw):
    model, train, targets, task = faults.MODELS["mlp"]()
    return model, train, targets, faults._traker(model, task, tmp_path, kw.pop("method", "trak"))


def test_deleted_rows_after_featurizing_are_refused_at_finalize_then_recomputed(tmp_path):
    ref = faults.reference("mlp", "trak")
    model, train, targets, traker = _mlp_traker(tmp_path)
    faults.featurize(traker, model, train, faults.batches_of(faults.BATCH))
    (tmp_path / "checkpoints" / "0" / "grads" / "c" / "2" / "0").unlink()
    with pytest.raises(
        StoreIntegrityError,
        match=r"model id 0: stored rows are missing.*grads`: rows \[16, 17, .*\(8 row\(s\)\)"
        r".*unflagged: call load_checkpoint",
    ):
        traker.finalize_features()
    # The fix: featurize again (only the unflagged rows are recomputed).
    faults.featurize(traker, model, train, faults.batches_of(faults.BATCH))
    assert np.array_equal(faults.finish(traker, model, targets), ref)


@pytest.mark.parametrize(
    "name",
    [
        "mlp/trak/flip grads (finished)",
        "mlp/trak/garble state (finished)",
        "mlp/ekfac/truncate accumulated.npz",
        "mlp/trak/truncate checkpoint.json",
        # Issue 47 (benchmarks/faults_stores.py): a lost settings record under another
        # projector seed, a refused batch, EK-FAC's factors from two writers' batch order.
        "mlp/trak/truncate settings.json, projector_seed=1",
        "mlp/trak/width",
        "mlp/ekfac/rr2 vs one writer",
        *(
            pytest.param(name, marks=pytest.mark.slow)
            for name in (
                "mlp/trak/truncate targets (finished)",
                "mlp/trak/delete out_to_loss (featurized)",
                "mlp/ekfac/empty rank_one (finished)",
                "mlp/trak/garble done (featurized)",
                "mlp/trak/delete settings.json, projector_seed=1",
                "mlp/trak/label-range",
                "mlp/ekfac/rr1 vs one writer",
                "flip scores chunk",
            )
        ),
    ],
)
def test_fault_cases_recover_bit_identically(name):
    (fn,) = [fn for _, case, fn in faults.cases(quick=True) if case == name]
    assert fn()


def test_nan_input_is_refused_at_the_batch_naming_rows_and_cause(tmp_path):
    model, train, _, traker = _mlp_traker(tmp_path, method="ekfac")
    traker.load_checkpoint(model.state_dict(), model_id=0)
    x = train[0][:8].clone()
    x[5, 2] = float("nan")
    with pytest.raises(
        NonFiniteFeaturesError, match=r"featurize: .* of rows \[5\].*inputs of rows \[5\]"
    ):
        traker.featurize((x, train[1][:8]), inds=np.arange(8))
    assert not traker.store.done_rows("checkpoints/0/done").any()


def test_non_finite_weights_are_refused_naming_the_parameter(tmp_path):
    model, *_, traker = _mlp_traker(tmp_path)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["2.bias"][3] = float("inf")
    with pytest.raises(
        NonFiniteFeaturesError, match=r"model id 0 has NaN or inf weights in \['2\.bias"
    ):
        traker.load_checkpoint(state, model_id=0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_samples": 5}, r"featurize: `num_samples` names 5 row\(s\) but the batch has 8"),
        ({"inds": np.arange(3)}, r"featurize: `inds` names 3 row\(s\) but the batch has 8"),
    ],
)
def test_row_counts_are_checked_at_the_call(tmp_path, kwargs, match):
    model, train, _, traker = _mlp_traker(tmp_path)
    traker.load_checkpoint(model.state_dict(), model_id=0)
    with pytest.raises(ValueError, match=match):
        traker.featurize((train[0][:8], train[1][:8]), **kwargs)


def test_save_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(NotADirectoryError, match=r"`save_dir`=.*f' is a file"):
        TRAKer(torch.nn.Linear(3, 2), "image_classification", 4, save_dir=tmp_path / "f", **QUIET)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ("id", r"`input_ids` of batch rows \[1\] hold token ids outside \[0, 64\).*largest 64"),
        ("label", r"`labels` of batch rows \[0\] hold token ids outside .*largest 99"),
        ("ignored", r"batch rows \[2\] \(1 of 4\) predict no token: every label"),
    ],
)
def test_language_model_batches_are_checked(tmp_path, edit, match):
    model, train, _, task = faults.MODELS["gpt2"]()
    traker = faults._traker(model, task, tmp_path, "trak")
    traker.load_checkpoint(model.state_dict(), model_id=0)
    ids, mask, labels = (t[:4].clone() for t in train)
    if edit == "id":
        ids[1, 3] = faults.VOCAB
    elif edit == "label":
        labels[0, 2] = 99
    else:
        labels[2, 1:] = -100
    with pytest.raises(BatchFormatError, match=match):
        traker.featurize((ids, mask, labels), num_samples=4)


def test_non_finite_gram_is_refused_not_warned_about(tmp_path):
    xtx = torch.eye(3)
    xtx[1, 1] = float("nan")
    with pytest.raises(ValueError, match=r"XᵀX \(or λ=0\.1\) holds NaN or inf.*not finite"):
        damped_inverse(xtx, 0.1)


@pytest.mark.slow
@pytest.mark.parametrize("split", ["rr1", "rr2", "rr16", "by-chunk", "same-job"])
@pytest.mark.parametrize("method", ["trak", "ekfac"])
def test_two_processes_featurizing_one_checkpoint_lose_nothing(method, split):
    """Round-robin by 1, 2, 16 rows, by chunk, or the same job: scores equal one writer's."""
    assert faults.two_writers_case("mlp", method, split)()


@pytest.mark.slow
@pytest.mark.parametrize(("every", "chunk"), [(1, 4), (2, 8), (16, 4), (7, 5)])
def test_two_rowstore_writers_on_interleaved_rows_lose_nothing(every, chunk):
    assert faults.rowstore_case(every, chunk)()


@pytest.mark.slow
@pytest.mark.parametrize(("method", "seed"), [("trak", 0), ("ekfac", 1)])
def test_a_run_killed_at_a_random_moment_resumes_bit_identically(method, seed):
    assert faults.kill_case("mlp", method, seed)()


@pytest.mark.slow
def test_every_in_process_fault_case_passes():
    """The runner's in-process table (minutes): every damage kind on both models, bad inputs."""
    table = faults.run_cases(faults.cases(quick=True), verbose=False)
    assert sum(row[0] for row in table.values()) >= 150
    assert all(row[2] == 0 for row in table.values()), table
