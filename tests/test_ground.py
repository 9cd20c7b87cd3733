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
from gradsketch._hash import TensorDigest
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
