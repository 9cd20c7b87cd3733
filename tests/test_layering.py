"""DESIGN.md's layering, checked on the import graph of ``src/gradsketch``.

Every ``import`` statement counts: at module level, inside functions and under
``TYPE_CHECKING`` alike, since a deferred import still ties the importer to
the imported module, and a type checker or a refactoring follows it. Relative
imports are resolved; ``from pkg import name`` is an import of ``pkg.name``
where that is a module, else of ``pkg``. (The packages' lazy re-exports of
moved names, tables of module names read by :mod:`gradsketch._lazy`, are not
import statements and are not counted.)

The rules:

- no import circle (a strongly connected component of more than one module);
- no package imports another package's private module: ``gradsketch.A._x`` is
  imported only from inside ``gradsketch.A`` (the ground-floor ``gradsketch._x``
  belong to everyone);
- the ground floor (``gradsketch/_*.py`` and ``gradsketch/errors.py``) imports no
  package, only other ground-floor modules;
- each capability package imports only the packages on the floors below it.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

import pytest

import gradsketch

ROOT = "gradsketch"
SRC = Path(gradsketch.__file__).resolve().parent

#: DESIGN.md's floors: the packages each package may import (besides itself and the ground).
FLOORS: dict[str, frozenset[str]] = {
    "masked": frozenset(),
    "sketch": frozenset({"masked"}),
    "attribution": frozenset({"sketch", "masked"}),
    "sampling": frozenset({"sketch", "masked"}),
    "slt": frozenset({"sampling", "sketch", "masked"}),
    "factorize": frozenset(),
}
#: Demos and the command line sit on top of every capability package.
TOP = frozenset({"demos", "cli"})
FLOORS.update(dict.fromkeys(TOP, frozenset(FLOORS) | TOP))

#: A module's dotted name -> (its source, whether it is a package's ``__init__``).
Sources = Mapping[str, tuple[str, bool]]
Graph = dict[str, set[str]]


# -- the graph --------------------------------------------------------------------------------


def read_sources(src: Path = SRC, root: str = ROOT) -> dict[str, tuple[str, bool]]:
    """Every module under ``src``, by dotted name (a package by its own name)."""
    sources = {}
    for path in sorted(src.rglob("*.py")):
        parts = [root, *path.relative_to(src).with_suffix("").parts]
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        sources[".".join(parts)] = (path.read_text(encoding="utf-8"), is_package)
    return sources


def _known(name: str, modules: Mapping[str, object]) -> str | None:
    """``name``, or the longest dotted prefix of it that is a module of ours (None if none)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def imported_modules(module: str, source: str, is_package: bool, modules: Sources) -> set[str]:
    """The modules of ``modules`` that ``module``'s source imports, anywhere in the file."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                # A package's `from . import x` is relative to the package itself.
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join([*base, *([node.module] if node.module else [])])
            else:
                origin = node.module or ""
            targets = [
                f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in modules else origin
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            known = _known(target, modules)
            if known is not None and known != module:
                found.add(known)
    return found


def import_graph(sources: Sources) -> Graph:
    """Module -> the modules it imports."""
    return {
        module: imported_modules(module, source, is_package, sources)
        for module, (source, is_package) in sources.items()
    }


def circles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def describe_circles(graph: Graph, components: list[list[str]]) -> str:
    """Each component with the imports that tie it together, for the failure message."""
    lines = []
    for component in components:
        lines.append(f"circle of {len(component)} modules:")
        members = set(component)
        for module in component:
            inside = sorted(graph[module] & members)
            lines.append(f"    {module} -> {', '.join(inside)}")
    return "\n".join(lines)


# -- the rules --------------------------------------------------------------------------------


def _package(module: str) -> str | None:
    """The capability package holding ``module``; None on the ground floor and for the root."""
    parts = module.split(".")
    if len(parts) < 2 or parts[1].startswith("_") or parts[1] == "errors":
        return None
    return parts[1]


def is_ground(module: str) -> bool:
    """``gradsketch._x`` or ``gradsketch.errors`` (the root ``gradsketch`` is not ground)."""
    parts = module.split(".")
    return len(parts) == 2 and (parts[1].startswith("_") or parts[1] == "errors")


def private_owner(module: str) -> str | None:
    """The package a private module belongs to: ``a.b`` for ``a.b._x.y``; None if public.

    The ground floor's ``gradsketch._x`` belongs to the root, so to everyone.
    """
    parts = module.split(".")
    for depth in range(2, len(parts)):
        if parts[depth].startswith("_"):
            return ".".join(parts[:depth])
    return None


def private_imports(graph: Graph) -> list[str]:
    """``importer -> module`` for each private module imported from outside its package."""
    bad = []
    for importer, targets in sorted(graph.items()):
        for target in sorted(targets):
            owner = private_owner(target)
            if owner is not None and not (importer == owner or importer.startswith(owner + ".")):
                bad.append(f"{importer} -> {target}")
    return bad


def ground_violations(graph: Graph) -> list[str]:
    """``module -> target`` for each import of anything but the ground by a ground module."""
    return [
        f"{module} -> {target}"
        for module, targets in sorted(graph.items())
        if is_ground(module)
        for target in sorted(targets)
        if not is_ground(target)
    ]


def floor_violations(graph: Graph, floors: Mapping[str, frozenset[str]] = FLOORS) -> list[str]:
    """``module -> target`` for each import of a package above the importer's floor."""
    bad = []
    for module, targets in sorted(graph.items()):
        package = _package(module)
        if package is None:
            continue
        allowed = floors.get(package, frozenset()) | {package}
        for target in sorted(targets):
            if is_ground(target):
                continue
            if _package(target) not in allowed:
                bad.append(f"{module} -> {target}")
    return bad


# -- the package's own graph ------------------------------------------------------------------


@pytest.fixture(scope="module")
def graph() -> Graph:
    return import_graph(read_sources())


def test_the_graph_holds_every_module_and_sees_deferred_imports(graph):
    on_disk = {p for p in SRC.rglob("*.py")}
    assert len(graph) == len(on_disk)
    # The floors hold only if every capability package has a floor.
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}
    assert packages == set(FLOORS)
    # A known deferred (function-level) import of the command line.
    assert "gradsketch.cli._app" in graph["gradsketch.cli"]


def test_no_import_circle(graph):
    found = circles(graph)
    assert found == [], "import circles in src/gradsketch:\n" + describe_circles(graph, found)


def test_no_package_imports_another_package_private_module(graph):
    bad = private_imports(graph)
    assert bad == [], "private modules imported from outside their package:\n" + "\n".join(bad)


def test_ground_floor_imports_no_package(graph):
    assert "gradsketch.errors" in graph and graph["gradsketch.errors"] == set()
    assert ground_violations(graph) == []


@pytest.mark.parametrize("package", sorted(FLOORS))
def test_capability_packages_import_only_their_floors(graph, package):
    prefix = f"{ROOT}.{package}"
    mine = {m: t for m, t in graph.items() if m == prefix or m.startswith(prefix + ".")}
    bad = floor_violations(mine)
    assert bad == [], f"imports above {package}'s floor (DESIGN.md): {bad}"


# -- the checker sees what it must ------------------------------------------------------------

FAKE: dict[str, tuple[str, bool]] = {
    "gradsketch": ("", True),
    "gradsketch.errors": ("", False),
    "gradsketch._hash": ("from gradsketch.errors import X\n", False),
    "gradsketch._bad": ("def f():\n    from gradsketch.sketch import S\n", False),
    "gradsketch.sketch": ("from gradsketch.sketch._a import S\n", True),
    "gradsketch.sketch._a": ("from . import _b\nfrom gradsketch._hash import h\n", False),
    # The circle closes inside a function and under TYPE_CHECKING.
    "gradsketch.sketch._b": (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from gradsketch.sketch._c import C\n",
        False,
    ),
    "gradsketch.sketch._c": ("def g():\n    from ._a import S\n", False),
    "gradsketch.masked": ("import gradsketch.sketch._a\n", True),
    "gradsketch.attribution": ("from .. import sampling\n", True),
    "gradsketch.attribution._x": ("from gradsketch.attribution import _y\n", False),
    "gradsketch.attribution._y": ("from ..masked import M\n", False),
    "gradsketch.sampling": ("", True),
}


def test_the_checker_resolves_relative_and_from_imports():
    graph = import_graph(FAKE)
    assert graph["gradsketch.sketch._a"] == {"gradsketch.sketch._b", "gradsketch._hash"}
    assert graph["gradsketch.attribution"] == {"gradsketch.sampling"}
    assert graph["gradsketch.attribution._x"] == {"gradsketch.attribution._y"}
    assert graph["gradsketch.attribution._y"] == {"gradsketch.masked"}


def test_the_checker_sees_a_circle_through_deferred_imports():
    graph = import_graph(FAKE)
    found = circles(graph)
    assert found == [["gradsketch.sketch._a", "gradsketch.sketch._b", "gradsketch.sketch._c"]]
    assert "gradsketch.sketch._b -> gradsketch.sketch._c" in describe_circles(graph, found)


def test_the_checker_sees_a_private_import():
    assert private_imports(import_graph(FAKE)) == ["gradsketch.masked -> gradsketch.sketch._a"]


def test_the_checker_sees_a_ground_module_import_a_package():
    assert ground_violations(import_graph(FAKE)) == ["gradsketch._bad -> gradsketch.sketch"]


def test_the_checker_sees_an_import_above_the_floor():
    assert floor_violations(import_graph(FAKE)) == [
        "gradsketch.attribution -> gradsketch.sampling",
        "gradsketch.masked -> gradsketch.sketch._a",
    ]


def test_the_floor_check_sees_a_deferred_and_a_relative_import():
    # The import `_bif` once made inside a function, and a relative import
    # that climbs out of the package.
    def graph_of(module: str, source: str) -> Graph:
        fake = {
            name: ("", True) for name in ("gradsketch", "gradsketch.sampling", "gradsketch.slt")
        }
        return import_graph({**fake, module: (source, False)})

    deferred = "def f():\n    from gradsketch.sampling import SGMCMC\n"
    assert floor_violations(graph_of("gradsketch.attribution._x", deferred)) == [
        "gradsketch.attribution._x -> gradsketch.sampling"
    ]
    relative = "from ..slt import bif\nfrom . import _y\n"
    assert floor_violations(graph_of("gradsketch.sampling._x", relative)) == [
        "gradsketch.sampling._x -> gradsketch.slt"
    ]
    assert floor_violations(graph_of("gradsketch.slt._x", "import gradsketch.sampling\n")) == []
