"""``TRAKer(method="replay")``: MAGIC's metagradient scores behind TRAKer's calls.

The TRAK loop keeps its shape; only what each call means changes:

- ``load_checkpoint(state, model_id)``: the weights the run *starts* from
  (one run, one model id);
- ``featurize`` / ``featurize_loader``: the training rows, kept in memory;
- ``finalize_features``: trains the run (:meth:`ReplayAttributor.train`);
- ``start_scoring_checkpoint`` / ``score`` / ``score_loader``: the queries;
- ``finalize_scores`` / ``topk``: the exact metagradients ``∂f_j(θ_T)/∂w_i``
  of :meth:`ReplayAttributor.score`, stored under ``save_dir/replay/<exp_name>``
  (resumable: finished queries are read back; other settings, data, order,
  initialization or queries refused).

Arguments of :class:`TRAKer` that belong to projected or preconditioned
features (``proj_dim``, ``lambda_reg``, ``projector``, ...) are refused
unless left at their defaults: the metagradient projects and inverts nothing.
"""

from __future__ import annotations

import inspect
import logging
import shutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from gradsketch._checks import positive_int
from gradsketch._device import exact_device
from gradsketch._settings import SettingsMismatchError, read_record, write_record
from gradsketch._store import RowStore
from gradsketch.attribution._integrity import check_weights
from gradsketch.attribution._lm_data import as_loader, as_task_batch
from gradsketch.attribution._modelout import resolve_task
from gradsketch.attribution._replay import ReplayAttributor, ReplaySettings
from gradsketch.attribution._topk import TopK, TopKCollector
from gradsketch.attribution._traker import (
    ModelIDException,
    TRAKer,
    _batch_rows,
    _check_per_token,
    checkpoint_fingerprint,
    model_fingerprint,
)

#: TRAKer arguments the replay uses; every other one must keep its default.
_USED = frozenset(
    {
        "self",
        "model",
        "task",
        "train_set_size",
        "save_dir",
        "load_from_save_dir",
        "device",
        "logging_level",
        "memory_budget",
        "progress",
        "method",
        "replay",
    }
)

#: Why an argument cannot apply (shown in the refusal).
WHY_NOT_USED = {
    "proj_dim": "the metagradient is exact, nothing is projected",
    "projector": "the metagradient is exact, nothing is projected",
    "projector_seed": "the metagradient is exact, nothing is projected",
    "proj_max_batch_size": "the metagradient is exact, nothing is projected",
    "lambda_reg": "the metagradient inverts no curvature, so there is nothing to damp",
    "score_computer": "scores come from the reverse pass through training, not a kernel",
    "gradient_computer": "the replay differentiates the whole training run itself",
    "grad_wrt": "the replay trains, and so differentiates, every parameter",
    "mask": "the replay trains, and so differentiates, every parameter",
    "curvature": "no curvature is fitted",
    "projection": "nothing is projected",
    "sample_seed": "no labels are sampled",
    "use_half_precision": "the replay runs in the model's own dtype",
    "dtype": "the replay runs in the model's own dtype (scores are stored in float64)",
    "chunk_rows": "scores are stored one query per row",
    "precision": "scores come from the reverse pass, not a GEMM",
    "saver": "scores are stored in the replay's store under `save_dir`",
}

_ONE_RUN = (
    "the replay attributes through one training run, which starts from the checkpoint of "
    "one model id; average several runs' scores yourself, or use one TRAKer per run "
    "(each with its own save_dir)"
)


def _keep_rows(
    columns: list[Tensor] | None,
    batch: Sequence[Tensor],
    rows: Tensor,
    n: int,
    what: str,
    fix: str,
) -> list[Tensor]:
    """Write ``batch`` into ``rows`` of ``columns`` (``n`` rows each, zeros until written).

    ``columns`` is None before the first batch: it is allocated from that
    batch's shapes and dtypes. ``fix`` ends the error of a batch whose
    per-row shape differs from the earlier ones.
    """
    if columns is None:
        columns = [t.new_zeros((n, *t.shape[1:])) for t in batch]
    for j, (col, t) in enumerate(zip(columns, batch, strict=True)):
        if col.shape[1:] != t.shape[1:]:
            raise ValueError(
                f"{what}: column {j} has shape {tuple(t.shape[1:])} per row, earlier batches "
                f"{tuple(col.shape[1:])}; {fix}."
            )
        col[rows] = t.to(col.device, col.dtype)
    return columns


class ReplayTRAKer(TRAKer):
    """The replay behind :class:`TRAKer`'s calls; made by ``TRAKer(..., method="replay")``.

    Args:
        replay: how the run trains: a :class:`ReplaySettings` (the training
            rows come from ``featurize``), or a :class:`ReplayAttributor`
            built on the same ``model`` (its rows, order and loss are used;
            ``featurize`` then checks the rows it is given against them).

    Other arguments as :class:`TRAKer`; see the module docstring for what
    each call does.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = inspect.signature(TRAKer.__init__).bind(self, *args, **kwargs)
        params = inspect.signature(TRAKer.__init__).parameters
        for name, value in bound.arguments.items():
            if name in _USED:
                continue
            default = params[name].default
            if value is not default and value != default:
                raise ValueError(
                    f"`{name}`={value!r} does not apply to method='replay' "
                    f"({WHY_NOT_USED.get(name, 'the replay does not use it')}); leave it at its "
                    f"default ({default!r})."
                )
        bound.apply_defaults()
        a = bound.arguments
        self.logger = logging.getLogger("gradsketch.attribution.TRAKer")
        self.logger.setLevel(a["logging_level"])
        self.method = "replay"
        model, replay = a["model"], a["replay"]
        if not isinstance(model, nn.Module):
            raise TypeError(f"`model` must be a torch.nn.Module, got {type(model).__name__}.")
        self.model = model
        self.task = resolve_task(a["task"])
        positive_int("train_set_size", a["train_set_size"])
        self.train_set_size = n = int(a["train_set_size"])
        if isinstance(replay, ReplayAttributor):
            if replay.model is not model:
                raise ValueError(
                    "`replay` is a ReplayAttributor of another model; build it on the `model` "
                    "given to the TRAKer (or pass a ReplaySettings)."
                )
            if replay.n_train != n:
                raise ValueError(
                    f"`replay` trains on {replay.n_train} rows but `train_set_size`={n}; give "
                    "the TRAKer the replay's training-set size."
                )
            if type(replay.task) is not type(self.task):
                raise ValueError(
                    f"`replay` has task {type(replay.task).__name__} but `task` is "
                    f"{type(self.task).__name__}; give both the same task."
                )
            settings = replay.settings
        elif isinstance(replay, ReplaySettings):
            settings = replay
        else:
            raise TypeError(
                "method='replay' needs `replay`: a ReplaySettings (how the run trains: "
                "optimizer, lr, num_steps, batch_size, seed, ...) or a ReplayAttributor; got "
                f"{type(replay).__name__}."
            )
        self._attributor: ReplayAttributor | None = (
            replay if isinstance(replay, ReplayAttributor) else None
        )
        self.replay_settings = settings
        ref = next(model.parameters(), None)
        device = a["device"]
        if device is not None and ref is not None and exact_device(device) != ref.device:
            raise ValueError(
                f"`device`={device!r} but the model's parameters are on {ref.device}; the "
                "replay trains where the model is. Move the model, or pass device=None."
            )
        self.device = ref.device if ref is not None else torch.device("cpu")
        self.memory_budget = a["memory_budget"]
        self.progress = bool(a["progress"])
        self.load_from_save_dir = bool(a["load_from_save_dir"])
        self.save_dir = Path(a["save_dir"]).resolve()
        if self.save_dir.exists() and not self.save_dir.is_dir():
            raise NotADirectoryError(
                f"`save_dir`={str(a['save_dir'])!r} is a file, not a directory; pass the path "
                "of a directory (it is created if missing)."
            )
        self.record: dict[str, Any] = {
            "method": "replay",
            "train_set_size": n,
            "model": model_fingerprint(model),
            "task": type(self.task).__name__,
            "replay": settings.record(),
        }
        self.store = RowStore(self.save_dir, self.record, what="TRAK store")
        self._columns: list[Tensor] | None = None
        self._have: np.ndarray = np.zeros(n, dtype=bool)
        self._last_ind = 0
        self.ckpt_loaded: int | None = None
        self._exp: str | None = None
        self._targets: list[Tensor] | None = None
        self._target_have: np.ndarray | None = None
        self._last_ind_target = 0
        self._cleared: set[str] = set()
        self.scores: Any = None

    # -- the run ------------------------------------------------------------------
    @property
    def _run_record(self) -> Path:
        return self.save_dir / "replay_run.json"

    @property
    def model_ids(self) -> list[int]:
        """The run's model id (at most one)."""
        if not self._run_record.exists():
            return []
        return [int(read_record(self._run_record)["model_id"])]

    def _check_run(self, checkpoint: Mapping[str, Any], model_id: int, call: str) -> str:
        check_weights(checkpoint, model_id)
        sha = checkpoint_fingerprint(checkpoint)
        if self._run_record.exists():
            stored = read_record(self._run_record)
            if int(stored["model_id"]) != int(model_id):
                raise ModelIDException(
                    f"{call}: `model_id`={model_id} but `{self.save_dir}` holds the run of model "
                    f"id {stored['model_id']}; {_ONE_RUN}."
                )
            if stored["checkpoint"] != sha:
                raise SettingsMismatchError(
                    f"{call}: model id {model_id} in `{self.save_dir}` starts from a checkpoint "
                    f"with fingerprint {stored['checkpoint']!r}, but the given one has {sha!r}. "
                    "Pass the checkpoint the run starts from (the one given to load_checkpoint), "
                    "or use another save_dir."
                )
        return sha

    def load_checkpoint(self, checkpoint: Mapping[str, Any], model_id: int) -> None:
        """Load the weights the replayed run starts from (one run: one model id).

        Raises:
            ModelIDException: another model id was loaded before.
            SettingsMismatchError: ``model_id`` started from other weights.
        """
        sha = self._check_run(checkpoint, model_id, "load_checkpoint")
        if self._attributor is not None:
            own = checkpoint_fingerprint(self._attributor.params0)
            params = {k: v for k, v in checkpoint.items() if k in self._attributor.params0}
            if checkpoint_fingerprint(params) != own:
                raise SettingsMismatchError(
                    "load_checkpoint: the checkpoint's parameters differ from the initialization "
                    "of the given ReplayAttributor; pass the state the attributor was built from "
                    "(model.state_dict() before building it)."
                )
        self.model.load_state_dict(checkpoint)
        if not self._run_record.exists():
            write_record(self._run_record, {"model_id": int(model_id), "checkpoint": sha})
        self.ckpt_loaded = int(model_id)
        self._last_ind = 0

    def featurize(
        self, batch: Sequence[Tensor], inds: Any = None, num_samples: int | None = None
    ) -> None:
        """Keep a batch of training rows (with a ReplayAttributor: check them against its rows)."""
        if self.ckpt_loaded is None:
            raise ModelIDException(
                "no checkpoint loaded; call traker.load_checkpoint(state_dict, model_id) with the "
                "weights the run starts from before featurize."
            )
        n = self.train_set_size
        batch, idx = _batch_rows(
            self.task, batch, inds, num_samples, self._last_ind, n, "featurize", self.device
        )
        if num_samples is not None:
            self._last_ind += int(num_samples)
        rows = torch.as_tensor(idx)
        if self._attributor is not None:
            for j, (given, own) in enumerate(zip(batch, self._attributor.data, strict=True)):
                if not torch.equal(given.to(own.device), own[rows.to(own.device)]):
                    raise ValueError(
                        f"featurize: column {j} of rows {idx[:5].tolist()}... differs from the "
                        "ReplayAttributor's training rows; feed the rows in the attributor's "
                        "order (or pass a ReplaySettings and let featurize give the rows)."
                    )
            self._have[idx] = True
            return
        self._columns = _keep_rows(
            self._columns,
            batch,
            rows,
            n,
            "featurize",
            "pad every batch to one length (the replay trains on one tensor per column)",
        )
        self._have[idx] = True

    def featurize_loader(self, loader: Iterable[Any], *, batch_size: int = 16) -> None:
        """Keep every batch of ``loader`` in order (any form ``featurize_loader`` takes)."""
        for raw in as_loader(loader, self.task, batch_size):
            batch = as_task_batch(self.task, raw)
            self.featurize(batch, num_samples=int(batch[0].shape[0]))

    def finalize_features(
        self, model_ids: Iterable[int] | None = None, del_grads: bool = False
    ) -> None:
        """Train the replayed run (a given, trained ReplayAttributor is used as it is)."""
        if del_grads:
            raise ValueError(
                "`del_grads`=True does not apply to method='replay' (no features are stored); "
                "pass del_grads=False."
            )
        ids = self.model_ids if model_ids is None else [int(i) for i in model_ids]
        if len(ids) != 1 or (self.ckpt_loaded is not None and ids != [self.ckpt_loaded]):
            raise ModelIDException(
                f"finalize_features: `model_ids`={ids} but the replay has one run (model id "
                f"{self.ckpt_loaded}); {_ONE_RUN}."
            )
        if self.ckpt_loaded is None:
            raise ModelIDException(
                "no checkpoint loaded; call load_checkpoint(state_dict, model_id) and featurize "
                "the training rows before finalize_features."
            )
        if self._attributor is None:
            missing = np.flatnonzero(~self._have)
            if missing.size:
                raise ModelIDException(
                    f"model id {self.ckpt_loaded} is not fully featurized: {missing.size} of "
                    f"{self.train_set_size} rows missing (first: {missing[:5].tolist()}). The "
                    "replay trains on every row; featurize them, then finalize."
                )
            assert self._columns is not None
            self._attributor = ReplayAttributor(
                self.model,
                self.task,
                tuple(self._columns),
                self.replay_settings,
                save_dir=self.save_dir / "replay",
                memory_budget=self.memory_budget,
                progress=self.progress,
            )
        elif self._attributor.save_dir is None:
            self._attributor.save_dir = self.save_dir / "replay"
        if self._attributor.final is None:
            self._attributor.train()

    @property
    def attributor(self) -> ReplayAttributor:
        """The :class:`ReplayAttributor` of the run (after :meth:`finalize_features`)."""
        if self._attributor is None or self._attributor.final is None:
            raise ModelIDException(
                "the run is not trained yet; featurize the training rows and call "
                "finalize_features() first."
            )
        return self._attributor

    # -- queries ------------------------------------------------------------------
    def start_scoring_checkpoint(
        self,
        exp_name: str,
        checkpoint: Mapping[str, Any],
        model_id: int,
        num_targets: int,
        *,
        per_token: bool = False,
    ) -> None:
        """Start experiment ``exp_name`` of ``num_targets`` queries.

        ``checkpoint`` is the run's starting checkpoint (the one given to
        :meth:`load_checkpoint`): the queries are scored at the parameters
        the replay trains from it.
        """
        if not exp_name or "/" in exp_name:
            raise ValueError(f"`exp_name` must be a non-empty name without '/', got {exp_name!r}.")
        positive_int("num_targets", num_targets)
        self._check_run(checkpoint, model_id, "start_scoring_checkpoint")
        _check_per_token(self.task, per_token)
        rec_path = self.save_dir / "experiments" / f"{exp_name}.json"
        requested = {"num_targets": int(num_targets), "per_token": bool(per_token)}
        if rec_path.exists():
            stored = read_record(rec_path)
            for key, value in requested.items():
                if stored.get(key) != value:
                    raise SettingsMismatchError(
                        f"experiment {exp_name!r} in `{self.save_dir}` has {key}="
                        f"{stored.get(key)!r}, requested {value!r}. Use a new exp_name."
                    )
        else:
            rec_path.parent.mkdir(parents=True, exist_ok=True)
            write_record(rec_path, requested)
        if not self.load_from_save_dir and exp_name not in self._cleared:
            shutil.rmtree(self.save_dir / "replay" / exp_name, ignore_errors=True)
            self._cleared.add(exp_name)
        self._exp, self._num_targets = exp_name, int(num_targets)
        self._targets, self._target_have = None, np.zeros(num_targets, dtype=bool)
        self._last_ind_target = 0

    def score(
        self, batch: Sequence[Tensor], inds: Any = None, num_samples: int | None = None
    ) -> None:
        """Keep a batch of queries of the current experiment."""
        if self._exp is None or self._target_have is None:
            raise ModelIDException(
                "no scoring checkpoint; call traker.start_scoring_checkpoint(...) before score."
            )
        m = self._num_targets
        batch, idx = _batch_rows(
            self.task, batch, inds, num_samples, self._last_ind_target, m, "score", self.device
        )
        if num_samples is not None:
            self._last_ind_target += int(num_samples)
        self._targets = _keep_rows(
            self._targets,
            batch,
            torch.as_tensor(idx),
            m,
            "score",
            "pad every target to one length",
        )
        self._target_have[idx] = True

    def score_loader(self, loader: Iterable[Any], *, batch_size: int = 16) -> None:
        """Keep every batch of ``loader`` as queries, in order."""
        for raw in as_loader(loader, self.task, batch_size):
            batch = as_task_batch(self.task, raw)
            self.score(batch, num_samples=int(batch[0].shape[0]))

    def _experiment(self, exp_name: str) -> dict[str, Any]:
        rec_path = self.save_dir / "experiments" / f"{exp_name}.json"
        if not rec_path.exists():
            raise ValueError(
                f"experiment {exp_name!r} does not exist in `{self.save_dir}`; start it with "
                "start_scoring_checkpoint(...) and score targets first."
            )
        return read_record(rec_path)

    def _check_ids(self, model_ids: Iterable[int] | None) -> None:
        if model_ids is not None and [int(i) for i in model_ids] != self.model_ids:
            raise ModelIDException(
                f"`model_ids`={list(model_ids)} but the replay has one run (model ids "
                f"{self.model_ids}); {_ONE_RUN}."
            )

    def finalize_scores(
        self,
        exp_name: str,
        model_ids: Iterable[int] | None = None,
        allow_skip: bool = False,
        *,
        per_token: bool = False,
    ) -> Any:
        """The metagradient scores of ``exp_name``: ``[n, m]`` float64 numpy.

        Computed by :meth:`ReplayAttributor.score` (resumable in the store) and
        bit-identical to it. ``per_token=True`` (experiment started with
        ``per_token=True``): ``[n, m, T]``; without it such an experiment
        returns the sum over ``T``.
        """
        self._check_ids(model_ids)
        experiment = self._experiment(exp_name)
        if per_token and not experiment.get("per_token"):
            raise ValueError(
                f"experiment {exp_name!r} was not started with per_token=True; start a new one "
                "with start_scoring_checkpoint(..., per_token=True) to get per-token scores."
            )
        replay = self.attributor
        if self._exp == exp_name and self._targets is not None and self._target_have is not None:
            if not self._target_have.all():
                missing = np.flatnonzero(~self._target_have)
                raise ModelIDException(
                    f"experiment {exp_name!r} has {missing.size} of {self._num_targets} targets "
                    f"not scored yet (first: {missing[:5].tolist()}); score them first."
                )
            scores = replay.score(
                tuple(self._targets),
                exp_name=exp_name,
                per_token=bool(experiment.get("per_token")),
            )
        else:
            scores = replay.finalize_scores(exp_name)
        out = scores.cpu().numpy()
        if experiment.get("per_token") and not per_token:
            out = out.sum(-1)
        self.scores = out
        return out

    def topk(
        self,
        exp_name: str,
        k: int,
        model_ids: Iterable[int] | None = None,
        allow_skip: bool = False,
    ) -> TopK:
        """The ``k`` top proponents and opponents of each query of ``exp_name``."""
        positive_int("k", k, fix="pass the number of proponents to keep per target")
        scores = self.finalize_scores(exp_name, model_ids)
        collector = TopKCollector(scores.shape[0], scores.shape[1], k)
        collector[0 : scores.shape[0], 0 : scores.shape[1]] = scores
        return collector.result()

    # -- what the replay has not -------------------------------------------------
    def preconditioner(self, model_id: int) -> Any:
        """Not available: the replay fits no preconditioner."""
        raise ValueError(
            "method='replay' fits no preconditioner (its scores are exact metagradients); use "
            "traker.attributor for the run."
        )

    def stored_features(self, model_id: int, name: str = "grads") -> Any:
        """Not available: the replay stores no features."""
        raise ValueError(
            "method='replay' stores no features (only the training rows, in memory, and the "
            "scores); use traker.attributor for the run."
        )
