"""The library stands apart from its demos and command line.

Importing a capability package must not import typer, matplotlib or
scikit-learn (they belong to `gradsketch.cli` and `gradsketch.demos` and the
plotting functions, loaded on first use), and the names that moved still
import from where they did.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

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


# DESIGN.md's floors: each capability package may import only the packages
# below it, plus the ground-floor helper modules (`gradsketch._*`,
# `gradsketch.errors`). Imports inside functions count too: a deferred import
# still makes the lower floor depend on the upper one.
FLOORS: dict[str, frozenset[str]] = {
    "masked": frozenset(),
    "sketch": frozenset({"masked"}),
    "attribution": frozenset({"sketch", "masked"}),
    "sampling": frozenset({"sketch", "masked"}),
    "slt": frozenset({"sampling", "sketch", "masked"}),
    "factorize": frozenset(),
}
SRC = Path(gradsketch.__file__).resolve().parent


def _imported_packages(source: str, module: str) -> set[str]:
    """The `gradsketch` top-level names that `module`'s source imports (relative ones resolved)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: -node.level]
                names = [".".join([*base, *([node.module] if node.module else [])])]
            else:
                names = [node.module or ""]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "gradsketch" and len(parts) > 1:
                found.add(parts[1])
    return found


def _floor_violations(package: str, source: str, module: str) -> set[str]:
    allowed = FLOORS[package] | {package, "errors"}
    return {
        name
        for name in _imported_packages(source, module)
        if name not in allowed and not name.startswith("_")
    }


@pytest.mark.parametrize("package", sorted(FLOORS))
def test_capability_packages_import_only_their_floors(package):
    bad = {}
    for path in sorted((SRC / package).rglob("*.py")):
        rel = path.relative_to(SRC).with_suffix("")
        module = ".".join(("gradsketch", *rel.parts))
        if path.name == "__init__.py":
            module += ".__init__"  # relative imports resolve against the package itself
        found = _floor_violations(package, path.read_text(encoding="utf-8"), module)
        if found:
            bad[str(rel)] = sorted(found)
    assert bad == {}, f"imports above {package}'s floor (DESIGN.md): {bad}"


def test_ground_modules_import_no_capability_package():
    # `errors` is the index of every exception: it names the packages' errors
    # for type checkers only and loads them lazily, so it is not walked here.
    bad = {}
    for path in sorted(SRC.glob("_*.py")):
        if path.name == "__init__.py":
            continue
        module = f"gradsketch.{path.stem}"
        found = _imported_packages(path.read_text(encoding="utf-8"), module)
        found = {name for name in found if not name.startswith("_") and name != "errors"}
        if found:
            bad[path.name] = sorted(found)
    assert bad == {}


def test_the_floor_check_sees_a_deferred_and_a_relative_import():
    # The check can fail: the import `_bif` once made inside a function, and
    # a relative import that climbs out of the package.
    deferred = "def f():\n    from gradsketch.sampling import SGMCMC\n"
    assert _floor_violations("attribution", deferred, "gradsketch.attribution._x") == {"sampling"}
    relative = "from ..slt import bif\nfrom . import _y\n"
    assert _floor_violations("sampling", relative, "gradsketch.sampling._x") == {"slt"}
    assert _floor_violations("slt", "import gradsketch.sampling\n", "gradsketch.slt._x") == set()
