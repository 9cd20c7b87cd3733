"""Run the peers' own test files against gradsketch with only their imports rewritten.

The peers' files are not part of gradsketch (their code stays theirs): point
this script at a directory holding them, e.g. devinterp's ``tests/optim`` or
trak's ``tests``. For every suite it makes two copies under ``--work``: the
files as they are (run against the peer itself) and the files with each
``from <peer module> import ...`` line rewritten through :data:`IMPORT_TABLE`
(run against gradsketch). Nothing else in a file changes, except for
``--cpu-port`` suites, where ``.cuda()`` calls are dropped and the
``device="cuda:0"`` of tests marked ``cuda`` becomes ``"cpu"`` in both
copies alike (trak's CUDA tests on a machine without one).

Each copy runs in its own pytest process with an empty configuration (the
peer's semantics, not gradsketch's ``filterwarnings = error``) and a JUnit
report; one JSON line per suite and copy gives passed / failed / skipped
and the failing test ids, then a table.

Usage::

    python tests/peer/peer_suites.py --work /tmp/peer_run \\
        --suite devinterp-optim=/path/to/devinterp/tests/optim \\
        --suite trak-traker=/path/to/trak/tests:cpu-port

Environment variables pass through, so the AVX2 path is
``ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
GRADSKETCH_NATIVE_MARCH=x86-64-v3 python tests/peer/peer_suites.py ...``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

#: Peer module -> the gradsketch module that exports the same names.
IMPORT_TABLE: dict[str, str] = {
    "devinterp.optim.metrics": "gradsketch.sampling",
    "devinterp.optim.sgld": "gradsketch.sampling",
    "devinterp.optim.sgmcmc": "gradsketch.sampling",
    "devinterp.optim.sketch": "gradsketch.sketch",
    "devinterp.slt.bif": "gradsketch.slt",
    "devinterp.slt.llc": "gradsketch.slt",
    "devinterp.slt.sampling": "gradsketch.slt",
    "devinterp.slt.susceptibilities": "gradsketch.slt",
    "trak": "gradsketch.attribution",
    "trak.modelout_functions": "gradsketch.attribution",
    "trak.projectors": "gradsketch.sketch",
}

_FROM_IMPORT = re.compile(r"^(\s*)from\s+([\w.]+)\s+import\b", re.MULTILINE)
_PEERS = ("devinterp", "trak")


class UnmappedImportError(ValueError):
    """A peer module the import table does not map."""


def rewrite_imports(source: str, *, name: str = "<source>") -> str:
    """``source`` with every ``from <peer module> import`` rewritten by :data:`IMPORT_TABLE`.

    Raises:
        UnmappedImportError: a peer module (``devinterp...`` / ``trak...``) that the
            table lacks, or a plain ``import devinterp`` line, which a module
            rename cannot keep call-compatible.

    Example:
        >>> rewrite_imports("from devinterp.optim.sgld import SGLD\\n")
        'from gradsketch.sampling import SGLD\\n'
    """

    def swap(match: re.Match[str]) -> str:
        indent, module = match.group(1), match.group(2)
        if module.split(".")[0] not in _PEERS:
            return match.group(0)
        if module not in IMPORT_TABLE:
            raise UnmappedImportError(
                f"{name}: `from {module} import` has no entry in IMPORT_TABLE; add "
                f"{module!r}: '<gradsketch module>' to tests/peer/peer_suites.py"
            )
        return f"{indent}from {IMPORT_TABLE[module]} import"

    out = _FROM_IMPORT.sub(swap, source)
    plain = re.search(rf"^\s*import\s+({'|'.join(_PEERS)})\b.*$", out, re.MULTILINE)
    if plain:
        raise UnmappedImportError(
            f"{name}: `{plain.group(0).strip()}` imports a peer package by name; only "
            "`from <module> import <names>` lines are rewritten"
        )
    return out


def cpu_port(source: str) -> str:
    """Drop ``.cuda()`` calls; tests marked ``cuda`` get ``device="cpu"`` for ``"cuda:0"``.

    Example:
        >>> src = '@pytest.mark.cuda\\ndef test_a():\\n    f(x.cuda(), device="cuda:0")\\n'
        >>> print(cpu_port(src), end="")
        @pytest.mark.cuda
        def test_a():
            f(x, device="cpu")
    """
    source = source.replace(".cuda()", "")
    blocks = re.split(r"(?m)^(?=@|def |class )", source)
    out, marked = [], False
    for block in blocks:
        if block.startswith("@pytest.mark.cuda"):
            marked = True
        elif block.startswith(("def ", "class ")):
            if marked:
                block = block.replace('device="cuda:0"', 'device="cpu"')
            marked = False
        out.append(block)
    return "".join(out)


_PYTEST_INI = """[pytest]
markers =
    gpu: needs CUDA
    only_multi_gpu: needs two GPUs
    cuda: needs CUDA (ported to the CPU by --cpu-port)
    slow: slow
"""


@dataclass
class Outcome:
    """Counts of one pytest run from its JUnit report."""

    passed: int = 0
    failed: list[str] = field(default_factory=list)
    skipped: int = 0

    @property
    def total(self) -> int:
        return self.passed + len(self.failed)


def _junit(path: Path) -> Outcome:
    out = Outcome()
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("skipped") is not None:
            out.skipped += 1
        elif case.find("failure") is not None or case.find("error") is not None:
            out.failed.append(test_id)
        else:
            out.passed += 1
    return out


def prepare(src: Path, dest: Path, *, gradsketch: bool, port: bool) -> None:
    """Copy ``src``'s ``test_*.py`` files to ``dest``, rewritten as asked."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    (dest / "pytest.ini").write_text(_PYTEST_INI)
    for path in sorted(src.glob("test_*.py")):
        text = path.read_text()
        if port:
            text = cpu_port(text)
        if gradsketch:
            text = rewrite_imports(text, name=str(path))
        (dest / path.name).write_text(text)


def run(dest: Path, extra: list[str]) -> Outcome:
    """pytest on ``dest`` in a fresh process; CUDA-marked tests deselected without CUDA."""
    import torch

    report = dest / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(dest)]
    cmd += ["-c", str(dest / "pytest.ini"), "--rootdir", str(dest), f"--junitxml={report}"]
    if not torch.cuda.is_available():
        cmd += ["-m", "not gpu and not only_multi_gpu"]
    subprocess.run(cmd + extra, cwd=dest, check=False, capture_output=True)
    return _junit(report)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="scratch directory")
    parser.add_argument(
        "--suite",
        action="append",
        required=True,
        help="NAME=DIR, or NAME=DIR:cpu-port to run CUDA-marked tests on the CPU",
    )
    parser.add_argument("--only", choices=["peer", "gradsketch"], help="run one side only")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args(argv)
    rows = []
    for spec in args.suite:
        name, _, where = spec.partition("=")
        port = where.endswith(":cpu-port")
        src = Path(where.removesuffix(":cpu-port"))
        for side in ("peer", "gradsketch"):
            if args.only and side != args.only:
                continue
            dest = args.work / side / name
            prepare(src, dest, gradsketch=side == "gradsketch", port=port)
            got = run(dest, args.pytest_args)
            line = {
                "suite": name,
                "side": side,
                "passed": got.passed,
                "total": got.total,
                "skipped": got.skipped,
                "failed": got.failed,
            }
            print(json.dumps(line), flush=True)
            rows.append(line)
    print("| suite | side | passed / total | failed |")
    print("|---|---|---|---|")
    for r in rows:
        failed = ", ".join(t.split("::")[-1] for t in r["failed"]) or "-"
        print(f"| {r['suite']} | {r['side']} | {r['passed']}/{r['total']} | {failed} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
