"""Settings records: dataclass <-> JSON, a readable diff, and package versions.

Every stored artefact (features, sketches, scores, sampler traces) carries the
settings that produced it. A rerun compares its settings with the stored ones
and refuses to mix results made with different settings, showing both values
of every field that differs. Package versions are recorded for provenance but
are never compared (upgrading numpy must not invalidate stored features).

Example:
    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class Run:
    ...     proj_dim: int = 8
    ...     seed: int = 0
    >>> record = settings_record(Run(proj_dim=16))
    >>> record["proj_dim"], "versions" in record
    (16, True)
    >>> settings_diff({"proj_dim": 16, "seed": 0}, {"proj_dim": 8, "seed": 0})
    ['proj_dim: stored 16, requested 8']
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from gradsketch._json import jsonable
from gradsketch.errors import SettingsMismatchError, StoreIntegrityError

#: Key under which :func:`settings_record` stores package versions.
VERSIONS_KEY = "versions"

#: Packages whose versions are recorded by default.
DEFAULT_PACKAGES: tuple[str, ...] = ("gradsketch", "torch", "numpy", "zarr")


def package_versions(packages: Iterable[str] = DEFAULT_PACKAGES) -> dict[str, str | None]:
    """Installed version of each package (``None`` when it is not installed)."""
    versions: dict[str, str | None] = {}
    for name in packages:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def settings_record(
    settings: Any, *, packages: Iterable[str] | None = DEFAULT_PACKAGES
) -> dict[str, Any]:
    """JSON-ready dict of a settings dataclass (or mapping), plus package versions.

    Args:
        settings: a dataclass instance or a mapping.
        packages: packages whose versions go under ``"versions"``; ``None``
            records none.

    Returns:
        A dict of plain JSON values (round-trips through :func:`json.dumps`).
    """
    if dataclasses.is_dataclass(settings) and not isinstance(settings, type):
        record = jsonable(settings)
    elif isinstance(settings, Mapping):
        record = jsonable(dict(settings))
    else:
        raise TypeError(
            f"`settings` must be a dataclass instance or a mapping, got "
            f"{type(settings).__name__}; wrap the values in a dataclass."
        )
    if packages is not None:
        record[VERSIONS_KEY] = package_versions(packages)
    return record


def settings_from_record(cls: type, record: Mapping[str, Any], *, what: str = "settings") -> Any:
    """Rebuild a settings dataclass from a record (``"versions"`` ignored).

    Unknown fields are an error naming the allowed ones, so that a record
    written by a newer version is not silently misread.

    Args:
        cls: the dataclass.
        record: its record (from :func:`settings_record` or JSON).
        what: what the record holds, for the message.
    """
    known = {f.name for f in dataclasses.fields(cls)}
    data = {k: v for k, v in record.items() if k != VERSIONS_KEY}
    unknown = sorted(set(data) - known)
    if unknown:
        raise SettingsMismatchError(
            f"`record` has unknown {what} fields {unknown} that {cls.__name__} does not know; "
            f"allowed fields are {sorted(known)}. Was it written by a newer gradsketch?"
        )
    return cls(**data)


def settings_diff(
    stored: Mapping[str, Any],
    requested: Mapping[str, Any],
    *,
    ignore: Iterable[str] = (VERSIONS_KEY,),
) -> list[str]:
    """Fields whose values differ, one line each with both values.

    Values are compared in their JSON form, so ``(1, 2)`` equals ``[1, 2]``.
    Fields present on one side only count as differences (shown as
    ``<missing>``).
    """
    skip = set(ignore)
    lines = []
    for key in sorted((set(stored) | set(requested)) - skip):
        a = jsonable(stored.get(key, "<missing>"))
        b = jsonable(requested.get(key, "<missing>"))
        if a != b:
            lines.append(f"{key}: stored {a!r}, requested {b!r}")
    return lines


def require_same_settings(
    stored: Mapping[str, Any],
    requested: Mapping[str, Any],
    *,
    where: str,
    ignore: Iterable[str] = (VERSIONS_KEY,),
) -> None:
    """Raise :class:`SettingsMismatchError` listing every difference, with both values.

    Args:
        stored: the record found on disk.
        requested: the record of the current run.
        where: what holds the stored record (shown in the message).
        ignore: fields never compared (package versions by default).
    """
    diffs = settings_diff(stored, requested, ignore=ignore)
    if diffs:
        raise SettingsMismatchError(
            f"{where} was written with different settings:\n  "
            + "\n  ".join(diffs)
            + "\nUse another directory for the new settings, delete the old results, or "
            "rerun with the stored settings."
        )


def write_record(path: str | Path, record: Mapping[str, Any]) -> None:
    """Write a record as indented, key-sorted JSON (atomically: temp file + rename)."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(jsonable(dict(record)), indent=2, sort_keys=True) + "\n")
    tmp.replace(target)


def read_record(path: str | Path, *, fix: str | None = None) -> dict[str, Any]:
    """Read a record written by :func:`write_record`.

    Args:
        path: the JSON file.
        fix: how to recover when the file is damaged (shown in the message).

    Raises:
        StoreIntegrityError: the file is not valid JSON (truncated or garbled
            outside gradsketch, which writes records atomically).
    """
    try:
        data = json.loads(Path(path).read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StoreIntegrityError(
            f"the record `{path}` is damaged (not valid JSON: {exc}). gradsketch writes records "
            "atomically, so it was truncated or changed outside gradsketch. Fix: "
            + (fix or "delete the directory that holds it and rerun to recompute its contents.")
        ) from exc
    if not isinstance(data, dict):
        raise SettingsMismatchError(
            f"`{path}` does not hold a settings record (a JSON object), got "
            f"{type(data).__name__}; delete the file or point at the right directory."
        )
    return data
