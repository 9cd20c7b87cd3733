"""The exceptions gradsketch raises, all subclasses of :class:`GradsketchError`.

Each keeps the built-in parent it had (``ValueError`` for bad arguments and
settings, ``RuntimeError`` for a state the program cannot continue from), so
``except ValueError`` still works, and ``except GradsketchError`` catches
everything the library raises on purpose. Each class stays importable from
its capability package too; the ones defined there load from here on first
use, so importing this module imports no capability.

Example:
    >>> from gradsketch.errors import GradsketchError, MaskError
    >>> issubclass(MaskError, GradsketchError) and issubclass(MaskError, ValueError)
    True
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradsketch._lazy import lazy_getattr

if TYPE_CHECKING:
    from gradsketch._distributed import DistributedMismatchError
    from gradsketch._settings import SettingsMismatchError, StoreIntegrityError
    from gradsketch.attribution import (
        BatchFormatError,
        HookComputationError,
        MemoryBudgetError,
        ModelIDException,
        NonFiniteFeaturesError,
        UnknownTaskError,
        VmapTraceError,
        WrappedModelError,
    )
    from gradsketch.demos import DemoSettingsError, DigitsSettingsError
    from gradsketch.demos._lm_corpus import CorpusError
    from gradsketch.demos.lm import LMDemoSettingsError
    from gradsketch.masked import MaskError
    from gradsketch.sketch import FactorizedLayoutError, FingerprintMismatchError
    from gradsketch.sketch._backend import TritonUnavailableError
    from gradsketch.slt import NonFiniteLossError, OutputPathMismatchError

__all__ = [
    "GradsketchError",
    "ConfigError",
    "ConfigFileError",
    # defined beside the code that raises them
    "MaskError",
    "FingerprintMismatchError",
    "FactorizedLayoutError",
    "TritonUnavailableError",
    "SettingsMismatchError",
    "StoreIntegrityError",
    "DistributedMismatchError",
    "ModelIDException",
    "NonFiniteFeaturesError",
    "MemoryBudgetError",
    "UnknownTaskError",
    "WrappedModelError",
    "HookComputationError",
    "BatchFormatError",
    "VmapTraceError",
    "NonFiniteLossError",
    "OutputPathMismatchError",
    "DemoSettingsError",
    "DigitsSettingsError",
    "CorpusError",
    "LMDemoSettingsError",
]


class GradsketchError(Exception):
    """Base class of every exception gradsketch raises on purpose."""


class ConfigError(GradsketchError, ValueError):
    """A config file cannot be loaded or lacks what its command needs."""


class ConfigFileError(ConfigError, FileNotFoundError):
    """A config path that is not an existing ``.py`` file."""


__getattr__ = lazy_getattr(
    __name__,
    {
        "MaskError": "gradsketch.masked",
        "FingerprintMismatchError": "gradsketch.sketch",
        "FactorizedLayoutError": "gradsketch.sketch",
        "TritonUnavailableError": "gradsketch.sketch._backend",
        "SettingsMismatchError": "gradsketch._settings",
        "StoreIntegrityError": "gradsketch._settings",
        "DistributedMismatchError": "gradsketch._distributed",
        "ModelIDException": "gradsketch.attribution",
        "NonFiniteFeaturesError": "gradsketch.attribution",
        "MemoryBudgetError": "gradsketch.attribution",
        "UnknownTaskError": "gradsketch.attribution",
        "WrappedModelError": "gradsketch.attribution",
        "HookComputationError": "gradsketch.attribution",
        "BatchFormatError": "gradsketch.attribution",
        "VmapTraceError": "gradsketch.attribution",
        "NonFiniteLossError": "gradsketch.slt",
        "OutputPathMismatchError": "gradsketch.slt",
        "DemoSettingsError": "gradsketch.demos",
        "DigitsSettingsError": "gradsketch.demos",
        "CorpusError": "gradsketch.demos._lm_corpus",
        "LMDemoSettingsError": "gradsketch.demos.lm",
    },
)
