"""The exceptions the demos raise (the library's own live in :mod:`gradsketch.errors`).

The demos are not the library, so their errors stay beside them; each still
derives from :class:`~gradsketch.errors.GradsketchError` and keeps ``ValueError``.
"""

from __future__ import annotations

from gradsketch.errors import GradsketchError

__all__ = ["DemoSettingsError", "DigitsSettingsError", "CorpusError", "LMDemoSettingsError"]


class DemoSettingsError(GradsketchError, ValueError):
    """Raised for invalid demo settings or an output folder holding another run."""


class DigitsSettingsError(GradsketchError, ValueError):
    """Raised when digits data, model or training settings are invalid."""


class CorpusError(GradsketchError, ValueError):
    """The corpus cannot be built as asked (missing files, too few chunks)."""


class LMDemoSettingsError(GradsketchError, ValueError):
    """Invalid settings of the language-model demo."""
