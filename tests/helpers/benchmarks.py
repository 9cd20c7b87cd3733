"""The benchmark scripts of ``benchmarks/``, loaded by path for the tests of their command lines.

What the tests check of a benchmark's protocols they import from
:mod:`gradsketch.demos.protocols`; a script itself (its ``main``: arguments,
the closing table) is loaded from its file, without putting ``benchmarks/``
on ``sys.path``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/{name}.py`` as a module (once per process), under the name ``bench:{name}``.

    What a script shares with others lives in :mod:`gradsketch.demos.protocols`;
    the scripts' own ``_common`` (timing helpers, which serves those names
    too) is loaded the same way under its name, for scripts that import it.
    """
    if name != "_common" and "_common" not in sys.modules:
        sys.modules["_common"] = _load("_common", "_common")
    key = f"bench:{name}"
    if key not in sys.modules:
        sys.modules[key] = _load(key, name)
    return sys.modules[key]


def _load(key: str, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(key, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None, name
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
    return module
