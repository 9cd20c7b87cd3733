"""The TRAKer store's records: settings, fingerprints, checkpoint and experiment records.

Every method keeps the same records under ``save_dir`` (names in
:mod:`~gradsketch.attribution._layout`): ``settings.json`` (a
:class:`TRAKSettings`), one record per checkpoint (its weights'
fingerprint, whether it is finalized), one per experiment (its number of
targets, per-token or not) and one per finished score matrix.
:class:`TRAKRecords` reads and writes them, and checks stored rows before
they are used.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from gradsketch._checks import positive_int
from gradsketch._distributed import all_gather_object
from gradsketch._hash import architecture_digest, state_digest
from gradsketch._integrity import ChunkDamage, damage_message
from gradsketch._settings import VERSIONS_KEY, package_versions, read_record, write_record
from gradsketch._store import SETTINGS_FILE, RowStore
from gradsketch.attribution import _layout as layout
from gradsketch.attribution._distributed import owned_mask, rank_and_world, rank_zero_first
from gradsketch.attribution._kronecker_features import CURVATURES
from gradsketch.errors import ModelIDException, SettingsMismatchError, StoreIntegrityError
from gradsketch.sketch import NoOpProjector


@dataclass
class TRAKSettings:
    """What determines the stored rows; saved as ``settings.json`` in ``save_dir``.

    Attributes:
        train_set_size: number of training rows n.
        proj_dim: feature dimension k (``method="replay"``: n, the width of
            its rows, one metagradient per training row).
        projector: the projector's fingerprint (without the checkpoint id).
        model: fingerprint of the architecture (parameter names, shapes, dtypes).
        task: the model output class.
        grad_wrt: differentiated parameters (``None``: all).
        dtype: storage dtype of features.
        normalize: features are divided by ``sqrt(num_coordinates)``.
        method: the preconditioner (``"trak"``, ``"identity"``, ``"kfac"``,
            ``"ekfac"`` or a registered one), or ``"replay"``.
        curvature: whose second moment per-layer curvature is (``"loss"``,
            ``"output"``, ``"sampled"``).
        sample_seed: seed of the labels drawn for ``curvature="sampled"``.
        layers: the factored layers whose features are stored (per-layer methods).
        replay: ``method="replay"``: the run's
            :meth:`~gradsketch.attribution.ReplaySettings.record` (else ``None``,
            and absent from the record).
        rows: ``"stored"`` or ``"recompute"`` (absent from the record where
            ``"stored"``: stores made before the option keep their fingerprint).
    """

    train_set_size: int
    proj_dim: int
    projector: dict[str, Any] = field(default_factory=dict)
    model: str = ""
    task: str = ""
    grad_wrt: list[str] | None = None
    dtype: str = "float32"
    normalize: float = 1.0
    method: str = "trak"
    curvature: str = "loss"
    sample_seed: int = 0
    layers: list[str] = field(default_factory=list)
    replay: dict[str, Any] | None = None
    rows: str = "stored"

    def __post_init__(self) -> None:
        for name in ("train_set_size", "proj_dim"):
            value = getattr(self, name)
            positive_int(name, value)
        if self.dtype not in ("float16", "float32", "float64"):
            raise ValueError(
                f"`dtype` must be 'float16', 'float32' or 'float64', got {self.dtype!r}."
            )
        if self.curvature not in CURVATURES:
            raise ValueError(
                f"`curvature` must be one of {list(CURVATURES)}, got {self.curvature!r}."
            )

    def record(self) -> dict[str, Any]:
        """The JSON record (``replay`` only where set: older stores have no such field)."""
        record = asdict(self)
        if record["replay"] is None:
            del record["replay"]
        if record["rows"] == "stored":
            del record["rows"]
        return record


def model_fingerprint(model: nn.Module) -> str:
    """Hash of the architecture: parameter and buffer names, shapes and dtypes."""
    return architecture_digest(model)


def checkpoint_fingerprint(state: Mapping[str, Any]) -> str:
    """Hash of a checkpoint's values (so a model id cannot silently change weights)."""
    return state_digest(state)


def projector_record(projector: Any, grad_dim: int) -> dict[str, Any]:
    """A flat projector's fingerprint for :class:`TRAKSettings` (without the model id)."""
    if isinstance(projector, NoOpProjector):
        return {"kind": "noop", "input_dim": grad_dim, "output_dim": grad_dim}
    fp = getattr(projector, "fingerprint", None)
    if fp is None:
        return {
            "kind": type(projector).__name__,
            "proj_dim": int(projector.proj_dim),
            "seed": int(getattr(projector, "seed", -1)),
        }
    record = fp.to_dict()
    record.pop("model_id", None)
    return record


def atomic_save(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    """``np.savez`` to a hidden temporary file, then rename: a kill never leaves a torn file."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)  # type: ignore[arg-type]
    os.replace(tmp, path)


#: Files of the replay's own layout (gradsketch 0.1.0 before issue 46).
_OLD_REPLAY_RUN = "replay_run.json"


def refuse_old_replay_store(save_dir: Path) -> None:
    """Refuse a store in the replay's former layout, naming its version and the fix.

    Raises:
        SettingsMismatchError: ``save_dir`` holds a method="replay" settings
            record without ``proj_dim`` (that layout's own record).
    """
    settings = save_dir / SETTINGS_FILE
    if not settings.exists():
        return
    try:
        stored = read_record(settings)
    except (StoreIntegrityError, SettingsMismatchError):
        return  # a damaged record is judged by the store (from its arrays' fingerprints)
    if stored.get("method") != "replay" or "proj_dim" in stored:
        return
    version = (stored.get(VERSIONS_KEY) or {}).get("gradsketch") or "an earlier version"
    current = package_versions(("gradsketch",))["gradsketch"]
    raise SettingsMismatchError(
        f"`{save_dir}` holds a method='replay' store written by gradsketch {version} in the "
        f"replay's former layout (`{_OLD_REPLAY_RUN}`, scores under `replay/<exp_name>`); "
        f"gradsketch {current} keeps the replay's rows in the TRAKer layout every method "
        "shares, and does not read the former one. Fix: pass another "
        "save_dir (this one is left as it is), or read its scores with "
        f"ReplayAttributor(..., save_dir='{save_dir / 'replay'}').finalize_scores(exp_name)."
    )


def require_all_rows(model_id: int, done: np.ndarray, why: str = "") -> None:
    """Refuse a checkpoint whose training rows are not all featurized."""
    if done.all():
        return
    missing = np.flatnonzero(~done)
    raise ModelIDException(
        f"model id {model_id} is not fully featurized: {missing.size} of {done.size} rows "
        f"missing (first: {missing[:5].tolist()}).{why} Featurize them, then finalize."
    )


class TRAKRecords:
    """The records of a TRAKer store and the checks of its stored rows.

    Args:
        save_dir: the store's directory (created if missing).
        settings: the run's :class:`TRAKSettings`; a store written with
            others is refused with both shown.
        logger: where repairs are reported.
    """

    def __init__(self, save_dir: Path, settings: TRAKSettings, logger: logging.Logger) -> None:
        if save_dir.exists() and not save_dir.is_dir():
            raise NotADirectoryError(
                f"`save_dir`={str(save_dir)!r} is a file, not a directory; pass the path of a "
                "directory (it is created if missing)."
            )
        refuse_old_replay_store(save_dir)
        self.save_dir = save_dir
        self.logger = logger
        # Rank 0 writes the settings record; the others then compare with it.
        with rank_zero_first():
            self.store = RowStore(save_dir, settings.record(), what="TRAK store")

    # -- checkpoints ------------------------------------------------------------------
    def checkpoint(self, model_id: int) -> dict[str, Any]:
        """The record of checkpoint ``model_id`` (``{}`` when there is none)."""
        path = self.save_dir / layout.checkpoint_record(model_id)
        fix = (
            "delete that file and rerun: load_checkpoint writes it again, the stored rows are "
            "checked and kept, and finalize_features runs again."
        )
        return read_record(path, fix=fix) if path.exists() else {}

    def write_checkpoint(self, model_id: int, record: Mapping[str, Any]) -> None:
        """Write the record of checkpoint ``model_id``."""
        path = self.save_dir / layout.checkpoint_record(model_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_record(path, record)

    def update_checkpoint(self, model_id: int, **fields: Any) -> None:
        """Set ``fields`` in the record of checkpoint ``model_id``."""
        self.write_checkpoint(model_id, {**self.checkpoint(model_id), **fields})

    @property
    def model_ids(self) -> list[int]:
        """Checkpoints present in the store."""
        return layout.checkpoint_ids(self.save_dir)

    def claim_checkpoint(self, model_id: int, sha: str) -> dict[str, Any]:
        """The record of ``model_id``, made for weights ``sha`` if new.

        Raises:
            SettingsMismatchError: ``model_id`` was featurized from other weights.
        """
        record = self.checkpoint(model_id)
        if record and record.get("checkpoint") != sha:
            raise SettingsMismatchError(
                f"model id {model_id} in `{self.save_dir}` was featurized from a checkpoint "
                f"with fingerprint {record.get('checkpoint')!r}, but the given checkpoint has "
                f"{sha!r}. Use a new model_id for new weights, or another save_dir."
            )
        if not record:
            record = {"checkpoint": sha, "finalized": False}
            self.write_checkpoint(model_id, record)
        return record

    def finalized(self, model_id: int) -> dict[str, Any]:
        """The record of ``model_id``, which must be finalized."""
        record = self.checkpoint(model_id)
        if not record.get("finalized"):
            raise ModelIDException(
                f"model id {model_id} is not finalized in `{self.save_dir}`; call "
                "finalize_features() first."
            )
        return record

    # -- experiments and scores --------------------------------------------------------
    def open_experiment(self, exp_name: str, num_targets: int, per_token: bool) -> None:
        """Create experiment ``exp_name``, or check that it has these settings.

        Raises:
            SettingsMismatchError: ``exp_name`` exists with another ``num_targets``
                or ``per_token``.
        """
        path = self.save_dir / layout.experiment_record(exp_name)
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            requested: dict[str, Any] = {"num_targets": num_targets}
            if per_token:
                requested["per_token"] = True
            write_record(path, requested)
            return
        stored = read_record(path)
        for key, value, was in (
            ("num_targets", num_targets, stored.get("num_targets")),
            ("per_token", bool(per_token), bool(stored.get("per_token", False))),
        ):
            if was != value:
                raise SettingsMismatchError(
                    f"experiment {exp_name!r} in `{self.save_dir}` has {key}={was}, requested "
                    f"{value}. Use a new exp_name."
                )

    def experiment(self, exp_name: str) -> dict[str, Any]:
        """The record of experiment ``exp_name``."""
        path = self.save_dir / layout.experiment_record(exp_name)
        if not path.exists():
            raise ValueError(
                f"experiment {exp_name!r} does not exist in `{self.save_dir}`; start it with "
                "start_scoring_checkpoint(...) and score targets first."
            )
        return read_record(path)

    def write_scores(self, exp_name: str, record: Mapping[str, Any]) -> None:
        """Write the record of the finished scores of ``exp_name``."""
        path = self.save_dir / layout.scores_record(exp_name)
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(dict(record)) + "\n")

    # -- stored rows -------------------------------------------------------------------
    def _damaged(
        self, done: str, arrays: list[str], only: np.ndarray | None = None
    ) -> tuple[list[ChunkDamage], np.ndarray]:
        """The damaged chunks and all their rows, unflagged in ``done`` for recomputation.

        ``only``: a boolean mask of the rows to check (``None``: every row).
        """
        found = self.store.unflag_damaged(arrays, done, only) if arrays else []
        rows = np.unique(np.array([r for d in found for r in d.rows], dtype=np.int64))
        return found, rows

    def _report(self, found: list[ChunkDamage], what: str, fix: str) -> str:
        """One message naming each damaged array, its rows, chunks and files, then ``fix``."""
        return damage_message(
            found,
            what=f"{what}: stored rows are missing or damaged in `{self.save_dir}`",
            fix=fix,
            by_rows=True,
        )

    def repair_rows(self, model_id: int, arrays: list[str]) -> np.ndarray:
        """Unflag training rows whose stored data are missing or damaged; returns them."""
        found, rows = self._damaged(layout.checkpoint_array(model_id, "done"), arrays)
        if rows.size:
            self.logger.warning(
                "%s",
                self._report(
                    found,
                    f"model id {model_id}",
                    f"These {rows.size} row(s) were unflagged and are featurized again.",
                ),
            )
        return rows

    def require_intact_rows(self, model_id: int, arrays: list[str]) -> None:
        """Refuse (and unflag) training rows of ``model_id`` that are missing or damaged.

        Each phase calls it before reading the rows; the store reads only the
        chunks it has not found intact before or whose files changed since
        (:meth:`gradsketch._store.RowStore.damage`), so a second phase of the same
        TRAKer does not read the whole ``[n, k]`` store twice. Under
        ``torch.distributed`` (collective: every rank calls it) each rank reads
        the chunks of its own :func:`~gradsketch.attribution.chunk_shard` and
        every rank refuses, with every rank's findings, where any finds damage.
        """
        done = layout.checkpoint_array(model_id, "done")
        only = None
        if arrays and rank_and_world()[1] > 1:
            # Each rank checks the chunks of its own shard, and the ranks agree: every
            # chunk is read once per phase, as in one process, not once per rank.
            flags = self.store.array(done)
            only = owned_mask(int(flags.shape[0]), int(flags.chunks[0]))
        found, rows = self._damaged(done, arrays, only)
        message = None
        if rows.size:
            message = self._report(
                found,
                f"model id {model_id}",
                f"They were unflagged: call load_checkpoint(<its state dict>, "
                f"model_id={model_id}) and featurize again (only these rows are "
                "recomputed), then finalize_features().",
            )
        problems = [m for m in all_gather_object(message) if m is not None]
        if problems:
            raise StoreIntegrityError("\n".join(problems))

    def require_intact_targets(self, exp_name: str, model_id: int) -> None:
        """Refuse (and unflag) target rows of ``exp_name`` that are missing or damaged."""
        target = functools.partial(layout.target_array, exp_name, model_id)
        arrays = [a for a in (target("grads"), target("token_grads")) if self.store.has(a)]
        found, rows = self._damaged(target("done"), arrays)
        if rows.size:
            raise StoreIntegrityError(
                self._report(
                    found,
                    f"experiment {exp_name!r}, model id {model_id}",
                    f"They were unflagged: call start_scoring_checkpoint({exp_name!r}, <its state "
                    f"dict>, model_id={model_id}, ...) and score the targets again (only these "
                    "rows are recomputed), then finalize_scores().",
                )
            )

    def read_state(
        self, model_id: int, keys: Sequence[str]
    ) -> tuple[dict[str, np.ndarray] | None, str | None]:
        """The finalized state arrays, or ``(None, reason)`` when one is missing or damaged."""
        state = {}
        for key in keys:
            name = layout.checkpoint_state(model_id, key)
            if not self.store.has(name):
                return None, f"`{self.save_dir / name}` is missing"
            try:
                value = np.asarray(self.store.array(name)[...])
            except (ValueError, OSError, StoreIntegrityError) as exc:
                return None, f"`{self.save_dir / name}` fails to read: {exc}"
            if value.dtype.kind == "f" and not np.isfinite(value).all():
                return None, f"`{self.save_dir / name}` holds NaN (a chunk is missing)"
            state[key] = value
        return state, None
