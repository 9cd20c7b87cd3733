"""The command line's errors: the message alone (``--debug``: the traceback), folders checked."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

typer = pytest.importorskip("typer")

from typer.testing import CliRunner  # noqa: E402

from gradsketch.cli._app import app, run  # noqa: E402
from gradsketch.demos._sketch import run_sketch_demo  # noqa: E402
from gradsketch.errors import ConfigError  # noqa: E402


@pytest.fixture
def empty_config(tmp_path: Path) -> Path:
    path = tmp_path / "config.py"
    path.write_text("x = 1\n")
    return path


def test_a_library_error_prints_its_message_alone(
    empty_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run(["factorize", str(empty_config), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("Error: config ") and "defines neither `model`" in err
    assert "Traceback" not in err and "--debug" in err


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_the_traceback(empty_config: Path, tmp_path: Path, where: str) -> None:
    args = ["factorize", str(empty_config), "--out", str(tmp_path / "out")]
    args = ["--debug", *args] if where == "before" else [*args, "--debug"]
    with pytest.raises(ConfigError, match=r"defines neither `model` nor `build_model\(\)`"):
        run(args)


def test_a_bug_keeps_its_traceback(tmp_path: Path) -> None:
    """Not an error gradsketch raised on purpose: re-raised as it is."""
    config = tmp_path / "config.py"
    config.write_text("x = 1 / 0\n")
    with pytest.raises(ZeroDivisionError):
        run(["factorize", str(config), "--out", str(tmp_path / "out")])


@pytest.mark.parametrize("command", ["sketch-demo", "demo", "factorize", "attribute"])
def test_an_out_that_is_a_file_is_refused_by_name(
    command: str, empty_config: Path, tmp_path: Path
) -> None:
    taken = tmp_path / "taken"
    taken.write_text("")
    args = [command] if command in ("sketch-demo", "demo") else [command, str(empty_config)]
    result = CliRunner().invoke(app, [*args, "--out", str(taken / "sub")])
    assert result.exit_code == 2, result.output
    squashed = re.sub(r"[\s\u2500-\u257f]", "", result.output)  # typer boxes and wraps it
    assert f"`--out`{taken}/subcannotbeafolder:{taken}isafile" in squashed, result.output


def test_a_save_dir_that_is_a_file_is_refused_by_name(
    empty_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "trak_store").write_text("")
    with pytest.raises(SystemExit):
        run(["attribute", str(empty_config), "--out", str(out)])
    err = capsys.readouterr().err
    assert "`save_dir`" in err and "trak_store is a file" in err


def test_sketch_demo_dim_zero_names_the_option(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["sketch-demo", "--dim", "0", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert "'--dim'" in result.output and "grad_dim" not in result.output


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dim": 0}, r"`dim` must be a positive int, got 0"),
        ({"num_pairs": -1}, r"`num_pairs` must be a positive int, got -1"),
        ({"sizes": (16, 0)}, r"`sizes` must be positive ints, got \(16, 0\)"),
    ],
    ids=["dim", "num_pairs", "sizes"],
)
def test_run_sketch_demo_names_bad_arguments(tmp_path: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        run_sketch_demo(tmp_path / "o", **kwargs)
    assert not (tmp_path / "o").exists()


def test_run_sketch_demo_refuses_a_file_as_out_dir(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(NotADirectoryError, match=r"`out_dir`=.*f' is a file"):
        run_sketch_demo(tmp_path / "f", dim=8, sizes=(4,), num_pairs=2)
