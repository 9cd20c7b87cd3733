"""Folders the commands write to: checked before any work, named in the refusal.

``--out`` (and the stores made inside it, such as the TRAKer's ``save_dir``)
must be folders; a file at that path, or at any folder above it, would
otherwise surface late as a bare ``FileExistsError`` or ``NotADirectoryError``
from deep inside a run.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     (Path(tmp) / "taken").write_text("")
    ...     output_folder(Path(tmp) / "taken" / "out")
    Traceback (most recent call last):
    ...
    NotADirectoryError: `--out` .../taken/out cannot be a folder: .../taken is a file; ...
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["check_folder", "output_folder", "write_summary"]


def check_folder(path: str | os.PathLike[str], *, name: str = "--out") -> Path:
    """``path`` as a Path, refused when it or a folder above it is a file (nothing created)."""
    out = Path(path)
    for above in (out, *out.parents):
        if above.exists():
            if not above.is_dir():
                raise NotADirectoryError(
                    f"`{name}` {out} cannot be a folder: {above} is a file; pass a folder path "
                    "(it is created) or move the file away."
                )
            break
    return out


def output_folder(path: str | os.PathLike[str], *, name: str = "--out") -> Path:
    """:func:`check_folder`, then create the folder (and its parents)."""
    out = check_folder(path, name=name)
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_summary(
    out: Path, summary: dict[str, Any], headline: str, *details: str
) -> dict[str, Any]:
    """``summary`` written to ``out/summary.json``, with its ``report`` first set.

    The report is what the command prints: ``headline``, then each detail and
    the summary's own path on indented lines.
    """
    path = out / "summary.json"
    summary["report"] = "\n".join([headline, *(f"  {d}" for d in details), f"  summary: {path}"])
    path.write_text(json.dumps(summary, indent=2) + "\n")
    return summary
