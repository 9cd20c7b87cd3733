"""gradsketch: compressed gradients for PyTorch.

Subpackages, one capability each:

- :mod:`gradsketch.sketch`: seeded linear maps (count sketch, sparse and dense
  JL projectors) with a JSON fingerprint.
- :mod:`gradsketch.attribution`: TRAK data attribution.
- :mod:`gradsketch.sampling`: SGMCMC samplers and local learning coefficient.
- :mod:`gradsketch.slt`: devinterp 2.0's language-model layer (``sample``,
  ``llc``, ``bif``, ``susceptibilities``, head-level weight restrictions).
- :mod:`gradsketch.masked`: masked optimizers and parameter masks.
- :mod:`gradsketch.factorize`: low-rank factorization of Linear / Conv2d.
- :mod:`gradsketch.errors`: :class:`~gradsketch.errors.GradsketchError`, the
  base of every exception the library raises.

The command line and the demos live apart, in :mod:`gradsketch.cli` and
:mod:`gradsketch.demos`.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_SUBPACKAGES = ("sketch", "attribution", "sampling", "slt", "masked", "factorize", "errors")

__all__ = ["__version__", *_SUBPACKAGES]


def __getattr__(name: str) -> Any:
    # Subpackages load on first use so `import gradsketch` stays cheap.
    if name in _SUBPACKAGES:
        return importlib.import_module(f"gradsketch.{name}")
    raise AttributeError(f"module 'gradsketch' has no attribute {name!r}")
