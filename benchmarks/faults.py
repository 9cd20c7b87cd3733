"""Fault injection on the attribution and row stores: nothing lost, nothing silently wrong.

Each case damages a run the way a careful user might meet it and passes when
the outcome is either **bit-identical** to an uninterrupted run (after the
recovery the error message names, if any) or a **clear error** that names the
problem. Classes:

* ``kill``: SIGKILL at a random moment of a TRAK or EK-FAC run (featurize,
  finalize, score) on the digits MLP and a 2-layer GPT-2, then a rerun.
* ``two-writers``: two processes featurize one checkpoint on every split
  (round-robin by 1, 2, 16 rows, by chunk, the same job twice), and two
  ``RowStore`` writers on interleaved rows; scores equal a one-writer run.
* ``disk-full``: a run on a small tmpfs (where the OS lets us mount one)
  fails with a clear error; the rerun with room is bit-identical.
* ``corrupt``: a deleted, garbled, truncated, bit-flipped or emptied chunk of
  every stored array, before and after finalize; damaged ``.npz`` side files
  and JSON records (settings, checkpoint, experiment, zarr metadata).
* ``bad-input``: NaN / inf inputs and weights, ``num_samples`` / ``inds``
  that miscount the batch, token ids out of the vocabulary, labels all
  ``-100``, a ``save_dir`` that is a file.

* ``settings-lost``, ``llc-draws``, ``replay``, ``sum-order`` and more
  ``bad-input`` (``benchmarks/faults_stores.py``): a lost settings record
  under other settings, the recorded LLC draws and the replay's scores
  damaged, inputs of the wrong width, dtype or label range, and EK-FAC's
  factors summed by two writers against the bound in ``docs/stores.md``.

``benchmarks/faults_slt.py`` (the slt stores), when present, adds its
``cases()``. Run ``python benchmarks/faults.py`` (``--quick`` for a subset,
``--only CLASS``); it prints one table of cases tried, passed and failed per
class, and each failure's reason.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
N_TRAIN, N_TARGETS, BATCH, CHUNK = 48, 6, 8, 8
PROJ_DIM = 32
VOCAB, SEQ = 64, 8

#: One case: (class, name, callable returning True on pass or raising with the reason).
Case = tuple[str, str, Callable[[], bool]]


# -- the two models and their data -------------------------------------------------------
def _digits_mlp() -> tuple[Any, Any, Any, str]:
    import torch
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10)
    ).eval()
    n = N_TRAIN + N_TARGETS
    xs = torch.tensor(x[:n] / 16.0, dtype=torch.float32)
    ys = torch.tensor(y[:n], dtype=torch.long)
    return model, (xs[:N_TRAIN], ys[:N_TRAIN]), (xs[N_TRAIN:], ys[N_TRAIN:]), "image_classification"


def _gpt2() -> tuple[Any, Any, Any, str]:
    import torch
    import transformers

    cfg = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=16,
        n_layer=2,
        n_head=2,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (N_TRAIN + N_TARGETS, SEQ), generator=gen)
    mask = torch.ones_like(ids)
    return (
        model,
        (ids[:N_TRAIN], mask[:N_TRAIN], ids[:N_TRAIN]),
        (ids[N_TRAIN:], mask[N_TRAIN:], ids[N_TRAIN:]),
        "language_modeling",
    )


MODELS = {"mlp": _digits_mlp, "gpt2": _gpt2}


def _traker(model: Any, task: str, save_dir: Path, method: str) -> Any:
    from gradsketch.attribution import HookGradientComputer, TRAKer

    kwargs: dict[str, Any] = {}
    if method == "trak":
        kwargs["gradient_computer"] = HookGradientComputer
        kwargs["proj_dim"] = PROJ_DIM
    return TRAKer(
        model,
        task,
        N_TRAIN,
        save_dir=save_dir,
        device="cpu",
        progress=False,
        logging_level=logging.CRITICAL,
        chunk_rows=CHUNK,
        method=method,
        lambda_reg=0.1,
        **kwargs,
    )


def _rows(data: tuple[Any, ...], rows: Any) -> tuple[Any, ...]:
    return tuple(t[rows] for t in data)


def featurize(traker: Any, model: Any, train: Any, batches: list[np.ndarray]) -> None:
    """Load checkpoint 0 and featurize the given row batches (indices into ``train``)."""
    traker.load_checkpoint(model.state_dict(), model_id=0)
    for rows in batches:
        traker.featurize(_rows(train, rows), inds=rows)
    traker.store.flush()


def finish(traker: Any, model: Any, targets: Any) -> np.ndarray:
    """Finalize, score the targets, return the scores."""
    traker.finalize_features()
    traker.start_scoring_checkpoint("exp", model.state_dict(), model_id=0, num_targets=N_TARGETS)
    traker.score(targets, num_samples=N_TARGETS)
    return np.asarray(traker.finalize_scores("exp"))


def batches_of(size: int) -> list[np.ndarray]:
    return [np.arange(i, min(N_TRAIN, i + size)) for i in range(0, N_TRAIN, size)]


def pipeline(save_dir: Path, model_name: str, method: str) -> np.ndarray:
    """The whole run in this process: featurize in batches of BATCH, finalize, score."""
    model, train, targets, task = MODELS[model_name]()
    traker = _traker(model, task, save_dir, method)
    featurize(traker, model, train, batches_of(BATCH))
    return finish(traker, model, targets)


_REFERENCES: dict[tuple[str, str], np.ndarray] = {}


def reference(model_name: str, method: str) -> np.ndarray:
    """Scores of an uninterrupted run (cached per model and method)."""
    key = (model_name, method)
    if key not in _REFERENCES:
        with tempfile.TemporaryDirectory() as d:
            _REFERENCES[key] = pipeline(Path(d) / "store", model_name, method)
    return _REFERENCES[key]


def _same(scores: np.ndarray, ref: np.ndarray, what: str) -> bool:
    if scores.shape != ref.shape or not np.array_equal(scores, ref):
        diff = np.nanmax(np.abs(scores - ref)) if scores.shape == ref.shape else "shape"
        raise AssertionError(
            f"{what}: scores differ from the uninterrupted run (max |diff| {diff})"
        )
    return True


# -- workers (subprocesses) --------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    """``--worker``: featurize some batches (and optionally finish) in a fresh process."""
    import torch

    torch.set_num_threads(1)
    model, train, targets, task = MODELS[args.model]()
    traker = _traker(model, task, Path(args.save_dir), args.method)
    batches = [np.array(b, dtype=np.int64) for b in json.loads(args.batches)]
    print("ready", flush=True)
    start = time.perf_counter()
    traker.load_checkpoint(model.state_dict(), model_id=0)
    print("loaded", flush=True)
    while args.go and not Path(args.go).exists():
        time.sleep(0.001)
    for rows in batches:
        traker.featurize(_rows(train, rows), inds=rows)
    traker.store.flush()
    traker._save_accumulated()
    if args.finish:
        np.save(args.out, finish(traker, model, targets))
    print(f"done {time.perf_counter() - start:.3f}", flush=True)


def _spawn(save_dir: Path, model: str, method: str, batches: list[np.ndarray], **kw: Any) -> Any:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "--save-dir",
        str(save_dir),
        "--model",
        model,
        "--method",
        method,
        "--batches",
        json.dumps([b.tolist() for b in batches]),
    ]
    if kw.get("out"):
        cmd += ["--finish", "--out", str(kw["out"])]
    if kw.get("go"):
        cmd += ["--go", str(kw["go"])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=kw.get("preexec"),
    )


def _wait_line(proc: Any, prefix: str, timeout: float = 300) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith(prefix):
            return line.strip()
    proc.kill()
    raise AssertionError(f"worker never printed {prefix!r}: {proc.stderr.read()[-2000:]}")


def _run(proc: Any) -> str:
    out, err = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise AssertionError(f"worker failed ({proc.returncode}): {err[-3000:]}")
    return out


def kill_case(model: str, method: str, seed: int) -> Callable[[], bool]:
    """SIGKILL a whole run at a random moment, rerun it to the end: bit-identical scores.

    The reference is an uninterrupted run in a fresh process just before (it
    also times the run, to spread the kill moments over all of it).
    """

    def run() -> bool:
        with tempfile.TemporaryDirectory() as d:
            ref_out = Path(d) / "ref.npy"
            probe = _spawn(Path(d) / "ref", model, method, batches_of(BATCH), out=ref_out)
            duration = float(_run(probe).strip().split()[-1])
            store, out = Path(d) / "store", Path(d) / "s.npy"
            proc = _spawn(store, model, method, batches_of(BATCH), out=out)
            _wait_line(proc, "ready")
            time.sleep(random.Random(seed).uniform(0.02, 1.0) * duration)
            proc.send_signal(signal.SIGKILL)
            proc.communicate()
            _run(_spawn(store, model, method, batches_of(BATCH), out=out))
            return _same(np.load(out), np.load(ref_out), f"killed {method} on {model}")

    return run


def _split(kind: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The two writers' batches for a split of the training rows."""
    rows = np.arange(N_TRAIN)
    if kind == "same-job":
        return batches_of(BATCH), batches_of(BATCH)
    if kind == "by-chunk":
        chunks = [rows[i : i + CHUNK] for i in range(0, N_TRAIN, CHUNK)]
        return chunks[0::2], chunks[1::2]
    size = int(kind.removeprefix("rr"))
    groups = [rows[i : i + size] for i in range(0, N_TRAIN, size)]
    return groups[0::2], groups[1::2]


def two_writers_case(model: str, method: str, split: str) -> Callable[[], bool]:
    """Two processes featurize one checkpoint; scores equal one process doing both halves."""

    def run() -> bool:
        first, second = _split(split)
        with tempfile.TemporaryDirectory() as d:
            store = Path(d) / "store"
            go = Path(d) / "go"
            a = _spawn(store, model, method, first, go=go)
            # EK-FAC sums its statistics in featurize order: start the second once
            # the first holds the checkpoint, so the order matches the reference.
            _wait_line(a, "loaded")
            b = _spawn(store, model, method, second, go=go)
            _wait_line(b, "ready")
            go.touch()  # both featurize at once (EK-FAC's second waits for the first)
            _run(a), _run(b)
            m, train, targets, task = MODELS[model]()
            scores = finish(_traker(m, task, store, method), m, targets)
            ref_dir = Path(d) / "ref"
            traker = _traker(m, task, ref_dir, method)
            featurize(traker, m, train, first + (second if split != "same-job" else []))
            ref = finish(traker, m, targets)
        return _same(scores, ref, f"two writers ({split}) on {model} {method}")

    return run


def rowstore_case(every: int, chunk: int) -> Callable[[], bool]:
    """Two ``RowStore`` writers on rows interleaved ``every`` at a time, ``chunk`` rows a chunk."""

    def run() -> bool:
        with tempfile.TemporaryDirectory() as d:
            src, path = str(HERE.parent / "src"), str(Path(d) / "s")
            code = f"""
import pathlib, sys, time, numpy as np
sys.path.insert(0, {src!r})
from gradsketch._store import RowStore
s = RowStore({path!r}, {{'n': 96}})
s.require_array('x', (96, 5), 'float32', chunk_rows={chunk})
s.require_done('x.done', 96, chunk_rows={chunk})
me = int(sys.argv[1])
# Start together, so that the writes overlap (without the lock, rows are lost).
pathlib.Path({d!r}, f"ready{{me}}").touch()
while not all(pathlib.Path({d!r}, f"ready{{i}}").exists() for i in (0, 1)):
    time.sleep(0.001)
for r in [r for r in range(96) if (r // {every}) % 2 == me]:
    values = np.full((1, 5), r + 0.5, 'float32')
    s.write_rows(np.array([r]), {{'x': values}}, done='x.done', background=r % 3 == 0)
s.close()
"""
            procs = [
                subprocess.Popen([sys.executable, "-c", code, str(i)], stderr=subprocess.PIPE)
                for i in (0, 1)
            ]
            for p in procs:
                _, err = p.communicate(timeout=300)
                if p.returncode:
                    raise AssertionError(err.decode()[-2000:])
            from gradsketch._store import RowStore

            s = RowStore(Path(d) / "s", {"n": 96})
            done = s.done_rows("x.done")
            x = np.asarray(s.array("x")[:])
            want = np.arange(96, dtype=np.float32)[:, None] + 0.5
            if not done.all() or not np.array_equal(x, np.broadcast_to(want, x.shape)):
                lost = np.nonzero(~done | (x[:, 0] != want[:, 0]))[0]
                raise AssertionError(f"rows lost: {lost.tolist()}")
        return True

    return run


# -- disk full -----------------------------------------------------------------------------
@contextlib.contextmanager
def _tmpfs(size_kb: int) -> Iterator[Path | None]:
    d = Path(tempfile.mkdtemp())
    ok = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(d)], capture_output=True
        ).returncode
        == 0
    )
    try:
        yield d if ok else None
    finally:
        if ok:
            subprocess.run(["umount", str(d)], capture_output=True)
        shutil.rmtree(d, ignore_errors=True)


def disk_full_case(model: str, method: str, size_kb: int) -> Callable[[], bool]:
    """A run on a full tmpfs fails with a clear error; with room again, it is bit-identical."""

    def run() -> bool:
        ref = reference(model, method)
        with _tmpfs(size_kb) as mnt:
            if mnt is None:
                raise _Skip("cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN)")
            store, out = mnt / "store", Path(tempfile.mkdtemp()) / "s.npy"
            proc = _spawn(store, model, method, batches_of(BATCH), out=out)
            _, err = proc.communicate(timeout=600)
            if proc.returncode == 0:
                raise _Skip(f"{size_kb} KiB was enough for the whole run")
            last = err.strip().splitlines()[-1] if err.strip() else ""
            if "No space left on device" not in err or "Error" not in last:
                raise AssertionError(f"unclear failure on a full disk: {err[-1500:]}")
            subprocess.run(["mount", "-o", "remount,size=64m", str(mnt)], check=True)
            _run(_spawn(store, model, method, batches_of(BATCH), out=out))
            return _same(np.load(out), ref, f"disk full ({size_kb} KiB)")

    return run


class _Skip(Exception):
    """A case that cannot run here (with the reason)."""


# -- corruption ------------------------------------------------------------------------------
def _damage(path: Path, kind: str) -> None:
    data = path.read_bytes()
    if kind == "delete":
        path.unlink()
    elif kind == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "garble":
        rng = np.random.default_rng(0)
        path.write_bytes(rng.integers(0, 256, len(data), dtype=np.uint8).tobytes())
    elif kind == "flip":
        b = bytearray(data)
        b[len(b) // 3] ^= 0x10
        path.write_bytes(bytes(b))
    else:
        raise ValueError(kind)


def _first_chunk(folder: Path) -> Path:
    chunks = sorted(p for p in (folder / "c").rglob("*") if p.is_file())
    return chunks[len(chunks) // 2]


def _recovered(
    run: Callable[[], np.ndarray],
    ref: np.ndarray,
    what: str,
    fix: Callable[[], None] | None = None,
    must_name: str | None = None,
) -> bool:
    """Rerun; on a gradsketch error naming ``must_name``, apply ``fix`` (if any) and rerun."""
    from gradsketch.errors import GradsketchError

    for attempt in range(3):
        try:
            return _same(run(), ref, what)
        except GradsketchError as exc:
            msg = str(exc)
            if must_name is not None and must_name not in msg:
                raise AssertionError(f"{what}: error does not name {must_name!r}: {msg}") from exc
            if "Fix" not in msg and "again" not in msg:
                raise AssertionError(f"{what}: error gives no fix: {msg}") from exc
            if fix is not None and attempt == 0:
                fix()
    raise AssertionError(f"{what}: still failing after following the fix")


#: Per-row arrays of checkpoint 0 by (model, method): EK-FAC keeps an MLP's rows
#: rank-one ([a, g] per layer) and this GPT-2's as each position's [a, g]
#: (token_factors: narrower than its layers' dense gradients).
TRAIN_ARRAYS = {
    ("mlp", "trak"): ("grads", "out_to_loss", "done"),
    ("mlp", "ekfac"): ("rank_one", "out_to_loss", "done"),
    ("gpt2", "trak"): ("grads", "out_to_loss", "done"),
    ("gpt2", "ekfac"): ("token_factors", "out_to_loss", "done"),
}
STATE = {"trak": "xtx", "ekfac": "eigenvalues_0"}
KINDS = ("delete", "garble", "truncate", "flip", "empty")


def corrupt_case(model: str, method: str, target: str, kind: str, when: str) -> Callable[[], bool]:
    """Damage one chunk (``when``: after featurizing, or after the whole run) and rerun."""

    def run() -> bool:
        ref = reference(model, method)
        with tempfile.TemporaryDirectory() as d:
            store = Path(d) / "store"
            m, train, _, task = MODELS[model]()
            if when == "featurized":
                featurize(_traker(m, task, store, method), m, train, batches_of(BATCH))
            else:
                _same(pipeline(store, model, method), ref, "before damage")
            if target == "targets":
                folder = store / "experiments" / "exp" / "0" / "grads"
            elif target == "state":
                folder = store / "checkpoints" / "0" / STATE[method]
            else:
                folder = store / "checkpoints" / "0" / target
            _damage(_first_chunk(folder), kind)
            fix = None
            if target == "done" and kind in ("garble", "truncate", "flip", "empty"):

                def fix() -> None:
                    shutil.rmtree(folder)

            return _recovered(
                lambda: pipeline(store, model, method), ref, f"{kind} {target} ({when})", fix
            )

    return run


def side_file_case(model: str, method: str, which: str, kind: str) -> Callable[[], bool]:
    """Damage a side file or record; rerun (following the fix the error names)."""

    def run() -> bool:
        ref = reference(model, method)
        with tempfile.TemporaryDirectory() as d:
            store = Path(d) / "store"
            m, train, _, task = MODELS[model]()
            if which == "accumulated":
                featurize(_traker(m, task, store, method), m, train, batches_of(BATCH)[:3])
                t = _traker(m, task, store, method)
                t.load_checkpoint(m.state_dict(), model_id=0)
                t._save_accumulated()
                path = store / "checkpoints" / "0" / "accumulated.0.npz"
            else:
                _same(pipeline(store, model, method), ref, "before damage")
                path = (
                    store
                    / {
                        "settings.json": "settings.json",
                        "checkpoint.json": "checkpoints/0/checkpoint.json",
                        "experiment.json": "experiments/exp/experiment.json",
                        "zarr.json": "zarr.json",
                        "array zarr.json": "checkpoints/0/out_to_loss/zarr.json",
                    }[which]
                )
            _damage(path, kind)

            def fix() -> None:
                # What the messages say: delete the damaged record (or the array's directory).
                if which == "array zarr.json":
                    shutil.rmtree(path.parent)
                else:
                    path.unlink(missing_ok=True)

            return _recovered(
                lambda: pipeline(store, model, method),
                ref,
                f"{kind} {which}",
                fix,
                must_name=None if which == "accumulated" else str(path.name),
            )

    return run


# -- bad inputs ------------------------------------------------------------------------------
def bad_input_case(model: str, method: str, what: str) -> Callable[[], bool]:
    """A bad input must be refused at the call that gets it, with a message naming it."""
    patterns = {
        "nan-input": r"rows \[3\].*NaN or inf.*inputs of rows",
        "inf-input": r"rows \[3\].*NaN or inf.*inputs of rows",
        "nan-weight": r"NaN or inf weights in \[.*\(1 of",
        "inf-weight": r"NaN or inf weights in \[.*\(1 of",
        "overflow": r"rows \[3\].*squares overflow.*overflowed",
        "num_samples": r"`num_samples` names 5 row\(s\) but the batch has 8",
        "inds": r"`inds` names 3 row\(s\) but the batch has 8",
        "score-num_samples": r"score: `num_samples` names 2 row\(s\) but the batch has 6",
        "token-id": r"token ids outside \[0, 64\).*largest 64",
        "negative-token": r"token ids outside \[0, 64\).*smallest -1",
        "label-id": r"`labels` of batch rows \[0\].*largest 99",
        "all-ignored": r"rows \[2\].*predict no token",
        "save_dir-file": r"`save_dir`=.* is a file",
        "target-nan": r"score: target features of rows \[1\]",
    }

    def run() -> bool:
        from gradsketch.errors import GradsketchError

        m, train, targets, task = MODELS[model]()
        with tempfile.TemporaryDirectory() as d:
            store = Path(d) / "store"
            batch = _rows(train, np.arange(8))
            if what == "save_dir-file":
                store.write_text("not a directory")
            try:
                t = _traker(m, task, store, method)
                state = m.state_dict()
                if what in ("nan-weight", "inf-weight"):
                    state = {k: v.clone() for k, v in state.items()}
                    name = next(k for k, v in state.items() if v.is_floating_point())
                    state[name].view(-1)[0] = float("nan") if what == "nan-weight" else float("inf")
                t.load_checkpoint(state, model_id=0)
                if what in ("nan-input", "inf-input", "overflow"):
                    x = batch[0].clone()
                    x[3] = {"nan-input": float("nan"), "inf-input": float("inf"), "overflow": 3e38}[
                        what
                    ]
                    batch = (x, *batch[1:])
                if what == "token-id":
                    ids = batch[0].clone()
                    ids[1, 2] = VOCAB
                    batch = (ids, batch[1], batch[2])
                if what == "negative-token":
                    ids = batch[0].clone()
                    ids[1, 2] = -1
                    batch = (ids, batch[1], batch[2])
                if what == "label-id":
                    labels = batch[2].clone()
                    labels[0, 3] = 99
                    batch = (batch[0], batch[1], labels)
                if what == "all-ignored":
                    labels = batch[2].clone()
                    labels[2, 1:] = -100
                    batch = (batch[0], batch[1], labels)
                if what == "num_samples":
                    t.featurize(batch, num_samples=5)
                elif what == "inds":
                    t.featurize(batch, inds=np.arange(3))
                elif what in ("score-num_samples", "target-nan"):
                    featurize(t, m, train, batches_of(BATCH))
                    t.finalize_features()
                    t.start_scoring_checkpoint("exp", m.state_dict(), 0, num_targets=N_TARGETS)
                    tb = targets
                    if what == "target-nan":
                        x = targets[0].clone()
                        x[1] = float("nan")
                        tb = (x, *targets[1:])
                    t.score(tb, num_samples=2 if what == "score-num_samples" else N_TARGETS)
                else:
                    t.featurize(batch, inds=np.arange(8))
            except (GradsketchError, ValueError, NotADirectoryError) as exc:
                if not re.search(patterns[what], str(exc), flags=re.S):
                    raise AssertionError(f"{what}: unclear message: {exc}") from exc
                return True
        raise AssertionError(f"{what}: accepted silently")

    return run


# -- the case list ---------------------------------------------------------------------------
def cases(quick: bool = False) -> list[Case]:
    """Every attribution and row-store case (``quick``: a fast subset, in-process only)."""
    out: list[Case] = []
    for model in ("mlp", "gpt2"):
        for method in ("trak", "ekfac"):
            for target in (*TRAIN_ARRAYS[model, method], "targets", "state"):
                for kind in KINDS:
                    whens = (
                        ("featurized", "finished")
                        if target in TRAIN_ARRAYS[model, method]
                        else ("finished",)
                    )
                    if model == "gpt2" and kind not in ("delete", "flip"):
                        continue
                    for when in whens:
                        out.append(
                            (
                                "corrupt",
                                f"{model}/{method}/{kind} {target} ({when})",
                                corrupt_case(model, method, target, kind, when),
                            )
                        )
        for which in ("accumulated",):
            for kind in ("delete", "truncate", "flip", "garble"):
                if model == "mlp":
                    out.append(
                        (
                            "corrupt",
                            f"{model}/ekfac/{kind} {which}.npz",
                            side_file_case(model, "ekfac", which, kind),
                        )
                    )
        for which in (
            "settings.json",
            "checkpoint.json",
            "experiment.json",
            "zarr.json",
            "array zarr.json",
        ):
            for kind in ("truncate", "garble"):
                if model == "mlp":
                    out.append(
                        (
                            "corrupt",
                            f"{model}/trak/{kind} {which}",
                            side_file_case(model, "trak", which, kind),
                        )
                    )
    mlp_inputs = (
        "nan-input",
        "inf-input",
        "overflow",
        "nan-weight",
        "inf-weight",
        "num_samples",
        "inds",
        "score-num_samples",
        "save_dir-file",
        "target-nan",
    )
    lm_inputs = (
        "token-id",
        "negative-token",
        "label-id",
        "all-ignored",
        "nan-weight",
        "num_samples",
    )
    for method in ("trak", "ekfac"):
        for what in mlp_inputs:
            out.append(("bad-input", f"mlp/{method}/{what}", bad_input_case("mlp", method, what)))
        for what in lm_inputs:
            out.append(("bad-input", f"gpt2/{method}/{what}", bad_input_case("gpt2", method, what)))
    out += _load("faults_stores").cases(sys.modules[__name__])
    if quick:
        return out
    for every, chunk in (
        (1, 4),
        (1, 16),
        (2, 4),
        (2, 8),
        (3, 8),
        (5, 16),
        (16, 4),
        (16, 64),
        (7, 5),
    ):
        out.append(
            (
                "two-writers",
                f"RowStore every {every} row(s), chunks of {chunk}",
                rowstore_case(every, chunk),
            )
        )
    for model in ("mlp", "gpt2"):
        for method in ("trak", "ekfac"):
            splits = (
                ("rr1", "rr2", "rr16", "by-chunk", "same-job")
                if model == "mlp"
                else ("rr2", "by-chunk")
            )
            for split in splits:
                out.append(
                    (
                        "two-writers",
                        f"{model}/{method}/{split}",
                        two_writers_case(model, method, split),
                    )
                )
            for seed in range(5 if model == "mlp" else 3):
                out.append(
                    ("kill", f"{model}/{method}/seed {seed}", kill_case(model, method, seed))
                )
    for size in (64, 160):
        out.append(("disk-full", f"mlp/trak/tmpfs {size} KiB", disk_full_case("mlp", "trak", size)))
    out.append(("disk-full", "mlp/ekfac/tmpfs 96 KiB", disk_full_case("mlp", "ekfac", 96)))
    return out


def _load(name: str) -> Any:
    """``benchmarks/{name}.py`` as a module, once (``None`` when the file is absent)."""
    path = HERE / f"{name}.py"
    if not path.exists():
        return None
    # Loaded from its file: the tests run these cases without benchmarks/ on sys.path.
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = sys.modules.setdefault(name, importlib.util.module_from_spec(spec))
    if not hasattr(module, "cases"):
        spec.loader.exec_module(module)
    return module


def _slt_cases() -> list[Case]:
    faults_slt = _load("faults_slt")
    if faults_slt is None:
        return []
    found = []
    for entry in faults_slt.cases():
        name, fn = entry[-2], entry[-1]
        cls = entry[0] if len(entry) > 2 else "slt"
        found.append((f"slt/{cls}" if not str(cls).startswith("slt") else str(cls), str(name), fn))
    return found


def run_cases(selected: list[Case], verbose: bool = True) -> dict[str, list[int]]:
    """Run the cases; ``{class: [tried, passed, failed, skipped]}``, failures printed."""
    table: dict[str, list[int]] = {}
    for cls, name, fn in selected:
        row = table.setdefault(cls, [0, 0, 0, 0])
        start = time.perf_counter()
        try:
            ok = bool(fn())
            reason = "" if ok else "returned False"
        except _Skip as skip:
            row[3] += 1
            if verbose:
                print(f"  skip  {cls:12s} {name}: {skip}", flush=True)
            continue
        except Exception as exc:  # a failed case: report it, go on
            ok, reason = False, f"{type(exc).__name__}: {exc}"
            if verbose > 1:
                traceback.print_exc()
        row[0] += 1
        row[1 if ok else 2] += 1
        if verbose:
            flag = "ok  " if ok else "FAIL"
            took = time.perf_counter() - start
            print(
                f"  {flag}  {cls:12s} {name} ({took:.1f} s){'' if ok else ': ' + reason[:600]}",
                flush=True,
            )
    return table


def print_table(table: dict[str, list[int]]) -> None:
    print(f"\n{'class':16s} {'tried':>6s} {'passed':>7s} {'failed':>7s} {'skipped':>8s}")
    total = [0, 0, 0, 0]
    for cls, row in table.items():
        print(f"{cls:16s} {row[0]:6d} {row[1]:7d} {row[2]:7d} {row[3]:8d}")
        total = [a + b for a, b in zip(total, row, strict=True)]
    print(f"{'total':16s} {total[0]:6d} {total[1]:7d} {total[2]:7d} {total[3]:8d}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="in-process cases only")
    parser.add_argument("--only", default=None, help="run one class (kill, two-writers, ...)")
    parser.add_argument("--match", default=None, help="run the cases whose name contains this")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--save-dir", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--batches", help=argparse.SUPPRESS)
    parser.add_argument("--finish", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--go", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    import torch

    torch.set_num_threads(1)
    logging.disable(logging.WARNING)
    import warnings

    warnings.simplefilter("ignore")
    selected = cases(args.quick) + ([] if args.quick else _slt_cases())
    if args.only:
        selected = [c for c in selected if c[0] == args.only]
    if args.match:
        selected = [c for c in selected if args.match in c[1]]
    print(f"{len(selected)} fault cases", flush=True)
    table = run_cases(selected)
    print_table(table)
    sys.exit(1 if any(row[2] for row in table.values()) else 0)


if __name__ == "__main__":
    main()
