"""What a sample store must pass before its samples are read, resumed or judged.

Two promises, on :mod:`gradsketch._integrity`'s checks:

* **No estimate from a missing or damaged value.** Before a complete store
  is reused, or an interrupted one resumed, :func:`check_samples` checks
  every chunk of the chains flagged done in every array (and the arrays
  without a chain axis). A chain with a missing, bit-flipped or truncated
  chunk is unflagged and sampled again (its bits are the uninterrupted
  run's: a chain depends only on its seed), with a warning naming the
  array, chunk and file. Where the store cannot recompute (devinterp's
  stores, an array whose ``zarr.json`` is unreadable), the call refuses,
  naming the array, chunk, file and fix.
* **Settings are never forgotten.** Every array carries the settings record
  of the run that made it (:class:`~gradsketch.slt._schema.Arrays`). A store
  whose root ``zarr.json`` is unreadable, or holds no settings record, is
  judged by :func:`judge_without_root` from those records: refused with both
  settings when they differ, resumed when they match. Only a store that is
  provably empty (no chunk file anywhere: a kill while it was being
  created) is cleared and made again, under the store's lock.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from gradsketch._integrity import (
    ChunkDamage,
    damage_message,
    damaged_rows,
    holds_data,
    read_json,
    scan_array,
)
from gradsketch._settings import settings_diff
from gradsketch.errors import OutputPathMismatchError, StoreIntegrityError
from gradsketch.slt._schema import SETTINGS_ATTR, array

__all__ = ["check_samples", "judge_without_root"]

#: One logger for the whole of sample(): what a user sees is named after the entry point.
logger = logging.getLogger("gradsketch.slt._sample")

#: The done flags of a store, and which array each one vouches for.
CHAIN_FLAGS = "progress/chain_done"
INIT_FLAGS = "progress/init_done"


def _arrays(path: Path) -> dict[str, dict[str, Any] | None]:
    """``{array path: its zarr.json or None when unreadable}`` of every array in the store.

    An entry is an array when its ``zarr.json`` says so, or when it is
    unreadable but the directory holds chunks (``c/``): damage to report.
    """
    found: dict[str, dict[str, Any] | None] = {}
    for meta in sorted(path.rglob("zarr.json")):
        node = meta.parent
        if node == path:
            continue
        name = node.relative_to(path).as_posix()
        data, _ = read_json(meta)
        if data is not None and data.get("node_type") == "array":
            found[name] = data
        elif data is None and (node / "c").exists():
            found[name] = None
    return found


def _clear_empty(path: Path) -> None:
    """Remove the entries of a store that holds no chunk (checked by the caller, under the lock)."""
    logger.warning(
        "sample(): %s was created by an interrupted run before any sample was written (it "
        "holds no chunk); creating it again",
        path,
    )
    for entry in path.iterdir():
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def judge_without_root(path: Path, record: dict[str, Any], why: str) -> str:
    """``"new"`` or ``"resume"`` for a store whose root holds no readable settings; else refuse.

    Args:
        path: The store (its lock held).
        record: The settings record this call would write.
        why: What is wrong with the root (for the messages).

    Raises:
        OutputPathMismatchError: the arrays were made with other settings (both are shown),
            or the store holds samples whose settings no array records.
    """
    if not holds_data(path):
        _clear_empty(path)
        return "new"
    records: dict[str, dict[str, Any]] = {}
    for meta in _arrays(path).values():
        stored = (meta or {}).get("attributes", {}).get(SETTINGS_ATTR)
        if isinstance(stored, dict):
            records[json.dumps(stored, sort_keys=True, default=str)] = stored
    where = f"`output_path`={str(path)!r}"
    if not records:
        raise OutputPathMismatchError(
            f"{where} holds samples (chunk files) but its root {why}, and no array records the "
            "settings that made them (a store written before gradsketch recorded them per "
            "array, or not a sample store); nothing was deleted. Restore its root zarr.json, "
            "pass another output_path, or delete the store yourself if its samples are not "
            "needed."
        )
    if len(records) > 1:
        raise OutputPathMismatchError(
            f"{where}: its root {why}, and its arrays were made with {len(records)} different "
            "settings; nothing was deleted. Pass another output_path, or delete the store "
            "yourself if its samples are not needed."
        )
    (stored,) = records.values()
    if record.get("evaluate_observables", True) is False and stored.get(
        "evaluate_observables", True
    ):
        del record["evaluate_observables"]
    diffs = settings_diff(stored, record)
    if diffs:
        raise OutputPathMismatchError(
            f"{where} has a different sampler config (samples made with other settings, as "
            f"its arrays record; its root {why}):\n  "
            + "\n  ".join(diffs)
            + "\nNothing was deleted. Pass another output_path for the new settings, or rerun "
            "with the stored settings (which rewrites the root and resumes)."
        )
    root_meta = path / "zarr.json"
    logger.warning(
        "sample(): the root of %s %s; its arrays record this call's settings, so the root is "
        "written again and the run resumes (finished chains are kept and checked)",
        path,
        why,
    )
    root_meta.unlink(missing_ok=True)
    zarr.open_group(str(path), mode="a")
    return "resume"


def _read_flags(root: zarr.Group, path: Path, name: str, n: int) -> np.ndarray:
    """The done flags ``name`` (all False when missing or damaged: those chains are redone)."""
    damage = scan_array(path, name)
    if damage:
        if not damage[0].chunk:
            raise StoreIntegrityError(
                damage_message(
                    damage,
                    what=f"the sample store `{path}` has damaged done flags",
                    fix=f"Delete the directory `{path / name}` and rerun with the same "
                    "arguments: every chain is sampled again.",
                )
            )
        logger.warning(
            "%s; every chain they flag is sampled again",
            damage_message(damage, what=f"sample(): {path}: done flags damaged", fix=""),
        )
        array(root, name)[...] = np.zeros(n, dtype=np.uint8)
        return np.zeros(n, dtype=bool)
    return np.asarray(array(root, name)[:], dtype=bool)


def check_samples(
    path: Path,
    state: str,
    *,
    num_chains: int,
    ours: bool,
    rewrites_ids: bool,
    expected: Sequence[str] = (),
) -> str:
    """``state``, or ``"resume"`` after unflagging chains with damaged chunks; else refuse.

    Checks every chunk of the chains flagged done (``init_loss``: flagged in
    ``progress/init_done``; every other chain array: ``progress/chain_done``)
    and every chunk of the arrays without a chain axis. A gradsketch store
    (``ours``) gets its damaged chains unflagged, so the run samples them
    again; ``input_ids_<obs>`` arrays are rewritten by the layout when
    ``rewrites_ids``. An ``expected`` array that is gone (its directory
    deleted) is made again by the layout, every chain with it.

    Raises:
        StoreIntegrityError: the damage cannot be recomputed here, naming each array, chunk,
            file and the fix.
    """
    arrays = _arrays(path)
    chains_done = init_done = np.ones(num_chains, dtype=bool)
    root = zarr.open_group(str(path), mode="r+" if ours else "r")
    if ours:
        chains_done = _read_flags(root, path, CHAIN_FLAGS, num_chains)
        init_done = _read_flags(root, path, INIT_FLAGS, num_chains)
    damage: list[ChunkDamage] = []
    redo: set[int] = set()
    redo_init: set[int] = set()
    fixable = ours
    for name, meta in arrays.items():
        if name in (CHAIN_FLAGS, INIT_FLAGS):
            continue
        by_chain = meta is not None and (meta.get("dimension_names") or [None])[0] == "chain"
        flags = init_done if name == "init_loss" else chains_done
        # devinterp's writer may skip chunks that hold only NaN: there, only decoding counts.
        rows = np.flatnonzero(flags) if by_chain else None
        found = scan_array(path, name, rows=rows, missing=ours)
        damage.extend(found)
        if any(not d.chunk for d in found):
            fixable = False  # unreadable metadata: the array cannot be written here
        elif found and by_chain:
            (redo_init if name == "init_loss" else redo).update(damaged_rows(found, num_chains))
        elif found and not (name.startswith("input_ids_") and rewrites_ids):
            fixable = False
    gone = [name for name in expected if name not in arrays] if ours else []
    if gone:
        logger.warning(
            "sample(): %s lacks the arrays %s; they are made again, and every chain with them",
            path,
            gone,
        )
        if any(not name.startswith("input_ids_") for name in gone):
            redo.update(range(num_chains))
        if "init_loss" in gone:
            redo_init.update(range(num_chains))
    if not damage and not gone:
        return state
    if not fixable:
        fix = (
            "Delete each named array's directory and rerun with the same arguments: the "
            "chains are sampled again (finished ones are kept where intact)."
            if ours
            else "Rerun devinterp's sample for this store, or pass another output_path to "
            "sample it with gradsketch."
        )
        raise StoreIntegrityError(
            damage_message(
                damage, what=f"the sample store `{path}` has missing or damaged data", fix=fix
            )
        )
    again = sorted(redo | redo_init)
    if damage:
        redone = f"Sampling chains {again} again (the bits of the first run)."
        logger.warning(
            "%s",
            damage_message(
                damage,
                what=f"sample(): {path} has missing or damaged chunks",
                fix=redone if again else "Writing them again.",
            ),
        )
    for name, chains in ((CHAIN_FLAGS, redo), (INIT_FLAGS, redo_init)):
        if chains:
            rows = np.array(sorted(chains), dtype=np.int64)
            array(root, name).oindex[rows] = np.zeros(rows.size, dtype=np.uint8)
    root.update_attributes({"completed": 0})
    return "resume"
