"""The ground-floor helpers every package shares: checks, config files, JSON, devices, digests."""

from __future__ import annotations

import hashlib
import json
import math
import sys
from collections import namedtuple

import numpy as np
import pytest
import torch

from gradsketch._checks import check_int, integer, nonnegative_int, positive_int
from gradsketch._config import load_config
from gradsketch._device import to_device
from gradsketch._hash import (
    DIGEST_KEY,
    DIGEST_SCHEME,
    TensorDigest,
    architecture_digest,
    model_digest,
    state_digest,
    tensors_digest,
)
from gradsketch._json import jsonable
from gradsketch.errors import ConfigError, ConfigFileError, GradsketchError

# -- checks ----------------------------------------------------------------------------

VALID = [
    pytest.param(positive_int, 1, {}, 1, id="positive-one"),
    pytest.param(positive_int, np.int64(7), {}, 7, id="positive-numpy"),
    pytest.param(positive_int, None, {"optional": True}, None, id="positive-optional-none"),
    pytest.param(nonnegative_int, 0, {}, 0, id="nonnegative-zero"),
    pytest.param(integer, -(2**70), {}, -(2**70), id="integer-any-sign"),
    pytest.param(check_int, 2**64 - 1, {"low": 0, "high": 2**64}, 2**64 - 1, id="below-high"),
]


@pytest.mark.parametrize(("check", "value", "kwargs", "expected"), VALID)
def test_checks_return_what_they_accept(check, value, kwargs, expected):
    got = check("n", value, **kwargs)
    assert got == expected and (got is None or type(got) is int)


INVALID = [
    pytest.param(
        positive_int,
        0,
        {},
        ValueError,
        r"`n` must be a positive integer, got 0; pass e.g. n=1\.$",
        id="zero",
    ),
    pytest.param(positive_int, True, {}, ValueError, r"got True of type bool", id="bool"),
    pytest.param(positive_int, 2.0, {}, ValueError, r"got 2\.0 of type float", id="float"),
    pytest.param(positive_int, None, {}, ValueError, r"positive integer, got None", id="none"),
    pytest.param(
        positive_int,
        0,
        {"optional": True},
        ValueError,
        r"positive integer or None, got 0",
        id="optional",
    ),
    pytest.param(
        nonnegative_int,
        -1,
        {"fix": "count from 0"},
        ValueError,
        r"non-negative integer, got -1; count from 0\.$",
        id="fix",
    ),
    pytest.param(check_int, 1, {"low": 2}, ValueError, r"an integer >= 2, got 1", id="low"),
    pytest.param(
        check_int, 2**64, {"low": 0, "high": 2**64}, ValueError, r"in \[0, 2\*\*64\)", id="high"
    ),
    pytest.param(
        integer, "3", {}, TypeError, r"`n` must be an int, got '3' of type str", id="str-seed"
    ),
    pytest.param(
        positive_int,
        -1,
        {"error": ConfigError},
        ConfigError,
        r"positive integer, got -1",
        id="error",
    ),
]


@pytest.mark.parametrize(("check", "value", "kwargs", "exc", "match"), INVALID)
def test_checks_name_argument_value_and_fix(check, value, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        check("n", value, **kwargs)


# -- config files ------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _restore_sys_path(monkeypatch):
    # Loading a config puts its folder first on sys.path; keep that inside the test.
    monkeypatch.setattr(sys, "path", list(sys.path))


def test_config_is_imported_under_its_name_and_reloaded(tmp_path):
    path = tmp_path / "gs_cfg_reload.py"
    path.write_text("value = 1\ndef f():\n    return value\n")
    first = load_config(path, template="t.py")
    assert sys.modules["gs_cfg_reload"] is first and first.f.__module__ == "gs_cfg_reload"
    assert sys.path[0] == str(tmp_path)
    path.write_text("value = 2\n")
    assert load_config(path, template="t.py").value == 2  # a rerun sees the edit


def test_config_of_the_same_name_in_another_folder_comes_first(tmp_path):
    for folder, value in (("a", 1), ("b", 2)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "gs_cfg_twin.py").write_text(f"value = {value}\n")
    load_config(tmp_path / "a" / "gs_cfg_twin.py", template="t.py")
    assert load_config(tmp_path / "b" / "gs_cfg_twin.py", template="t.py").value == 2
    assert sys.path[0] == str(tmp_path / "b")


def test_config_refuses_to_shadow_an_imported_module(tmp_path):
    (tmp_path / "json.py").write_text("x = 1\n")
    with pytest.raises(ConfigError, match=r"has the name of the imported module 'json'"):
        load_config(tmp_path / "json.py", template="t.py")
    assert sys.modules["json"] is json


@pytest.mark.parametrize("name", ["absent.py", "notes.txt"])
def test_config_path_must_be_an_existing_python_file(tmp_path, name):
    (tmp_path / "notes.txt").write_text("x = 1\n")
    with pytest.raises(ConfigFileError, match=r"must be an existing \.py file.*see t\.py") as info:
        load_config(tmp_path / name, template="t.py")
    assert isinstance(info.value, FileNotFoundError | GradsketchError | ValueError)


def test_config_that_fails_is_not_left_half_imported(tmp_path):
    (tmp_path / "gs_cfg_broken.py").write_text("raise RuntimeError('boom')\n")
    with pytest.raises(RuntimeError, match="boom"):
        load_config(tmp_path / "gs_cfg_broken.py", template="t.py")
    assert "gs_cfg_broken" not in sys.modules


# -- JSON ---------------------------------------------------------------------------------


def test_jsonable_keeps_non_finite_floats_distinct_and_strict():
    record = jsonable({"nan": math.nan, "inf": np.float64(np.inf), "ninf": torch.tensor(-np.inf)})
    assert record == {"nan": "nan", "inf": "inf", "ninf": "-inf"}
    text = json.dumps(record, allow_nan=False)  # strict JSON: no NaN literals
    assert {k: float(v) for k, v in json.loads(text).items() if k != "nan"} == {
        "inf": math.inf,
        "ninf": -math.inf,
    }
    assert math.isnan(float(json.loads(text)["nan"]))


def test_jsonable_converts_containers_arrays_and_scalars():
    Pair = namedtuple("Pair", "a b")
    got = jsonable(
        {1: (np.arange(2), torch.ones(2, dtype=torch.int64)), "p": Pair(np.int32(3), 0.5)}
    )
    assert got == {"1": [[0, 1], [1, 1]], "p": [3, 0.5]}
    assert jsonable(torch.float16) == "torch.float16" and jsonable(None) is None


# -- devices ------------------------------------------------------------------------------


def test_to_device_rebuilds_every_container_type():
    Pair = namedtuple("Pair", "x y")
    batch = {"a": [torch.ones(1)], "b": (torch.zeros(2), "label"), "c": Pair(torch.ones(1), 3)}
    moved = to_device(batch, torch.device("cpu"))
    assert type(moved["a"]) is list and type(moved["b"]) is tuple and type(moved["c"]) is Pair
    assert moved["b"][1] == "label" and moved["c"].y == 3
    assert moved["a"][0] is batch["a"][0]  # already there: not copied


# -- digests ------------------------------------------------------------------------------


def test_tensor_digest_keeps_the_bytes_stored_fingerprints_were_made_from():
    """The digests written before there was one helper (sha256 of names and raw tensor bytes,
    16 hex digits) come out unchanged, so stored checkpoints and sketches stay valid."""
    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "n": torch.tensor(7)}
    old = hashlib.sha256()
    for name, t in state.items():
        old.update(name.encode())
        old.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    new = TensorDigest()
    for name, t in state.items():
        new.text(name).tensor(t)
    assert new.hexdigest() == old.hexdigest()[:16]
    mask = torch.tensor([True, False, True])
    packed = hashlib.sha256(b"h" + np.packbits(mask.numpy()).tobytes()).hexdigest()[:16]
    assert TensorDigest("h").bits(mask).hexdigest() == packed


def test_the_one_scheme_keeps_the_digests_stores_hold():
    """Values computed with the pre-scheme code of each caller (TRAK's `model_fingerprint` and
    `checkpoint_fingerprint`, the replay's raw-bytes `fingerprint`), pinned: stores written
    before keep opening because their recorded digests come out the same."""
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {"w": w, "b": torch.zeros(3, dtype=torch.float64), "step": 7}
    assert state_digest(state) == "5eabe2627e84504a"
    assert architecture_digest(torch.nn.Linear(4, 3)) == "fc87667d08c17ec1"
    tensors = [torch.arange(5), w.t()]
    assert tensors_digest(tensors) == "7659197aa650b241"
    raw = hashlib.sha256()
    for t in tensors:
        raw.update(t.contiguous().numpy().tobytes())
    assert tensors_digest(tensors) == raw.hexdigest()[:16]


def test_model_digest_sees_weights_and_samples_large_tensors():
    model = torch.nn.Linear(3, 2)
    before = model_digest(model)
    assert before == model_digest(model) and len(before) == 16
    assert architecture_digest(model) != before
    with torch.no_grad():
        model.weight[0, 0] += 1
    assert model_digest(model) != before
    # Above the threshold a stride of values and the sum enter: a change off the stride
    # still moves the sum.
    big = torch.zeros(10)
    digest = state_digest({"x": big}, sample_above=4)
    big[1] = 1.0
    assert state_digest({"x": big}, sample_above=4) != digest


def test_a_store_of_the_old_digest_scheme_is_refused_with_version_and_fix(tmp_path):
    """An slt sample store written before the one scheme (blake2b digests, no `digest` field)
    cannot be compared; `sample` refuses it naming the version that wrote it and the fix."""
    import zarr

    from gradsketch.slt import OutputPathMismatchError, _schema, _writing

    old = {"model": "0123456789abcdef", "dataset": "fedcba9876543210"}
    group = zarr.open_group(str(tmp_path / "old"), mode="w")
    group.attrs[_schema.SETTINGS_ATTR] = {**old, "versions": {"gradsketch": "0.1.0"}}
    new = {**old, DIGEST_KEY: DIGEST_SCHEME}
    with pytest.raises(
        OutputPathMismatchError,
        match=r"was written by gradsketch 0\.1\.0, whose digests of models and data "
        r"\(blake2b/16\) this version \(sha256/16\) cannot compare with its own\. "
        r"Pass another output_path, or delete it",
    ):
        _writing.check_existing(tmp_path / "old", new, {})
    # A store of this version's scheme opens (to resume it).
    group.attrs[_schema.SETTINGS_ATTR] = new
    assert _writing.check_existing(tmp_path / "old", dict(new), {}) == "resume"
