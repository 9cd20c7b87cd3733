"""The sketch and train kernels: separate libraries with separate switches."""

from __future__ import annotations

import logging

import pytest

from gradsketch import _native_build
from gradsketch.sketch import _native
from gradsketch.slt._fast import _native as _train_native

SPECS = {"sketch": _native.SPEC, "train": _train_native.SPEC}


@pytest.mark.parametrize(
    ("env", "off"),
    [
        pytest.param({}, set(), id="default"),
        pytest.param({"GRADSKETCH_NATIVE": "0"}, {"sketch", "train"}, id="all-off"),
        pytest.param({"GRADSKETCH_NATIVE_SKETCH": "0"}, {"sketch"}, id="sketch-off"),
        pytest.param({"GRADSKETCH_NATIVE_TRAIN": "off"}, {"train"}, id="train-off"),
        pytest.param(
            {"GRADSKETCH_NATIVE": "1", "GRADSKETCH_NATIVE_TRAIN": "false"}, {"train"}, id="mixed"
        ),
    ],
)
def test_each_library_has_its_own_switch(env, off):
    for name, spec in SPECS.items():
        reason = _native_build.switched_off(spec, env)
        if name in off:
            switch = next(k for k in ("GRADSKETCH_NATIVE", spec.switch) if env.get(k, "1") != "1")
            assert reason == f"disabled by {switch}=0"
            status, lib = _native_build.load(spec, env=env)
            assert not status.available and lib is None and status.reason == reason
        else:
            assert reason is None


def test_switching_the_train_kernels_off_leaves_the_sketch_kernels(monkeypatch, caplog):
    monkeypatch.delenv("GRADSKETCH_NATIVE", raising=False)
    monkeypatch.setenv("GRADSKETCH_NATIVE_TRAIN", "0")
    monkeypatch.setattr(_train_native._LOADED, "state", None)
    with caplog.at_level(logging.INFO, logger=_native_build.__name__):
        assert _train_native.train_library() is None
        assert _train_native.train_status().reason == "disabled by GRADSKETCH_NATIVE_TRAIN=0"
    # Turned off on purpose: one INFO line, no warning.
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "native train kernels unavailable" in caplog.text
    sketch, _ = _native._load()
    assert sketch.available == _native.native_status().available


@pytest.mark.skipif(
    not (_native.native_status().available and _train_native.train_status().available),
    reason="native kernels unavailable",
)
def test_the_libraries_are_separate_files_with_their_own_kernels():
    sketch, train = _native.library(), _train_native.train_library()
    assert sketch is not None and train is not None
    assert _native.native_status().path != _train_native.train_status().path
    assert "gs_sketch-" in str(_native.native_status().path)
    assert "gs_train-" in str(_train_native.train_status().path)
    assert hasattr(sketch, "gs_reduce_f32_i64") and not hasattr(sketch, "gs_dropout_f32")
    assert hasattr(train, "gs_dropout_f32") and not hasattr(train, "gs_reduce_f32_i64")
    assert train.gs_train_abi_version() == _train_native.ABI_VERSION
    assert sketch.gs_abi_version() == _native.ABI_VERSION
