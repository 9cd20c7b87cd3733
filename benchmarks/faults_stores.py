"""Fault cases of issue 47 beside ``faults.py``'s: lost settings, the other stores, bad inputs.

Loaded by ``benchmarks/faults.py`` (which hands its own module in, for the
models, the damage kinds and the pipeline), never run alone. Each case passes
on the rule of ``faults.py``: a clear error naming the problem and nothing
lost, or a result bit-identical to an uninterrupted run. Classes:

* ``settings-lost``: a finished TRAKer store whose ``settings.json`` is
  deleted, truncated or garbled is reopened with ``projector_seed=1``: refused
  with both projectors shown (judged from the arrays' fingerprints), the
  record left as it was; reopened with the first settings, it scores as before.
* ``llc-draws``: a recorded LLC draw store (``store=``) loses or damages a
  chunk of a finished chain: the rerun names it and samples the chain again,
  bit-identical; an unreadable array record is refused, named.
* ``replay``: a chunk of the replay's stored scores is damaged: reading them
  back is refused, named; scoring again recomputes them bit-identically.
* ``bad-input``: inputs of the wrong width or dtype, a label outside the
  classes, calibration data of the wrong width: refused before any forward
  pass, naming the argument; a refused batch leaves the run bit-identical.
* ``sum-order``: EK-FAC's factors featurized by two writers on round-robin
  batches against one writer in row order: within the bound derived in
  ``docs/stores.md`` (the sums are float64 in another order).
"""

from __future__ import annotations

import functools
import logging
import math
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

#: One case: (class, name, callable returning True on pass or raising with the reason).
Case = tuple[str, str, Callable[[], bool]]


def _refused(call: Callable[[], Any], exc: type[BaseException], pattern: str) -> str:
    """Run ``call``; it must raise ``exc`` whose message matches ``pattern``; the message."""
    try:
        call()
    except exc as err:
        if not re.search(pattern, str(err), flags=re.S):
            raise AssertionError(f"unclear message (wanted {pattern!r}): {err}") from err
        return str(err)
    raise AssertionError(f"accepted silently (wanted {exc.__name__}: {pattern!r})")


# -- settings-lost ----------------------------------------------------------------------------
def settings_lost_case(faults: ModuleType, kind: str) -> Callable[[], bool]:
    """Lose ``settings.json`` of a finished store; reopen under another projector seed."""

    def run() -> bool:
        from gradsketch.attribution import TRAKer
        from gradsketch.errors import SettingsMismatchError

        ref = faults.reference("mlp", "trak")
        with tempfile.TemporaryDirectory() as d:
            store = Path(d) / "store"
            faults._same(faults.pipeline(store, "mlp", "trak"), ref, "before damage")
            record = store / "settings.json"
            faults._damage(record, kind)
            left = record.read_bytes() if record.exists() else None
            m, _, _, task = faults.MODELS["mlp"]()
            kwargs = {"device": "cpu", "progress": False, "logging_level": logging.CRITICAL}
            message = _refused(
                lambda: TRAKer(
                    m,
                    task,
                    faults.N_TRAIN,
                    save_dir=store,
                    proj_dim=faults.PROJ_DIM,
                    chunk_rows=faults.CHUNK,
                    projector_seed=1,
                    **kwargs,
                ),
                SettingsMismatchError,
                r"settings\.json` is (missing|unreadable).*other settings:\n  projector: stored",
            )
            if "delete" in message:
                raise AssertionError(f"the refusal tells to delete the record: {message}")
            if (record.read_bytes() if record.exists() else None) != left:
                raise AssertionError("the refused call rewrote settings.json")
            return faults._same(faults.pipeline(store, "mlp", "trak"), ref, f"{kind} settings")

    return run


# -- llc-draws --------------------------------------------------------------------------------
@functools.cache
def _llc_problem() -> tuple[Any, Any]:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    x = torch.randn(128, 8)
    y = (x[:, 0] > 0).long()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return model, DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)


def _llc(store: Path) -> dict[str, Any]:
    from gradsketch.sampling import estimate_learning_coeff_with_summary

    model, loader = _llc_problem()
    return estimate_learning_coeff_with_summary(
        model,
        loader,
        optimizer_kwargs={
            "lr": 1e-4,
            "localization": 100.0,
            "nbeta": 10.0,
            "sketch_dim": 8,
            "save_metrics": True,
        },
        num_draws=4,
        num_chains=2,
        seed=0,
        verbose=False,
        store=store,
    )


def llc_draws_case(faults: ModuleType, array: str, kind: str) -> Callable[[], bool]:
    """Damage chain 1's chunk of ``array`` in a finished draw store (or its zarr.json); rerun."""

    def run() -> bool:
        from gradsketch.errors import StoreIntegrityError

        with tempfile.TemporaryDirectory() as d:
            store = Path(d) / "run"
            first = _llc(store)
            if kind == "truncate zarr.json":
                meta = store / array / "zarr.json"
                meta.write_text(meta.read_text()[:40])
                _refused(lambda: _llc(store), StoreIntegrityError, rf"`.*{array}/zarr\.json`.*Fix")
                return True
            chunk = store / array / "c" / "1" / "0"
            faults._damage(chunk / "0" if chunk.is_dir() else chunk, kind)
            again = _llc(store)
            if not math.isfinite(again["llc/mean"]):
                raise AssertionError(f"{kind} {array}: llc/mean is {again['llc/mean']}")
            same = np.array_equal(again["loss/trace"], first["loss/trace"])
            if not same or again["llc/mean"] != first["llc/mean"]:
                raise AssertionError(f"{kind} {array}: the resampled chain differs")
            return True

    return run


# -- replay -----------------------------------------------------------------------------------
def replay_case(faults: ModuleType, kind: str) -> Callable[[], bool]:
    """Damage a chunk of the replay's stored scores: refused when read, recomputed when scored."""

    def run() -> bool:
        from gradsketch.attribution import ReplayAttributor
        from gradsketch.errors import StoreIntegrityError

        m, train, targets, task = faults.MODELS["mlp"]()
        with tempfile.TemporaryDirectory() as d:

            def make() -> Any:
                r = ReplayAttributor(
                    m, task, train, num_steps=6, batch_size=8, lr=0.2, progress=False, save_dir=d
                )
                r.train()
                return r

            first = make().score(targets, exp_name="q")
            faults._damage(faults._first_chunk(Path(d) / "q" / "scores"), kind)
            pattern = r"`scores`: rows \[.*chunk \(.*score\(queries"
            _refused(lambda: make().finalize_scores("q"), StoreIntegrityError, pattern)
            again = make().score(targets, exp_name="q")
            return faults._same(again.numpy(), first.numpy(), f"{kind} replay scores")

    return run


# -- bad-input --------------------------------------------------------------------------------
def bad_input_case(faults: ModuleType, what: str) -> Callable[[], bool]:
    """A batch the model cannot take is refused by name; the run then goes on bit-identically."""
    patterns = {
        "width": r"`batch\[0\] \(the images\)` has shape \(8, 63\).*expects 64",
        "float64": r"is torch\.float64 but the model's parameters are torch\.float32",
        "label-range": r"holds label 10, but the model has 10 classes",
    }

    def run() -> bool:
        from gradsketch.errors import BatchFormatError

        ref = faults.reference("mlp", "trak")
        m, train, targets, task = faults.MODELS["mlp"]()
        with tempfile.TemporaryDirectory() as d:
            t = faults._traker(m, task, Path(d) / "store", "trak")
            t.load_checkpoint(m.state_dict(), model_id=0)
            x, y = faults._rows(train, np.arange(8))
            bad = {
                "width": (x[:, :63], y),
                "float64": (x.double(), y),
                "label-range": (x, y.clone().index_fill_(0, y.new_tensor([2]), 10)),
            }[what]
            _refused(lambda: t.featurize(bad, inds=np.arange(8)), BatchFormatError, patterns[what])
            # The refused batch changed nothing: not the store, not the gradient computer.
            for rows in faults.batches_of(faults.BATCH):
                t.featurize(faults._rows(train, rows), inds=rows)
            return faults._same(faults.finish(t, m, targets), ref, f"after a {what} batch")

    return run


def calibration_width_case() -> bool:
    """``apply_factorization`` with calibration data of the wrong width: named, model untouched."""
    import torch

    from gradsketch.errors import BatchFormatError
    from gradsketch.factorize import apply_factorization

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _refused(
        lambda: apply_factorization(
            model, min_features=32, latent_features=8, calibration_data=torch.randn(4, 63)
        ),
        BatchFormatError,
        r"`calibration_data` has shape \(4, 63\).*expects 64",
    )
    if not all(torch.equal(before[k], v) for k, v in model.state_dict().items()):
        raise AssertionError("the refused call changed the model")
    return True


# -- sum-order --------------------------------------------------------------------------------
def factor_sums(faults: ModuleType, batches: list[np.ndarray], save_dir: Path) -> dict[str, Any]:
    """EK-FAC's accumulated factor sums after featurizing ``batches`` in that order."""
    m, train, _, task = faults.MODELS["mlp"]()
    t = faults._traker(m, task, save_dir, "ekfac")
    faults.featurize(t, m, train, batches)
    t._save_accumulated()
    with np.load(save_dir / "checkpoints" / "0" / "accumulated.0.npz") as z:
        return {k: np.array(z[k]) for k in z.files if k.startswith(("a_sum", "g_sum"))}


def sum_order_bound(total: np.ndarray, n_batches: int) -> np.ndarray:
    """``|ΔF_ij| <= 2 γ_{N-1} sqrt(F_ii F_jj)`` (docs/stores.md), with 10 % for the diagonal's
    own rounding: the bound between two orders of summing ``N`` batch Gram matrices."""
    u = 2.0**-53
    gamma = (n_batches - 1) * u / (1 - (n_batches - 1) * u)
    diag = np.sqrt(np.abs(np.diag(total)))
    return 2.2 * gamma * np.outer(diag, diag)


def sum_order_case(faults: ModuleType, split: str) -> Callable[[], bool]:
    """Two writers on ``split`` (A's batches, then B's) against one writer in row order."""

    def run() -> bool:
        first, second = faults._split(split)
        with tempfile.TemporaryDirectory() as d:
            one = factor_sums(
                faults, sorted(first + second, key=lambda b: int(b[0])), Path(d) / "a"
            )
            two = factor_sums(faults, first + second, Path(d) / "b")
        n = len(first) + len(second)
        for key, want in one.items():
            excess = np.abs(two[key] - want) - sum_order_bound(want, n)
            if (excess > 0).any():
                raise AssertionError(
                    f"{split}: {key} beyond the documented bound by {excess.max()}"
                )
        return True

    return run


def cases(faults: ModuleType) -> list[Case]:
    """Every case of this file, on the helpers of ``faults`` (the ``faults.py`` module)."""
    out: list[Case] = []
    for kind in ("delete", "truncate", "garble"):
        out.append(("settings-lost", f"mlp/trak/{kind} settings.json, projector_seed=1",
                    settings_lost_case(faults, kind)))  # fmt: skip
    for array in ("loss", "sketch/noise", "metrics/distance"):
        for kind in ("delete", "flip", "truncate"):
            out.append(("llc-draws", f"{kind} {array} chunk", llc_draws_case(faults, array, kind)))
    out.append(("llc-draws", "truncate loss zarr.json",
                llc_draws_case(faults, "loss", "truncate zarr.json")))  # fmt: skip
    for kind in ("delete", "flip", "truncate"):
        out.append(("replay", f"{kind} scores chunk", replay_case(faults, kind)))
    for what in ("width", "float64", "label-range"):
        out.append(("bad-input", f"mlp/trak/{what}", bad_input_case(faults, what)))
    out.append(("bad-input", "apply_factorization calibration width", calibration_width_case))
    for split in ("rr1", "rr2", "rr16", "by-chunk"):
        out.append(("sum-order", f"mlp/ekfac/{split} vs one writer", sum_order_case(faults, split)))
    return out
