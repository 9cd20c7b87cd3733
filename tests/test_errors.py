"""Every exception gradsketch raises on purpose derives from one base."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys

import pytest

import gradsketch
import gradsketch.errors as errors
from gradsketch.errors import GradsketchError

# The built-in parent each class had before the common base, kept for `except ValueError`.
PARENTS = {
    "ConfigError": ValueError,
    "ConfigFileError": FileNotFoundError,
    "MaskError": ValueError,
    "FingerprintMismatchError": ValueError,
    "FactorizedLayoutError": ValueError,
    "TritonUnavailableError": RuntimeError,
    "SettingsMismatchError": ValueError,
    "StoreIntegrityError": RuntimeError,
    "NonFiniteFeaturesError": ValueError,
    "DistributedMismatchError": RuntimeError,
    "ModelIDException": RuntimeError,
    "MemoryBudgetError": ValueError,
    "UnknownTaskError": ValueError,
    "WrappedModelError": ValueError,
    "HookComputationError": RuntimeError,
    "BatchFormatError": ValueError,
    "VmapTraceError": RuntimeError,
    "NonFiniteLossError": ValueError,
    "OutputPathMismatchError": RuntimeError,
    "UnsupportedModelError": ValueError,
}

# The demos are not the library: their errors live in `gradsketch.demos`, not in `errors.py`.
DEMO_PARENTS = {
    "DemoSettingsError": ValueError,
    "DigitsSettingsError": ValueError,
    "CorpusError": ValueError,
    "LMDemoSettingsError": ValueError,
}


def _all_modules() -> list[str]:
    names = [gradsketch.__name__]
    for info in pkgutil.walk_packages(gradsketch.__path__, prefix="gradsketch."):
        if not info.name.endswith("__main__"):
            names.append(info.name)
    return names


def _library_modules() -> list[str]:
    return [name for name in _all_modules() if not name.startswith("gradsketch.demos")]


def _exception_classes(module_names: list[str]) -> dict[str, type]:
    defined = {}
    for name in module_names:
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and not issubclass(value, Warning)  # warned, never raised
                and value.__module__.startswith("gradsketch")
            ):
                defined[attr] = value
    return defined


def test_errors_lists_every_exception_class_of_the_package():
    defined = _exception_classes(_library_modules())
    assert set(defined) == set(errors.__all__)
    for name, cls in defined.items():
        assert issubclass(cls, GradsketchError), name
        assert cls is getattr(errors, name), name
        assert cls.__module__ == "gradsketch.errors", name


def test_errors_imports_nothing_of_the_package():
    """`errors.py` is a leaf: importing it in a fresh interpreter loads no other module of ours."""
    code = (
        "import sys, gradsketch.errors; "
        "print(sorted(m for m in sys.modules if m.startswith('gradsketch')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "['gradsketch', 'gradsketch.errors']"


def test_demo_errors_live_in_the_demos():
    demos = importlib.import_module("gradsketch.demos._errors")
    in_demos = _exception_classes([m for m in _all_modules() if m.startswith("gradsketch.demos")])
    defined = {k: v for k, v in in_demos.items() if v.__module__.startswith("gradsketch.demos")}
    assert set(defined) == set(DEMO_PARENTS)
    for name, parent in DEMO_PARENTS.items():
        cls = getattr(demos, name)
        assert defined[name] is cls
        assert issubclass(cls, GradsketchError) and issubclass(cls, parent)
        assert not hasattr(errors, name)


@pytest.mark.parametrize(("name", "parent"), sorted(PARENTS.items()))
def test_each_error_keeps_its_builtin_parent(name, parent):
    cls = getattr(errors, name)
    assert issubclass(cls, GradsketchError) and issubclass(cls, parent)


def test_table_covers_errors_all():
    assert set(PARENTS) == set(errors.__all__) - {"GradsketchError"}


@pytest.mark.parametrize(
    ("package", "name"),
    [
        ("masked", "MaskError"),
        ("sketch", "FingerprintMismatchError"),
        ("sketch", "FactorizedLayoutError"),
        ("sampling", "SettingsMismatchError"),
        ("sampling", "DistributedMismatchError"),
        ("attribution", "DistributedMismatchError"),
        ("attribution", "ModelIDException"),
        ("attribution", "ConfigError"),
        ("cli", "ConfigError"),
        ("slt", "UnsupportedModelError"),
        ("attribution", "UnsupportedModelError"),
    ],
)
def test_errors_still_import_from_their_packages(package, name):
    module = importlib.import_module(f"gradsketch.{package}")
    assert getattr(module, name) is getattr(errors, name)
