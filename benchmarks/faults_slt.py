"""Fault injection on ``gradsketch.slt`` sample stores, the native library, sampling and the CLI.

Each case damages a run the way a careful user might meet it and passes when
the outcome is either **bit-identical** to an uninterrupted run (every array
of the store, and the LLC) or a **clear error** naming the problem. Classes:

* ``resume``: a complete store with the progress flags of some chains
  cleared (what a kill between two writes leaves), resumed in a process
  that has no L(w*) cached.
* ``kill``: SIGKILL of a worker process at a random moment of ``sample``
  (dropout on, 4 chains), then a rerun in a fresh process.
* ``half-created``: a kill, or a full disk, while the store is being laid
  out (before its first sample), and torn or partial root metadata.
* ``two-writers``: two processes sampling into one store at once, and a
  writer that finds the lock held.
* ``disk-full``: zarr's writes fail with ENOSPC after ``n`` files; the
  error names the problem, and the rerun with room is bit-identical.
* ``native``: a cached native library truncated, emptied, garbled,
  bit-flipped, replaced by another ELF, its record missing or torn, or no
  compiler: a fresh process neither dies nor raises, and says why.
* ``damage``: a chunk of ``init_loss`` or ``sampling_loss_micro`` deleted,
  bit-flipped or truncated in a complete or a resumed store (the same
  ``llc`` call samples the chain again, bit for bit, or the estimate
  refuses naming array, chunk and file), a torn array ``zarr.json`` (named
  with the fix), and a torn root ``zarr.json`` (judged by the arrays' own
  settings records: refused with both settings under other settings, nothing
  deleted; resumed under the same).
* ``bad-input``: token ids outside the vocabulary, NaN / inf weights, a
  NaN initial loss, a diverging chain (slt and ``estimate_learning_coeff``),
  an ``output_path`` that is a file, a foreign store, CLI errors.

``cases()`` yields ``(class, name, callable)``; each callable returns True on
pass, False or raises on failure. ``python benchmarks/faults_slt.py`` runs
them and prints one table (``--quick``: in-process cases only).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve()
VOCAB = 64
#: The sampler settings of every store here (dropout on: L(w*) depends on the chain's stream).
KW: dict[str, Any] = dict(
    lr=1e-4,
    n_beta=20.0,
    localization=100.0,
    num_chains=4,
    num_draws=4,
    batch_size=4,
    batches_per_draw=1,
    num_init_loss_batches=2,
)
#: Longer chains for the kill cases, so that a random moment falls inside sampling.
KILL_KW: dict[str, Any] = {**KW, "num_draws": 24}

Case = tuple[str, str, Callable[[], bool]]


# -- the model, the data, the reference stores --------------------------------------------
def tiny_gpt2(dropout: float = 0.1) -> Any:
    import torch
    import transformers

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


def token_data() -> Any:
    import torch

    return torch.randint(0, VOCAB, (16, 9), generator=torch.Generator().manual_seed(3))


def _sample(path: Path, kw: dict[str, Any] = KW, **extra: Any) -> Any:
    from gradsketch.slt import sample

    data = token_data()
    return sample(tiny_gpt2(), data, {"d": data}, output_path=path, **{**kw, **extra})


def _job(path: Path, kw: dict[str, Any]) -> None:
    """A worker process: one thread, one sample() call (the kill and two-writer cases)."""
    import torch

    torch.set_num_threads(1)
    print("ready", flush=True)
    _sample(path, kw)


def _values(path: Path) -> dict[str, np.ndarray]:
    import zarr

    root = zarr.open_group(str(path), mode="r")
    out = {name: np.asarray(node[...]) for name, node in root.arrays()}
    progress = root["progress"]
    for name, node in progress.arrays():  # type: ignore[union-attr]
        out[f"progress/{name}"] = np.asarray(node[...])
    return out


def _same(path: Path, reference: Path) -> bool:
    got, want = _values(path), _values(reference)
    if sorted(got) != sorted(want):
        raise AssertionError(f"arrays {sorted(got)} != {sorted(want)}")
    for name in want:
        if got[name].shape != want[name].shape or got[name].tobytes() != want[name].tobytes():
            raise AssertionError(f"{name} differs from the uninterrupted run")
    return True


def _llc(path: Path) -> float:
    import xarray as xr

    from gradsketch.slt import compute_llc

    tree = xr.open_datatree(str(path), engine="zarr", consolidated=False)
    return float(compute_llc(tree).llc_mean)


_WORK = Path(tempfile.mkdtemp(prefix="gradsketch-faults-slt-"))
_REFERENCES: dict[str, Path] = {}
#: Seconds from a worker's "ready" to its end (measured on the reference run).
_KILL_SPAN: dict[str, float] = {}


def _reference(kind: str) -> Path:
    """The uninterrupted store: in this process ("local") or a one-thread worker ("worker")."""
    if kind not in _REFERENCES:
        path = _WORK / f"reference-{kind}.zarr"
        if kind == "local":
            _sample(path)
        else:
            proc = _worker(path, KILL_KW)
            assert proc.stdout is not None
            proc.stdout.readline()  # "ready": imports done
            ready = time.perf_counter()
            _, err = proc.communicate(timeout=600)
            if proc.returncode != 0:
                raise AssertionError(f"the reference worker failed: {err[-800:]}")
            # Kills land between a worker's start of work and its end.
            _KILL_SPAN["s"] = max(0.5, time.perf_counter() - ready)
        _REFERENCES[kind] = path
    return _REFERENCES[kind]


def _worker(path: Path, kw: dict[str, Any], env: dict[str, str] | None = None) -> Any:
    return subprocess.Popen(
        [sys.executable, str(HERE), "--job", str(path), "--kw", json.dumps(kw)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


@contextlib.contextmanager
def _fresh_init_losses() -> Iterator[None]:
    """No L(w*) cached: what a rerun in a new process sees (each sample() call has its own
    SamplingCache, so this holds already; kept to mark the cases that rely on it)."""
    yield


# -- resume ---------------------------------------------------------------------------------
def resume_case(chains: list[int], flags: tuple[str, ...]) -> Callable[[], bool]:
    def run() -> bool:
        import zarr

        reference = _reference("local")
        path = _WORK / f"resume-{'-'.join(map(str, chains))}-{len(flags)}.zarr"
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(reference, path)
        progress = zarr.open_group(str(path / "progress"), mode="a")
        for flag in flags:
            for chain in chains:
                progress[flag][chain] = 0  # type: ignore[index]
        zarr.open_group(str(path), mode="a").attrs.update({"completed": 0})
        with _fresh_init_losses():
            _sample(path)
        return _same(path, reference) and _llc(path) == _llc(reference)

    return run


# -- kill -------------------------------------------------------------------------------------
def kill_case(seed: int) -> Callable[[], bool]:
    def run() -> bool:
        reference = _reference("worker")
        path = _WORK / f"kill-{seed}.zarr"
        shutil.rmtree(path, ignore_errors=True)
        proc = _worker(path, KILL_KW)
        assert proc.stdout is not None
        proc.stdout.readline()  # "ready": imports done
        time.sleep(random.Random(seed).uniform(0.0, 0.9 * _KILL_SPAN["s"]))
        finished = proc.poll() is not None
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if finished:
            raise AssertionError("the worker ended before its kill: the case tests nothing")
        rerun = _worker(path, KILL_KW)
        _, err = rerun.communicate(timeout=600)
        if rerun.returncode != 0:
            raise AssertionError(f"the rerun failed: {err[-800:]}")
        return _same(path, reference) and _llc(path) == _llc(reference)

    return run


# -- half-created ---------------------------------------------------------------------------
def half_created_case(arrays_before_kill: int) -> Callable[[], bool]:
    """Killed while creating the ``arrays_before_kill``-th array of the layout."""

    def run() -> bool:
        from gradsketch.slt import _schema

        reference = _reference("local")
        path = _WORK / f"half-{arrays_before_kill}.zarr"
        shutil.rmtree(path, ignore_errors=True)
        original = _schema.Arrays.create
        calls = [0]

        def killed(self: Any, name: str, *args: Any) -> None:
            calls[0] += 1
            if calls[0] == arrays_before_kill:
                raise KeyboardInterrupt
            original(self, name, *args)

        _schema.Arrays.create = killed  # type: ignore[method-assign,assignment]
        try:
            with contextlib.suppress(KeyboardInterrupt):
                _sample(path)
        finally:
            _schema.Arrays.create = original  # type: ignore[method-assign]
        if calls[0] < arrays_before_kill:
            raise AssertionError(f"the layout has only {calls[0]} arrays")
        with _fresh_init_losses():
            _sample(path)
        return _same(path, reference)

    return run


def torn_root_case(content: str | None, partial: bool) -> Callable[[], bool]:
    def run() -> bool:
        reference = _reference("local")
        path = _WORK / f"torn-{content is None}-{len(content or '')}-{partial}.zarr"
        shutil.rmtree(path, ignore_errors=True)
        (path / "sampling_loss").mkdir(parents=True)
        if content is not None:
            (path / "zarr.json").write_text(content)
        if partial:
            (path / "zarr.json.3f2a.partial").write_text('{"zarr_')
        with _fresh_init_losses():
            _sample(path)
        return _same(path, reference)

    return run


# -- damage ---------------------------------------------------------------------------------
def _damage(file: Path, how: str) -> None:
    if how == "missing":
        file.unlink()
    elif how == "bit-flipped":
        raw = bytearray(file.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        file.write_bytes(bytes(raw))
    else:
        file.write_bytes(file.read_bytes()[: max(1, file.stat().st_size // 3)])


def damaged_chunk_case(array: str, how: str, resumed: bool) -> Callable[[], bool]:
    """A damaged chunk of chain 0 (``resumed``: in a store interrupted after chains 0 and 1)."""

    def run() -> bool:
        import zarr

        from gradsketch.slt import llc

        reference = _reference("local")
        path = _WORK / f"damage-{array}-{how}-{resumed}.zarr"
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(reference, path)
        if resumed:
            progress = zarr.open_group(str(path / "progress"), mode="a")
            for flag in ("init_done", "chain_done"):
                progress[flag][2:] = 0  # type: ignore[index]
            zarr.open_group(str(path), mode="a").attrs.update({"completed": 0})
        chunk = "c/0/0" if array == "init_loss" else "c/0/0/0/0"
        _damage(path / array / chunk, how)
        data = token_data()
        got = llc(tiny_gpt2(), data, {"d": data}, output_path=path, **KW)
        return _same(path, reference) and float(got.llc_mean) == _llc(reference)

    return run


def damaged_read_case(array: str, how: str) -> Callable[[], bool]:
    """``compute_llc`` on a store opened past ``sample``: an error naming the array."""

    def run() -> bool:
        from gradsketch.errors import StoreIntegrityError

        path = _WORK / f"read-{array}-{how}.zarr"
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(_reference("local"), path)
        _damage(path / array / ("c/1/0" if array == "init_loss" else "c/1/0/0/0"), how)
        return _raises(lambda: _llc(path), StoreIntegrityError, f"`{array}`", "Fix:")

    return run


def torn_array_metadata_case() -> bool:
    from gradsketch.errors import StoreIntegrityError

    reference = _reference("local")
    path = _WORK / "torn-array-meta.zarr"
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(reference, path)
    meta = path / "sampling_loss" / "zarr.json"
    meta.write_bytes(meta.read_bytes()[:50])
    named = _raises(
        lambda: _sample(path), StoreIntegrityError, "`sampling_loss`", str(meta), "Delete"
    )
    shutil.rmtree(path / "sampling_loss")  # the fix the message gives
    _sample(path)
    return named and _same(path, reference)


def torn_root_of_a_finished_store_case(lr: float) -> Callable[[], bool]:
    def run() -> bool:
        from gradsketch.slt import OutputPathMismatchError

        reference = _reference("local")
        path = _WORK / f"torn-finished-{lr}.zarr"
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(reference, path)
        root = path / "zarr.json"
        root.write_bytes(root.read_bytes()[:40])
        if lr == KW["lr"]:
            _sample(path)
            return _same(path, reference)
        files = sorted(p.relative_to(path) for p in path.rglob("*"))
        refused = _raises(
            lambda: _sample(path, lr=lr),
            OutputPathMismatchError,
            f"lr: stored {KW['lr']}, requested {lr}",
        )
        return refused and sorted(p.relative_to(path) for p in path.rglob("*")) == files

    return run


# -- two writers ----------------------------------------------------------------------------
def two_writers_case(stagger: float) -> Callable[[], bool]:
    def run() -> bool:
        reference = _reference("worker")
        path = _WORK / f"two-{stagger}.zarr"
        shutil.rmtree(path, ignore_errors=True)
        first = _worker(path, KILL_KW)
        time.sleep(stagger)
        second = _worker(path, KILL_KW)
        outs = [p.communicate(timeout=600) for p in (first, second)]
        if [first.returncode, second.returncode] != [0, 0]:
            raise AssertionError(f"a writer failed: {[o[1][-500:] for o in outs]}")
        if not any("another process is writing" in o[1] for o in outs):
            raise AssertionError("neither writer waited for the other's lock")
        return _same(path, reference)

    return run


def held_lock_case() -> bool:
    import threading

    from filelock import FileLock

    from gradsketch.slt import _writing

    reference = _reference("local")
    path = _WORK / "held.zarr"
    shutil.rmtree(path, ignore_errors=True)
    held = FileLock(str(_writing.lock_path(path)))
    held.acquire()
    errors: list[BaseException] = []

    def write() -> None:
        try:
            with _fresh_init_losses():
                _sample(path)
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=write)
    thread.start()
    time.sleep(1.0)
    waited = thread.is_alive() and not path.exists()
    held.release()
    thread.join(timeout=300)
    if errors:
        raise errors[0]
    return waited and _same(path, reference)


# -- disk full ------------------------------------------------------------------------------
def disk_full_case(writes_allowed: int) -> Callable[[], bool]:
    """zarr's file writes fail with ENOSPC after ``writes_allowed`` files."""

    def run() -> bool:
        import zarr.storage._local as local

        reference = _reference("local")
        path = _WORK / f"full-{writes_allowed}.zarr"
        shutil.rmtree(path, ignore_errors=True)
        original = local._put
        count = [0]

        def put(*args: Any, **kwargs: Any) -> Any:
            count[0] += 1
            if count[0] > writes_allowed:
                raise OSError(errno.ENOSPC, "No space left on device (simulated)")
            return original(*args, **kwargs)

        local._put = put
        failed: BaseException | None = None
        try:
            with _fresh_init_losses():
                _sample(path)
        except Exception as exc:  # checked below: it must name the store and the full disk
            failed = exc
        finally:
            local._put = original
        if failed is None:
            raise AssertionError(f"{count[0]} writes, none refused: raise writes_allowed")
        if "No space left" not in str(failed) or str(path) not in str(failed):
            raise AssertionError(f"the error does not name the store and the cause: {failed!r}")
        with _fresh_init_losses():
            _sample(path)
        return _same(path, reference)

    return run


# -- native library -------------------------------------------------------------------------
_NATIVE_CHILD = """
import logging, sys
logging.basicConfig(level=logging.WARNING)
from gradsketch.sketch import _native
status = _native.native_status()
print("STATUS", status.available, status.reason)
"""


def native_case(how: str) -> Callable[[], bool]:
    def run() -> bool:
        from gradsketch import _native_build
        from gradsketch.sketch import _native

        status = _native.native_status()
        if not status.available or status.path is None:
            return how == "no-compiler"  # nothing cached to damage here
        cache = _WORK / f"native-{how}"
        shutil.rmtree(cache, ignore_errors=True)
        (cache / "native").mkdir(parents=True)
        target = cache / "native" / Path(status.path).name
        data = Path(status.path).read_bytes()
        target.write_bytes(data)
        _native_build.sidecar(target).write_text(
            json.dumps(_native_build.record(data, _native.ABI_VERSION))
        )
        env = {"GRADSKETCH_CACHE": str(cache)}
        if how == "truncated":
            target.write_bytes(data[: len(data) // 3])
        elif how == "empty":
            target.write_bytes(b"")
        elif how == "garbled":
            target.write_bytes(data[: len(data) // 2] + bytes(len(data) - len(data) // 2))
        elif how == "bit-flip":
            mid = len(data) // 2
            target.write_bytes(data[:mid] + bytes([data[mid] ^ 1]) + data[mid + 1 :])
        elif how == "other-elf":
            import torch

            target.write_bytes((Path(torch.__file__).parent / "lib" / "libshm.so").read_bytes())
        elif how == "no-record":
            _native_build.sidecar(target).unlink()
        elif how == "torn-record":
            _native_build.sidecar(target).write_text('{"size"')
        elif how == "no-compiler":
            target.unlink()
            env["CC"] = "/nonexistent/cc"
        proc = subprocess.run(
            [sys.executable, "-c", _NATIVE_CHILD],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, **env},
        )
        if proc.returncode != 0:
            raise AssertionError(
                f"the process died (status {proc.returncode}): {proc.stderr[-600:]}"
            )
        if how == "no-compiler":
            return (
                "STATUS False" in proc.stdout
                and "WARNING" in proc.stderr
                and "compiler" in (proc.stderr)
            )
        rebuilt = (
            "failed its check" in proc.stderr
            and _native_build.check_cached(target, _native.ABI_VERSION) is None
        )
        return "STATUS True compiled" in proc.stdout and rebuilt

    return run


# -- bad input ------------------------------------------------------------------------------
def _raises(fn: Callable[[], Any], error: type[BaseException], *needles: str) -> bool:
    try:
        fn()
    except error as exc:
        missing = [n for n in needles if n not in str(exc)]
        if missing:
            raise AssertionError(f"{error.__name__} without {missing}: {exc}") from exc
        return True
    raise AssertionError(f"no {error.__name__} raised")


def _warns(fn: Callable[[], Any], category: type[Warning], *needles: str) -> bool:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    text = "\n".join(str(w.message) for w in caught if issubclass(w.category, category))
    missing = [n for n in needles if n not in text]
    if not text or missing:
        raise AssertionError(f"no {category.__name__} with {missing}: {text!r}")
    return True


def bad_input_cases() -> list[Case]:
    import torch

    from gradsketch.sampling._divergence import ChainDivergenceWarning
    from gradsketch.slt import NonFiniteLossError, OutputPathMismatchError, per_token_loss

    data = token_data()
    out: list[Case] = []

    def tokens(row: int, value: int, where: str) -> Callable[[], bool]:
        def run() -> bool:
            bad = data.clone()
            bad[row, 1] = value
            train, probe = (data, bad) if where == "observable" else (bad, data)
            from gradsketch.slt import sample

            name = "observables['d']" if where == "observable" else "dataset"
            return _raises(
                lambda: sample(
                    tiny_gpt2(), train, {"d": probe}, output_path=_WORK / "tok.zarr", **KW
                ),
                ValueError,
                f"`{name}` holds token id {value} (row {row})",
                f"vocabulary has {VOCAB} ids",
            )

        return run

    out += [("bad-input", f"token id {v} in {w}", tokens(3, v, w)) for v, w in
            [(VOCAB, "dataset"), (VOCAB + 100, "dataset"), (-1, "dataset"),
             (VOCAB, "observable")]]  # fmt: skip

    def weight(value: float, name: str) -> Callable[[], bool]:
        def run() -> bool:
            from gradsketch.slt import sample

            model = tiny_gpt2()
            with torch.no_grad():
                model.get_parameter(name).view(-1)[0] = value
            return _raises(
                lambda: sample(model, data, {"d": data}, output_path=_WORK / "w.zarr", **KW),
                NonFiniteLossError,
                f"parameter {name!r} holds 1 NaN or infinite",
            )

        return run

    for value in (float("nan"), float("inf")):
        for name in ("transformer.wte.weight", "transformer.h.1.attn.c_proj.bias"):
            out.append(("bad-input", f"{value} in {name}", weight(value, name)))

    def nan_init_loss() -> bool:
        from gradsketch.slt import sample

        def loss(model: Any, ids: Any) -> Any:
            value = per_token_loss(model, ids)
            hit = (ids == data[2]).all(dim=1)
            return torch.where(hit[:, None], torch.full_like(value, float("nan")), value)

        kw = {**KW, "num_init_loss_batches": 4}
        return _raises(
            lambda: sample(
                tiny_gpt2(), data, {"d": data}, output_path=_WORK / "nan.zarr", loss_fn=loss, **kw
            ),
            NonFiniteLossError,
            "L(w*) is NaN or infinite on 1 sequences",
            "rows [2]",
        )

    out.append(("bad-input", "NaN initial loss on one row", nan_init_loss))

    def nan_step() -> bool:
        from gradsketch.slt import sample

        def loss(model: Any, ids: Any) -> Any:
            scale = 1.0 if torch.is_inference_mode_enabled() else float("nan")
            return per_token_loss(model, ids) * scale

        path = _WORK / "nanstep.zarr"
        shutil.rmtree(path, ignore_errors=True)
        return _warns(
            lambda: sample(tiny_gpt2(), data, {"d": data}, output_path=path, loss_fn=loss, **KW),
            UserWarning,
            "chain 0: the loss is NaN or infinite at step 0 on rows",
        )

    out.append(("bad-input", "NaN loss at a sampler step", nan_step))

    def diverging_slt(lr: float) -> Callable[[], bool]:
        def run() -> bool:
            from gradsketch.slt import llc

            path = _WORK / f"div-{lr}.zarr"
            shutil.rmtree(path, ignore_errors=True)
            kw = {**KW, "lr": lr, "num_chains": 1, "num_draws": 6}
            return _warns(
                lambda: llc(tiny_gpt2(0.0), data, {"d": data}, output_path=path, **kw),
                Warning,
                "diverged",
                f"lr={lr / 10:.2g}",
            )

        return run

    out += [("bad-input", f"slt.llc lr={lr:g} diverges", diverging_slt(lr)) for lr in (1e3, 10.0)]

    def diverging_sampling() -> bool:
        from torch.utils.data import DataLoader, TensorDataset

        from gradsketch.sampling import estimate_learning_coeff

        torch.manual_seed(0)
        x = torch.randn(64, 4)
        loader = DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16)
        return _warns(
            lambda: estimate_learning_coeff(
                torch.nn.Linear(4, 2),
                loader,
                num_draws=20,
                num_chains=1,
                seed=0,
                verbose=False,
                optimizer_kwargs={"lr": 10.0, "nbeta": 100.0},
            ),
            ChainDivergenceWarning,
            "diverged",
            "optimizer_kwargs['lr']`=1",
        )

    out.append(("bad-input", "estimate_learning_coeff lr=10 diverges", diverging_sampling))

    def file_as_output_path() -> bool:
        path = _WORK / "a-file.zarr"
        path.write_text("")
        return _raises(lambda: _sample(path), NotADirectoryError, "is a file")

    def foreign_store() -> bool:
        import zarr

        path = _WORK / "foreign.zarr"
        shutil.rmtree(path, ignore_errors=True)
        zarr.open_group(str(path), mode="a").create_array("weights", shape=(2,), dtype="f4")
        _raises(lambda: _sample(path), OutputPathMismatchError, "holds no samples")
        return (path / "weights").is_dir()

    out.append(("bad-input", "output_path is a file", file_as_output_path))
    out.append(("bad-input", "foreign zarr store kept and refused", foreign_store))
    out += cli_cases()
    return out


def cli_cases() -> list[Case]:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gradsketch.cli", *args],
            capture_output=True,
            text=True,
            timeout=300,
        )

    def config(text: str) -> str:
        path = _WORK / f"config-{abs(hash(text))}.py"
        path.write_text(text)
        return str(path)

    def message_alone() -> bool:
        proc = cli("factorize", config("x = 1\n"), "--out", str(_WORK / "cli-out"))
        return (
            proc.returncode == 1
            and proc.stderr.startswith("Error: config ")
            and "Traceback" not in proc.stderr
        )

    def debug_traceback() -> bool:
        proc = cli("factorize", config("x = 1\n"), "--out", str(_WORK / "cli-out"), "--debug")
        return proc.returncode == 1 and "ConfigError" in proc.stderr

    def out_is_file() -> bool:
        taken = _WORK / "taken"
        taken.write_text("")
        proc = cli("sketch-demo", "--out", str(taken))
        return proc.returncode == 2 and "is a file" in proc.stderr

    def save_dir_is_file() -> bool:
        out = _WORK / "cli-attr"
        out.mkdir(exist_ok=True)
        (out / "trak_store").write_text("")
        proc = cli("attribute", config("x = 1\n"), "--out", str(out))
        return proc.returncode == 1 and "`save_dir`" in proc.stderr and "is a file" in proc.stderr

    def dim_zero() -> bool:
        proc = cli("sketch-demo", "--dim", "0", "--out", str(_WORK / "sd"))
        return proc.returncode == 2 and "'--dim'" in proc.stderr and "grad_dim" not in proc.stderr

    return [
        ("cli", "library error: message alone", message_alone),
        ("cli", "--debug: traceback", debug_traceback),
        ("cli", "--out is a file", out_is_file),
        ("cli", "save_dir is a file", save_dir_is_file),
        ("cli", "sketch-demo --dim 0", dim_zero),
    ]


def zarr_version_case() -> bool:
    import zarr

    version = tuple(int(p) for p in zarr.__version__.split(".")[:3])
    pyproject = (HERE.parent.parent / "pyproject.toml").read_text()
    return version >= (3, 1, 3) and '"zarr>=3.1.3"' in pyproject


# -- the cases ------------------------------------------------------------------------------
def cases(quick: bool = False) -> Iterator[Case]:
    """Every slt / native / CLI fault case: ``(class, name, callable -> True on pass)``."""
    yield ("env", "zarr>=3.1.3 required and installed", zarr_version_case)
    for flags in (("init_done", "chain_done"), ("chain_done",)):
        for chains in ([1], [1, 2, 3], [3], [2, 3], [0], [0, 1, 2, 3]):
            name = f"flags {'+'.join(flags)} cleared on chains {chains}"
            yield ("resume", name, resume_case(chains, flags))
    for k in (1, 2, 3, 5, 7, 8):
        yield ("half-created", f"killed at layout array {k}", half_created_case(k))
    for content, partial in ((None, True), ('{"zarr_format": 3, "no', False), ("", True)):
        what = "no root" if content is None else ("empty root" if not content else "torn root")
        yield ("half-created", f"{what}{' + .partial' if partial else ''}", torn_root_case(
            content, partial))  # fmt: skip
    yield ("two-writers", "lock held by another writer: waits", held_lock_case)
    for resumed in (False, True):
        for array in ("init_loss", "sampling_loss_micro"):
            for how in ("missing", "bit-flipped", "truncated"):
                store = "resumed" if resumed else "complete"
                yield ("damage", f"{array} chunk {how}, {store} store: llc again", (
                    damaged_chunk_case(array, how, resumed)))  # fmt: skip
    for array, how in (("init_loss", "missing"), ("sampling_loss_micro", "bit-flipped")):
        yield ("damage", f"compute_llc on {array} chunk {how}", damaged_read_case(array, how))
    yield ("damage", "sampling_loss/zarr.json torn", torn_array_metadata_case)
    for lr in (KW["lr"], 3e-4):
        yield ("damage", f"root zarr.json torn, rerun with lr={lr}", (
            torn_root_of_a_finished_store_case(lr)))  # fmt: skip
    for n in (0, 3, 10, 25, 35, 45):
        yield ("disk-full", f"ENOSPC after {n} files, then a rerun", disk_full_case(n))
    yield from bad_input_cases()
    if quick:
        return
    for seed in range(8):
        yield ("kill", f"SIGKILL at a random moment (seed {seed})", kill_case(seed))
    for stagger in (0.0, 1.5):
        yield ("two-writers", f"two processes, second {stagger} s later", two_writers_case(
            stagger))  # fmt: skip
    for how in ("truncated", "empty", "garbled", "bit-flip", "other-elf", "no-record",
                "torn-record", "no-compiler"):  # fmt: skip
        yield ("native", f"cached library {how}", native_case(how))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="in-process cases only")
    parser.add_argument("--only", default=None, help="one class (resume, kill, native, ...)")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--kw", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        _job(Path(args.job), json.loads(args.kw))
        return
    import torch

    torch.set_num_threads(1)
    table: dict[str, list[int]] = {}
    for cls, name, fn in cases(quick=args.quick):
        if args.only is not None and cls != args.only:
            continue
        row = table.setdefault(cls, [0, 0, 0])
        start = time.perf_counter()
        try:
            ok, reason = bool(fn()), "returned False"
        except Exception as exc:
            ok, reason = False, f"{type(exc).__name__}: {exc}"
            if os.environ.get("FAULTS_DEBUG"):
                traceback.print_exc()
        row[0] += 1
        row[1 if ok else 2] += 1
        took = time.perf_counter() - start
        print(f"  {'ok  ' if ok else 'FAIL'}  {cls:13s} {name} ({took:.1f} s)"
              + ("" if ok else f": {reason[:400]}"), flush=True)  # fmt: skip
    print(f"\n{'class':14s} {'tried':>6s} {'passed':>7s} {'failed':>7s}")
    total = [0, 0, 0]
    for cls, row in table.items():
        print(f"{cls:14s} {row[0]:6d} {row[1]:7d} {row[2]:7d}")
        total = [a + b for a, b in zip(total, row)]
    print(f"{'total':14s} {total[0]:6d} {total[1]:7d} {total[2]:7d}")
    shutil.rmtree(_WORK, ignore_errors=True)


if __name__ == "__main__":
    main()
