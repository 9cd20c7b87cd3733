"""``sample(..., fast_path=...)``: "off" is the plain torch path, and the store says which ran."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _slt_helpers import tiny_gpt2, token_data

from gradsketch.slt import _run as run_module
from gradsketch.slt import _schema, sample
from gradsketch.slt._fast import _native as _train_native

#: The fast path is CPU-only: the runs stay there on a CUDA machine too (sample's default
#: device, as devinterp's, is CUDA when there is one).
KW: dict[str, Any] = dict(
    device="cpu",
    lr=1e-4,
    n_beta=20.0,
    localization=100.0,
    num_chains=2,
    num_draws=3,
    batch_size=4,
    batches_per_draw=1,
    num_init_loss_batches=2,
)
ARRAYS = ("init_loss", "sampling_loss", "sampling_loss_micro", "loss_train")


def _run(path: Path, **kwargs: Any) -> Any:
    data = token_data(16)
    return sample(tiny_gpt2(dropout=0.1), data, {"train": data}, output_path=path, **KW, **kwargs)


def test_off_equals_a_run_with_the_fast_machinery_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reference run has no working-copy swaps and no native train kernels at all
    (``train_copy`` a plain deep copy, the kernels' loader returning None): the model's
    own dropout from torch's generator and torch's cross-entropy. ``fast_path="off"``
    must give its store bit for bit."""
    off = _run(tmp_path / "off.zarr", fast_path="off").dataset
    with monkeypatch.context() as patch:
        patch.setattr(
            run_module,
            "train_copy",
            lambda model, device, **_: copy.deepcopy(model).to(device),
        )
        patch.setattr(_train_native, "native_kernels", lambda: None)
        plain = _run(tmp_path / "plain.zarr").dataset
    for name in ARRAYS:
        np.testing.assert_array_equal(off[name].values, plain[name].values, err_msg=name)
    auto = _run(tmp_path / "auto.zarr").dataset
    # Different masks (the copy's seeded dropout): not the same chains, same layout.
    assert auto["sampling_loss"].shape == off["sampling_loss"].shape
    assert not np.array_equal(auto["sampling_loss"].values, off["sampling_loss"].values)


def test_the_store_records_which_path_ran(tmp_path: Path) -> None:
    off = _run(tmp_path / "off.zarr", fast_path="off")
    assert off.attrs[_schema.FAST_PATH_ATTR] == [
        {"fast_path": "off", "modules": [], "kernels": "torch"}
    ]
    auto = _run(tmp_path / "auto.zarr")
    kernels = "native" if _train_native.train_library() is not None else "torch"
    assert auto.attrs[_schema.FAST_PATH_ATTR] == [
        {"fast_path": "auto", "modules": ["attention", "dropout", "gelu"], "kernels": kernels}
    ]


def test_fast_path_is_checked_first(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"`fast_path` must be one of \['auto', 'off'\], got 'no'"):
        _run(tmp_path / "x.zarr", fast_path="no")
    assert not (tmp_path / "x.zarr").exists()


def test_same_seed_same_store_with_and_without_the_train_kernels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``GRADSKETCH_NATIVE_TRAIN=0`` (as without a C compiler) runs torch's operations with
    the kernels' dropout masks: the chains agree to float32 rounding of a few steps, where
    other masks (another ``init_seed``) move the losses by orders of magnitude more."""
    if _train_native.train_library() is None:
        pytest.skip(f"native kernels unavailable: {_train_native.train_status().reason}")
    native = _run(tmp_path / "native.zarr")
    other = _run(tmp_path / "other.zarr", init_seed=101)
    monkeypatch.setenv("GRADSKETCH_NATIVE_TRAIN", "0")
    monkeypatch.setattr(_train_native._LOADED, "state", None)
    plain = _run(tmp_path / "plain.zarr")
    assert plain.attrs[_schema.FAST_PATH_ATTR][0]["kernels"] == "torch"
    assert native.attrs[_schema.FAST_PATH_ATTR][0]["kernels"] == "native"
    for name in ARRAYS:
        a, b = native.dataset[name].values, plain.dataset[name].values
        np.testing.assert_allclose(b, a, rtol=0, atol=2e-5, err_msg=name)
    moved = np.abs(other.dataset["sampling_loss"].values - native.dataset["sampling_loss"].values)
    assert moved.max() > 1e-2
