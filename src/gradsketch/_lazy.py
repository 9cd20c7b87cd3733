"""Names a package re-exports from another module, imported on first use.

The capability packages keep the demo and command-line names they exported
before those moved to :mod:`gradsketch.demos` and :mod:`gradsketch.cli`, without
importing them (and typer, matplotlib or scikit-learn) at package import.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_getattr"]


def lazy_getattr(package: str, table: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``table[name]`` and returns its ``name``.

    Args:
        package: the importing module's ``__name__`` (for the error message).
        table: name -> module that defines it.

    Example:
        >>> getattr_ = lazy_getattr("pkg", {"sqrt": "math"})
        >>> getattr_("sqrt")(4.0)
        2.0
        >>> getattr_("cos")
        Traceback (most recent call last):
        ...
        AttributeError: module 'pkg' has no attribute 'cos'
    """

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__
