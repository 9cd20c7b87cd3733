"""The exceptions gradsketch raises, all subclasses of :class:`GradsketchError`.

This module is the one home of the library's exceptions (the demos keep theirs
in :mod:`gradsketch.demos`) and imports nothing of ours, so any module may
import from it without making an import circle. Each class keeps the built-in
parent it had (``ValueError`` for bad arguments and settings, ``RuntimeError``
for a state the program cannot continue from), so ``except ValueError`` still
works, and ``except GradsketchError`` catches everything the library raises on
purpose. The capability packages re-export the classes they raise, so
``gradsketch.masked.MaskError is gradsketch.errors.MaskError``.

Example:
    >>> from gradsketch.errors import GradsketchError, MaskError
    >>> issubclass(MaskError, GradsketchError) and issubclass(MaskError, ValueError)
    True
"""

from __future__ import annotations

__all__ = [
    "GradsketchError",
    # configuration and settings
    "ConfigError",
    "ConfigFileError",
    "SettingsMismatchError",
    "StoreIntegrityError",
    "DistributedMismatchError",
    "UnsupportedModelError",
    # masked
    "MaskError",
    # sketch
    "FingerprintMismatchError",
    "FactorizedLayoutError",
    "TritonUnavailableError",
    # attribution
    "ModelIDException",
    "NonFiniteFeaturesError",
    "MemoryBudgetError",
    "UnknownTaskError",
    "WrappedModelError",
    "HookComputationError",
    "BatchFormatError",
    "VmapTraceError",
    # slt
    "NonFiniteLossError",
    "OutputPathMismatchError",
]


class GradsketchError(Exception):
    """Base class of every exception gradsketch raises on purpose."""


# --- configuration and settings -------------------------------------------------------------


class ConfigError(GradsketchError, ValueError):
    """A config file cannot be loaded or lacks what its command needs."""


class ConfigFileError(ConfigError, FileNotFoundError):
    """A config path that is not an existing ``.py`` file."""


class SettingsMismatchError(GradsketchError, ValueError):
    """Stored results were made with other settings than the ones requested."""


class StoreIntegrityError(GradsketchError, RuntimeError):
    """Stored data or a stored record is missing, damaged or fails its checksum.

    The message names the file (and the rows, for row data) and how to recover.
    """


class DistributedMismatchError(GradsketchError, RuntimeError):
    """Ranks of one job disagree on something that must be identical (weights, sizes, seeds)."""


class UnsupportedModelError(GradsketchError, ValueError):
    """The model's architecture is not one the API serves (an encoder given to ``slt``).

    Raised before any work, judged by the model's class and config; the
    message names the model type, what is supported and what to use instead.
    """


# --- masked ------------------------------------------------------------------------------------


class MaskError(GradsketchError, ValueError):
    """A mask does not fit what it is applied to.

    Raised for masks with the wrong dtype, shape or device, masks keyed by
    tensors an optimizer does not hold, and parameter names a
    :class:`~gradsketch.masked.ParamMask` does not know. It subclasses
    :class:`ValueError`, so ``except ValueError`` catches it too.
    """


# --- sketch ------------------------------------------------------------------------------------


class FingerprintMismatchError(GradsketchError, ValueError):
    """Raised when sketches or stored features made by different maps are combined."""


class FactorizedLayoutError(GradsketchError, ValueError):
    """Raised when a model, a gradient or a factor does not fit a projector's layout."""


class TritonUnavailableError(GradsketchError, RuntimeError):
    """The Triton kernels were asked for where they cannot run."""


# --- attribution -------------------------------------------------------------------------------


class ModelIDException(GradsketchError, RuntimeError, AssertionError):
    """A checkpoint (model id) is missing, incomplete or inconsistent.

    TRAK's name; also an AssertionError, which trak 0.3.2 raises and its users catch.
    """


class NonFiniteFeaturesError(GradsketchError, ValueError):
    """A NaN or inf in weights, inputs, gradients or features, refused where it appears."""


class MemoryBudgetError(GradsketchError, ValueError):
    """The result does not fit the memory budget and no on-disk destination was given."""


class UnknownTaskError(GradsketchError, ValueError):
    """``task`` names no registered model output."""


class WrappedModelError(GradsketchError, ValueError):
    """Raised for a model wrapped in DataParallel / DDP / FSDP."""


class HookComputationError(GradsketchError, RuntimeError):
    """Raised when a hooked forward / backward does not fit the per-example assumptions."""


class BatchFormatError(GradsketchError, ValueError):
    """A batch does not have the fields (or the tuple length) the task expects."""


class VmapTraceError(GradsketchError, RuntimeError):
    """``torch.func.vmap`` cannot trace the model, and layer hooks cannot stand in."""


# --- slt ---------------------------------------------------------------------------------------


class NonFiniteLossError(GradsketchError, ValueError):
    """A chain's per-token loss was NaN or infinite."""


class OutputPathMismatchError(SettingsMismatchError, RuntimeError):
    """``output_path`` holds samples made with other settings (or is not a sample store)."""
