"""The library stands apart from its demos and command line.

Importing a capability package must not import typer, matplotlib or
scikit-learn (they belong to `gradsketch.cli` and `gradsketch.demos` and the
plotting functions, loaded on first use), and the names that moved still
import from where they did.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import gradsketch

HEAVY = ("typer", "matplotlib", "sklearn")


def _imported_after(statement: str) -> list[str]:
    code = (
        f"import json, sys\n{statement}\n"
        f"print(json.dumps([m for m in {list(HEAVY)!r} if m in sys.modules]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "module",
    [
        "gradsketch",
        "gradsketch.sketch",
        "gradsketch.attribution",
        "gradsketch.sampling",
        "gradsketch.masked",
        "gradsketch.factorize",
        "gradsketch.errors",
        "gradsketch.cli",
    ],
)
def test_import_loads_no_demo_or_cli_dependency(module):
    assert _imported_after(f"import {module}") == []


def test_the_check_sees_an_import():
    # The subprocess check can fail: importing the typer app does load typer.
    assert _imported_after("import gradsketch.cli._app") == ["typer"]


def test_moved_names_load_lazily_from_their_old_homes():
    statement = (
        "from gradsketch.attribution import run_demo, attribute_command, TransformerClassifier\n"
        "from gradsketch.factorize import factorize_command, CONFIG_SETTINGS"
    )
    # Reaching the names imports their modules, still without a heavy dependency.
    assert _imported_after(statement) == []


@pytest.mark.parametrize(
    ("package", "name", "home"),
    [
        ("attribution", "DemoSettings", "demos"),
        ("attribution", "DemoSettingsError", "demos"),
        ("attribution", "run_demo", "demos"),
        ("attribution", "load_digits_split", "demos"),
        ("attribution", "build_mlp", "demos"),
        ("attribution", "build_cnn", "demos"),
        ("attribution", "train_digits_model", "demos"),
        ("attribution", "TrainSettings", "demos"),
        ("attribution", "TransformerClassifier", "demos"),
        ("attribution", "TransformerBlock", "demos"),
        ("attribution", "AttributeSettings", "cli"),
        ("attribution", "attribute_command", "cli"),
        ("attribution", "ConfigError", "errors"),
        ("factorize", "factorize_command", "cli"),
        ("factorize", "CONFIG_SETTINGS", "cli"),
    ],
)
def test_moved_name_is_the_same_object(package, name, home):
    old = getattr(getattr(gradsketch, package), name)
    new = getattr(__import__(f"gradsketch.{home}", fromlist=[name]), name)
    assert old is new
    assert name not in getattr(gradsketch, package).__all__


@pytest.mark.parametrize("package", ["attribution", "factorize", "cli", "errors"])
def test_unknown_name_is_an_attribute_error(package):
    module = getattr(gradsketch, package, None) or __import__(
        f"gradsketch.{package}", fromlist=["_"]
    )
    with pytest.raises(AttributeError, match=rf"module 'gradsketch.{package}' has no attribute"):
        _ = module.no_such_name


def test_console_script_help():
    done = subprocess.run(
        [sys.executable, "-m", "gradsketch.cli", "demo", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "--out" in done.stdout and "--quick" in done.stdout


# DESIGN.md's floors and the ground floor are checked on the import graph in test_layering.py.
