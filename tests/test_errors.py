"""Every exception gradsketch raises on purpose derives from one base."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

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


def test_errors_lists_every_exception_class_of_the_package():
    defined = {}
    for name in _all_modules():
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and not issubclass(value, Warning)  # warned, never raised
                and value.__module__.startswith("gradsketch")
            ):
                defined[attr] = value
    assert set(defined) == set(errors.__all__)
    for name, cls in defined.items():
        assert issubclass(cls, GradsketchError), name


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
    ],
)
def test_errors_still_import_from_their_packages(package, name):
    module = importlib.import_module(f"gradsketch.{package}")
    assert getattr(module, name) is getattr(errors, name)
