"""Faults of ``gradsketch.slt.sample`` stores: resume, half-created stores, one writer, bad input.

Each case either gives the bits of an uninterrupted run or raises (warns) a
message naming the problem. The slow cases kill real processes; the fast
ones fake the interruption by clearing a complete store's progress flags,
which is what a kill between two writes leaves (data first, flag last).
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr

from gradsketch.sampling._divergence import ChainDivergenceWarning
from gradsketch.slt import (
    NonFiniteLossError,
    OutputPathMismatchError,
    _schema,
    _writing,
    compute_llc,
    llc,
    sample,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("xarray")

VOCAB = 64
KW: dict[str, Any] = dict(
    lr=1e-4,
    n_beta=20.0,
    localization=100.0,
    num_chains=4,
    num_draws=3,
    batch_size=4,
    batches_per_draw=1,
    num_init_loss_batches=2,
)


def tiny_gpt2(dropout: float = 0.1) -> torch.nn.Module:
    """2 layers, width 16, dropout on: every chain's L(w*) depends on its dropout stream."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_embd=16,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=16,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(cfg)


def token_data() -> torch.Tensor:
    return torch.randint(0, VOCAB, (16, 9), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def data() -> torch.Tensor:
    return token_data()


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory, data: torch.Tensor) -> Path:
    path = tmp_path_factory.mktemp("faults") / "whole.zarr"
    sample(tiny_gpt2(), data, {"d": data}, output_path=path, **KW)
    return path


def _values(path: Path) -> dict[str, np.ndarray]:
    root = zarr.open_group(str(path), mode="r")
    return {name: np.asarray(node[...]) for name, node in root.arrays()}


def _assert_same(path: Path, reference: Path) -> None:
    got, want = _values(path), _values(reference)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize(
    ("init", "chains"),
    [(True, [1, 2, 3]), (False, [1, 2, 3]), (True, [3]), (True, [0, 1, 2, 3])],
    ids=["init-and-chains-1-3", "chains-1-3", "chain-3", "all"],
)
def test_resume_after_cleared_flags_is_bit_identical(
    tmp_path: Path,
    data: torch.Tensor,
    whole: Path,
    monkeypatch: pytest.MonkeyPatch,
    init: bool,
    chains: list[int],
) -> None:
    """A kill between chain 0's and the last chain's L(w*) write: the rerun, in a fresh
    process (no L(w*) cached), must not take chains 1.. from their own dropout streams."""
    path = tmp_path / "cut.zarr"
    shutil.copytree(whole, path)
    progress = zarr.open_group(str(path / "progress"), mode="a")
    for flag in ("init_done", "chain_done") if init else ("chain_done",):
        array = progress[flag]
        assert isinstance(array, zarr.Array)
        for chain in chains:
            array[chain] = 0
    zarr.open_group(str(path), mode="a").attrs.update({"completed": 0})
    resumed = sample(tiny_gpt2(), data, {"d": data}, output_path=path, **KW)
    _assert_same(path, whole)
    reference = compute_llc(sample(tiny_gpt2(), data, {"d": data}, output_path=whole, **KW))
    assert float(compute_llc(resumed).llc_mean) == float(reference.llc_mean)


def test_a_half_created_store_is_completed(
    tmp_path: Path, data: torch.Tensor, whole: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed (or out of disk) in the layout, before the settings record: made again."""
    original = _schema.Arrays.create

    def killed(self: Any, name: str, *args: Any) -> None:
        if name == "chain_done":  # the last array, before the settings record
            raise KeyboardInterrupt
        original(self, name, *args)

    path = tmp_path / "half.zarr"
    monkeypatch.setattr(_schema.Arrays, "create", killed)
    with pytest.raises(KeyboardInterrupt):
        sample(tiny_gpt2(), data, {"d": data}, output_path=path, **KW)
    monkeypatch.undo()
    assert _schema.SETTINGS_ATTR not in zarr.open_group(str(path), mode="r").attrs
    sample(tiny_gpt2(), data, {"d": data}, output_path=path, **KW)
    _assert_same(path, whole)


def test_a_store_killed_before_its_first_array_is_made_again(
    tmp_path: Path, data: torch.Tensor, whole: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bare root (no node below it, no chunk) is provably empty: made again, not refused."""

    def killed(self: Any, name: str, *args: Any) -> None:
        raise KeyboardInterrupt

    path = tmp_path / "bare.zarr"
    monkeypatch.setattr(_schema.Arrays, "create", killed)
    with pytest.raises(KeyboardInterrupt):
        sample(tiny_gpt2(), data, {"d": data}, output_path=path, **KW)
    monkeypatch.undo()
    assert [p.name for p in path.iterdir()] == ["zarr.json"]
    sample(tiny_gpt2(), data, {"d": data}, output_path=path, **KW)
    _assert_same(path, whole)


def test_a_store_with_only_a_torn_root_is_completed(
    tmp_path: Path, data: torch.Tensor, whole: Path
) -> None:
    path = tmp_path / "torn.zarr"
    (path / "init_loss").mkdir(parents=True)
    (path / "zarr.json").write_text('{"zarr_format": 3, "node_ty')
    (path / "zarr.json.0f1e.partial").write_text("{")
    sample(tiny_gpt2(), data, {"d": data}, output_path=path, **KW)
    _assert_same(path, whole)


def test_a_foreign_store_is_still_refused(tmp_path: Path, data: torch.Tensor) -> None:
    path = tmp_path / "foreign.zarr"
    zarr.open_group(str(path), mode="a").create_array("weights", shape=(2,), dtype="f4")
    with pytest.raises(OutputPathMismatchError, match=r"holds no samples"):
        sample(tiny_gpt2(), data, {"d": data}, output_path=path, **KW)
    assert (path / "weights").is_dir()


def test_a_second_writer_waits_for_the_first(
    tmp_path: Path, data: torch.Tensor, whole: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The lock is held by someone else: sample() waits (saying so), then writes all."""
    from filelock import FileLock

    path = tmp_path / "locked.zarr"
    held = FileLock(str(_writing.lock_path(path)))
    held.acquire()
    done = threading.Event()

    def run() -> None:
        sample(tiny_gpt2(), data, {"d": data}, output_path=path, **KW)
        done.set()

    with caplog.at_level(logging.WARNING, logger="gradsketch.slt._sample"):
        thread = threading.Thread(target=run)
        thread.start()
        deadline = time.monotonic() + 30
        while "waiting for it to finish" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "another process is writing" in caplog.text
        assert not done.is_set() and not path.exists()
        held.release()
        thread.join(timeout=120)
    assert done.is_set()
    _assert_same(path, whole)


def test_an_output_path_that_is_a_file_is_refused(tmp_path: Path, data: torch.Tensor) -> None:
    path = tmp_path / "file.zarr"
    path.write_text("not a store")
    with pytest.raises(NotADirectoryError, match=r"`output_path`=.*file.zarr.* is a file"):
        sample(tiny_gpt2(), data, {"d": data}, output_path=path, **KW)


@pytest.mark.parametrize("where", ["dataset", "observable", "negative"])
def test_token_ids_outside_the_vocabulary_are_refused(
    tmp_path: Path, data: torch.Tensor, where: str
) -> None:
    bad = data.clone()
    bad[5, 2] = VOCAB + 3 if where != "negative" else -1
    train, probe = (data, bad) if where == "observable" else (bad, data)
    name = "observables\\['d'\\]" if where == "observable" else "dataset"
    value = VOCAB + 3 if where != "negative" else -1
    with pytest.raises(
        ValueError, match=rf"`{name}` holds token id {value} \(row 5\), but the model's vocabulary "
        rf"has {VOCAB} ids \(0..{VOCAB - 1}\); tokenize"
    ):  # fmt: skip
        sample(tiny_gpt2(), train, {"d": probe}, output_path=tmp_path / "s", **KW)
    assert not (tmp_path / "s").exists()


def test_a_non_finite_weight_is_refused_by_name(tmp_path: Path, data: torch.Tensor) -> None:
    model = tiny_gpt2()
    with torch.no_grad():
        model.get_parameter("transformer.h.1.mlp.c_fc.weight")[0, 0] = float("inf")
    with pytest.raises(
        NonFiniteLossError, match=r"parameter 'transformer.h.1.mlp.c_fc.weight' holds 1 NaN"
    ):
        sample(model, data, {"d": data}, output_path=tmp_path / "s", **KW)


def test_a_non_finite_initial_loss_names_the_rows(tmp_path: Path, data: torch.Tensor) -> None:
    from gradsketch.slt import per_token_loss

    def nan_on_row_zero(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        loss = per_token_loss(model, ids)
        hit = (ids == data[0].to(ids.device)).all(dim=1)
        return torch.where(hit[:, None], torch.full_like(loss, float("nan")), loss)

    kw = {**KW, "num_init_loss_batches": 4}  # every row of the data
    with pytest.raises(NonFiniteLossError, match=r"L\(w\*\) is NaN or infinite on 1 sequences "):
        sample(
            tiny_gpt2(),
            data,
            {"d": data},
            output_path=tmp_path / "s",
            loss_fn=nan_on_row_zero,
            **kw,
        )
    with pytest.raises(NonFiniteLossError, match=r"\(rows \[0\]\) before any sampling step"):
        sample(
            tiny_gpt2(),
            data,
            {"d": data},
            output_path=tmp_path / "s",
            loss_fn=nan_on_row_zero,
            **kw,
        )


def test_a_diverging_chain_warns_with_the_step_to_try(tmp_path: Path, data: torch.Tensor) -> None:
    """lr=1e3 blows the loss up (or to NaN): the estimate warns, naming lr/10."""
    kw = {**KW, "lr": 1e3, "num_chains": 1, "num_draws": 6}
    with pytest.warns((ChainDivergenceWarning, UserWarning)) as record:
        llc(tiny_gpt2(dropout=0.0), data, {"d": data}, output_path=tmp_path / "s", **kw)
    text = "\n".join(str(w.message) for w in record)
    assert "diverged" in text, text
    assert "try `lr`=1e+02" in text or "try lr=1e+02" in text, text


@pytest.mark.slow
def test_two_processes_on_one_store_lose_nothing(tmp_path: Path) -> None:
    """Two identical jobs at once on one path: both end, and the store is the whole run's.

    (That the second waits for the first's lock is shown, without timing, by
    test_a_second_writer_waits_for_the_first.)"""
    draws = 24
    reference = _job(tmp_path / "ref.zarr", draws)
    reference.communicate(timeout=600)
    procs = [_job(tmp_path / "two.zarr", draws) for _ in range(2)]
    logs = [p.communicate(timeout=600)[1] for p in procs]  # waits, and closes the pipes
    assert [p.returncode for p in procs] == [0, 0], logs
    _assert_same(tmp_path / "two.zarr", tmp_path / "ref.zarr")


def _job(path: Path, num_draws: int) -> subprocess.Popen[str]:
    """``sample`` in a fresh one-thread process (no L(w*) cached), printing "ready" first."""
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import torch; torch.set_num_threads(1)\n"
        "from test_faults_slt import KW, tiny_gpt2, token_data\n"
        "from gradsketch.slt import sample\n"
        "print('ready', flush=True)\n"
        f"sample(tiny_gpt2(), token_data(), {{'d': token_data()}}, output_path={str(path)!r}, "
        f"**{{**KW, 'num_draws': {num_draws}}})"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_run_killed_at_a_random_moment_resumes_bit_identical(tmp_path: Path, seed: int) -> None:
    """SIGKILL somewhere between a worker's start of work and its end, then a fresh rerun."""
    draws = 24
    reference = _job(tmp_path / "ref.zarr", draws)
    assert reference.stdout is not None
    reference.stdout.readline()
    start = time.monotonic()
    reference.communicate(timeout=600)  # waits, and closes the pipes
    assert reference.returncode == 0
    span = time.monotonic() - start
    killed = _job(tmp_path / "cut.zarr", draws)
    assert killed.stdout is not None
    killed.stdout.readline()
    time.sleep(np.random.default_rng(seed).uniform(0.05, 0.9) * span)
    assert killed.poll() is None, "the run ended before its kill"
    killed.send_signal(signal.SIGKILL)
    killed.communicate()
    rerun = _job(tmp_path / "cut.zarr", draws)
    _, err = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, err[-2000:]
    _assert_same(tmp_path / "cut.zarr", tmp_path / "ref.zarr")


# ------------------------------------------------ damaged chunks and lost settings (issue 47)
def _damaged_copy(whole: Path, tmp_path: Path, name: str = "damaged.zarr") -> Path:
    path = tmp_path / name
    shutil.copytree(whole, path)
    return path


def _flip_a_bit(file: Path) -> None:
    raw = bytearray(file.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    file.write_bytes(bytes(raw))


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: max(1, file.stat().st_size // 3)])


DAMAGE = {
    "missing": lambda f: f.unlink(),
    "bit-flipped": _flip_a_bit,
    "truncated": _truncate,
}


@pytest.mark.parametrize(
    "damage",
    # One fast case per array in the default suite; the other damages read the same path.
    ["missing", *(pytest.param(d, marks=pytest.mark.slow) for d in ("bit-flipped", "truncated"))],
)
@pytest.mark.parametrize(
    ("array", "chunk"),
    [("init_loss", "c/1/0"), ("sampling_loss_micro", "c/2/0/0/0")],
    ids=["init_loss", "sampling_loss_micro"],
)
def test_a_damaged_chunk_of_a_complete_store_is_recomputed(
    tmp_path: Path,
    data: torch.Tensor,
    whole: Path,
    caplog: pytest.LogCaptureFixture,
    array: str,
    chunk: str,
    damage: str,
) -> None:
    """The same ``llc`` call on a store that lost (or garbled) a chunk: never a NaN LLC. The
    damage is named (array, chunk, file) and the chain is sampled again, bit for bit."""
    path = _damaged_copy(whole, tmp_path)
    file = path / array / chunk
    DAMAGE[damage](file)
    with caplog.at_level(logging.WARNING, logger="gradsketch.slt._sample"):
        got = llc(tiny_gpt2(), data, {"d": data}, output_path=path, **KW)
    assert f"`{array}`" in caplog.text and str(file) in caplog.text
    assert "again" in caplog.text
    _assert_same(path, whole)
    want = compute_llc(sample(tiny_gpt2(), data, {"d": data}, output_path=whole, **KW))
    assert np.isfinite(float(got.llc_mean))
    assert float(got.llc_mean) == float(want.llc_mean)


@pytest.mark.parametrize("array", ["init_loss", "sampling_loss_micro"])
def test_a_damaged_chunk_of_a_resumed_store_is_recomputed(
    tmp_path: Path, data: torch.Tensor, whole: Path, array: str
) -> None:
    """Interrupted after chains 0 and 1, then chain 0's chunk deleted: the resume samples
    chains 0, 2 and 3, and the store is the uninterrupted run's."""
    path = _damaged_copy(whole, tmp_path)
    progress = zarr.open_group(str(path / "progress"), mode="a")
    for flag in ("init_done", "chain_done"):
        progress[flag][2:] = 0  # type: ignore[index]
    zarr.open_group(str(path), mode="a").attrs.update({"completed": 0})
    chunk = "c/0/0" if array == "init_loss" else "c/0/0/0/0"
    (path / array / chunk).unlink()
    got = llc(tiny_gpt2(), data, {"d": data}, output_path=path, **KW)
    _assert_same(path, whole)
    want = compute_llc(sample(tiny_gpt2(), data, {"d": data}, output_path=whole, **KW))
    assert float(got.llc_mean) == float(want.llc_mean)


def test_a_truncated_array_metadata_is_named_with_the_fix(
    tmp_path: Path, data: torch.Tensor, whole: Path
) -> None:
    """A torn ``sampling_loss/zarr.json``: not a bare JSONDecodeError but the array, the file
    and the fix; following the fix gives the uninterrupted store."""
    from gradsketch.errors import StoreIntegrityError

    path = _damaged_copy(whole, tmp_path)
    meta = path / "sampling_loss" / "zarr.json"
    _truncate(meta)
    with pytest.raises(StoreIntegrityError, match=r"`sampling_loss` its metadata") as info:
        llc(tiny_gpt2(), data, {"d": data}, output_path=path, **KW)
    assert str(meta) in str(info.value) and "Delete each named array's directory" in str(info.value)
    shutil.rmtree(path / "sampling_loss")
    sample(tiny_gpt2(), data, {"d": data}, output_path=path, **KW)
    _assert_same(path, whole)


def test_a_store_with_an_unreadable_root_is_judged_by_its_arrays(
    tmp_path: Path, data: torch.Tensor, whole: Path
) -> None:
    """A finished lr=1e-4 store whose root zarr.json is torn, rerun with lr=3e-4: refused with
    both settings, nothing deleted (it was once wiped as "half-created")."""
    path = _damaged_copy(whole, tmp_path)
    _truncate(path / "zarr.json")
    before = sorted(p.relative_to(path) for p in path.rglob("*"))
    with pytest.raises(OutputPathMismatchError, match=r"lr: stored 0\.0001, requested 0\.0003"):
        sample(tiny_gpt2(), data, {"d": data}, output_path=path, **{**KW, "lr": 3e-4})
    assert sorted(p.relative_to(path) for p in path.rglob("*")) == before
    for name, want in _values(whole).items():  # each array read past the torn root
        got = np.asarray(zarr.open_array(str(path / name), mode="r")[...])
        np.testing.assert_array_equal(got, want, err_msg=name)


def test_a_store_with_an_unreadable_root_resumes_with_its_own_settings(
    tmp_path: Path, data: torch.Tensor, whole: Path
) -> None:
    """The same settings as its arrays record: the root is written again, the chains kept."""
    path = _damaged_copy(whole, tmp_path)
    _truncate(path / "zarr.json")
    tree = sample(tiny_gpt2(), data, {"d": data}, output_path=path, **KW)
    _assert_same(path, whole)
    attrs = zarr.open_group(str(path), mode="r").attrs
    assert attrs["completed"] == 1 and _schema.SETTINGS_ATTR in attrs
    assert "loss_d" in tree.dataset


def test_an_old_store_with_an_unreadable_root_is_never_deleted(
    tmp_path: Path, data: torch.Tensor, whole: Path
) -> None:
    """Arrays without settings records (written before they were recorded) and chunks on disk:
    the settings cannot be told, so the call refuses and deletes nothing."""
    path = _damaged_copy(whole, tmp_path)
    for meta in path.rglob("zarr.json"):
        if meta.parent != path:
            record = json.loads(meta.read_text())
            record.get("attributes", {}).pop(_schema.SETTINGS_ATTR, None)
            meta.write_text(json.dumps(record))
    _truncate(path / "zarr.json")
    before = sorted(p.relative_to(path) for p in path.rglob("*"))
    with pytest.raises(OutputPathMismatchError, match=r"nothing was deleted"):
        sample(tiny_gpt2(), data, {"d": data}, output_path=path, **KW)
    assert sorted(p.relative_to(path) for p in path.rglob("*")) == before


def test_compute_llc_refuses_a_damaged_store_it_is_given(tmp_path: Path, whole: Path) -> None:
    """A store opened past ``sample`` (no check ran): a missing ``init_loss`` chunk or a
    bit-flipped ``sampling_loss_micro`` chunk is an error naming the array, not a NaN LLC."""
    from gradsketch.errors import StoreIntegrityError

    missing = _damaged_copy(whole, tmp_path, "missing.zarr")
    (missing / "init_loss" / "c" / "1" / "0").unlink()
    with pytest.raises(StoreIntegrityError, match=r"`init_loss` .* chains \[1\]"):
        compute_llc(_schema.open_tree(missing))
    flipped = _damaged_copy(whole, tmp_path, "flipped.zarr")
    _flip_a_bit(flipped / "sampling_loss_micro" / "c" / "2" / "0" / "0" / "0")
    with pytest.raises(StoreIntegrityError, match=r"`sampling_loss_micro` .* cannot be read"):
        compute_llc(_schema.open_tree(flipped))
