"""The method object of ``TRAKer(method="replay")``: MAGIC's metagradients in TRAKer's flow.

The TRAK loop keeps its shape, its records and its store; only what each
step computes changes:

- ``load_checkpoint(state, model_id)``: the weights the run *starts* from
  (one run, one model id);
- ``featurize`` / ``featurize_loader``: the training rows, kept in memory;
- ``finalize_features``: trains the run (:meth:`ReplayAttributor.train`);
- ``score`` / ``score_loader``: each query's row is its exact metagradients
  ``∂f_j(θ_T)/∂w_i`` over the training rows (:meth:`ReplayAttributor.metagradients`),
  stored where every method stores its target rows, so resuming skips the
  queries already done;
- ``finalize_scores`` / ``topk`` / ``per_token``: the same code as every
  method's, reading the rows as the scores' columns.

Arguments of :class:`TRAKer` that belong to projected or preconditioned
features (``proj_dim``, ``lambda_reg``, ``projector``, ...) are refused by
the table of :mod:`~gradsketch.attribution._traker_arguments`.

Under ``torch.distributed`` (``torchrun``) every rank keeps every training
row and trains the same run (it must, to replay it; the run's fingerprint is
checked equal across ranks), while the queries are split: their rows are
stored one per chunk, so rank ``r`` reverses only the queries of its
:func:`~gradsketch.attribution.chunk_shard` (``ceil(m / W)`` at most, as one
block when its batches hold them) and the reverse pass's memory is that of
its share (its adjoints, score rows and activations; the run's checkpoints are
held whole by every rank). The score columns are then gathered as every
method's are. A store begun by one process keeps its ~1 MiB chunks of query
rows, whose queries then fall to one rank each.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from gradsketch._device import exact_device
from gradsketch._store import default_chunk_rows
from gradsketch.attribution._distributed import (
    barrier,
    rank_and_world,
    rank_zero_first,
    require_same_across_ranks,
)
from gradsketch.attribution._replay import ReplayAttributor, ReplaySettings
from gradsketch.attribution._scores import CheckpointGrads
from gradsketch.attribution._traker_arguments import REPLAY_UNUSED_ARGUMENTS as WHY_NOT_USED
from gradsketch.attribution._traker_records import (
    TRAKRecords,
    checkpoint_fingerprint,
    require_all_rows,
)
from gradsketch.errors import ModelIDException, SettingsMismatchError

#: ``WHY_NOT_USED``: the former name of :data:`REPLAY_UNUSED_ARGUMENTS`, which the command
#: line reads from here (until it reads the public ``gradsketch.attribution`` name).
__all__ = ["WHY_NOT_USED", "ReplayMethod", "replay_device", "replay_settings"]

_ONE_RUN = (
    "the replay attributes through one training run, which starts from the checkpoint of "
    "one model id; average several runs' scores yourself, or use one TRAKer per run "
    "(each with its own save_dir)"
)


def _keep_rows(
    columns: list[Tensor] | None,
    batch: tuple[Tensor, ...],
    rows: Tensor,
    n: int,
) -> list[Tensor]:
    """Write ``batch`` into ``rows`` of ``columns`` (``n`` rows each, zeros until written).

    ``columns`` is None before the first batch: it is allocated from that
    batch's shapes and dtypes.
    """
    if columns is None:
        columns = [t.new_zeros((n, *t.shape[1:])) for t in batch]
    for j, (col, t) in enumerate(zip(columns, batch, strict=True)):
        if col.shape[1:] != t.shape[1:]:
            raise ValueError(
                f"featurize: column {j} has shape {tuple(t.shape[1:])} per row, earlier batches "
                f"{tuple(col.shape[1:])}; pad every batch to one length (the replay trains on "
                "one tensor per column)."
            )
        col[rows] = t.to(col.device, col.dtype)
    return columns


def replay_settings(replay: Any) -> ReplaySettings:
    """The run's settings from ``TRAKer``'s ``replay`` argument."""
    if isinstance(replay, ReplayAttributor):
        return replay.settings
    if isinstance(replay, ReplaySettings):
        return replay
    raise TypeError(
        "method='replay' needs `replay`: a ReplaySettings (how the run trains: "
        "optimizer, lr, num_steps, batch_size, seed, ...) or a ReplayAttributor; got "
        f"{type(replay).__name__}."
    )


def replay_device(model: nn.Module, device: Any) -> torch.device:
    """Where the replay runs: the model's device (``device`` must name it or be None)."""
    ref = next(model.parameters(), None)
    if device is not None and ref is not None and exact_device(device) != ref.device:
        raise ValueError(
            f"`device`={device!r} but the model's parameters are on {ref.device}; the "
            "replay trains where the model is. Move the model, or pass device=None."
        )
    return ref.device if ref is not None else torch.device("cpu")


class ReplayMethod:
    """Exact metagradients through one replayed training run (see the module docstring).

    Args:
        model: the model (its parameters are the run's initialization).
        task: the resolved task.
        replay: how the run trains: a :class:`ReplaySettings` (the training
            rows come from ``featurize``), or a :class:`ReplayAttributor`
            built on the same ``model`` (its rows, order and loss are used;
            ``featurize`` then checks the rows it is given against them).
        records: the store's records.
        train_set_size: n.
        memory_budget: bytes a reverse pass may use.
        load_from_save_dir: keep stored query rows.
        progress: show tqdm bars.
        logger: the TRAKer's logger.
    """

    targets_follow_run = True

    def __init__(
        self,
        model: nn.Module,
        task: Any,
        replay: Any,
        records: TRAKRecords,
        train_set_size: int,
        *,
        memory_budget: int | None,
        load_from_save_dir: bool,
        progress: bool,
        logger: logging.Logger,
    ) -> None:
        self.settings = replay_settings(replay)
        n = int(train_set_size)
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
            if type(replay.task) is not type(task):
                raise ValueError(
                    f"`replay` has task {type(replay.task).__name__} but `task` is "
                    f"{type(task).__name__}; give both the same task."
                )
        self.model, self.task, self.records, self.n = model, task, records, n
        self._attributor = replay if isinstance(replay, ReplayAttributor) else None
        self.memory_budget, self.load_from_save_dir = memory_budget, load_from_save_dir
        self.progress, self.logger = progress, logger
        # A query's row holds its metagradient for each training row, in float64.
        self.width, self.dtype, self.np_dtype = n, torch.float64, np.float64
        # Ranks split the queries by whole chunks of their rows: one query per chunk
        # there, so that every rank gets its share (a query costs a reverse pass, a
        # chunk file is cheap beside it). One process keeps ~1 MiB chunks.
        one_per_chunk = rank_and_world()[1] > 1
        self.dense_chunk_rows = 1 if one_per_chunk else default_chunk_rows((n,), np.float64)
        self.lambda_reg, self.score_computer = 0.0, None
        self.done = np.zeros(n, dtype=bool)
        # Every rank replays the whole run: it owns every training row.
        self.owned = np.ones(n, dtype=bool)
        self._columns: list[Tensor] | None = None
        self.model_id: int | None = None

    def pause(self) -> None:
        """Nothing to save between steps: the rows are in memory."""

    # -- the run ------------------------------------------------------------------------
    def _check_run(self, model_id: int, call: str) -> None:
        ids = self.records.model_ids
        if ids and ids != [int(model_id)]:
            raise ModelIDException(
                f"{call}: `model_id`={model_id} but `{self.records.save_dir}` holds the run of "
                f"model id {ids[0]}; {_ONE_RUN}."
            )

    def load_checkpoint(self, checkpoint: Mapping[str, Any], model_id: int, sha: str) -> None:
        """Load the weights the replayed run starts from (one run: one model id).

        Raises:
            ModelIDException: another model id was loaded before.
            SettingsMismatchError: ``model_id`` started from other weights.
        """
        self._check_run(model_id, "load_checkpoint")
        if self._attributor is not None:
            own = checkpoint_fingerprint(self._attributor.params0)
            params = {k: v for k, v in checkpoint.items() if k in self._attributor.params0}
            if checkpoint_fingerprint(params) != own:
                raise SettingsMismatchError(
                    "load_checkpoint: the checkpoint's parameters differ from the initialization "
                    "of the given ReplayAttributor; pass the state the attributor was built from "
                    "(model.state_dict() before building it)."
                )
        with rank_zero_first():  # rank 0 writes the record, the others read it
            self.records.claim_checkpoint(model_id, sha)
        self.model.load_state_dict(checkpoint)
        self.model_id = int(model_id)

    def featurize(self, batch: tuple[Tensor, ...], idx: np.ndarray) -> None:
        """Keep a batch of training rows (with a ReplayAttributor: check them against its rows)."""
        rows = torch.as_tensor(idx)
        if self._attributor is not None:
            for j, (given, own) in enumerate(zip(batch, self._attributor.data, strict=True)):
                if not torch.equal(given.to(own.device), own[rows.to(own.device)]):
                    raise ValueError(
                        f"featurize: column {j} of rows {idx[:5].tolist()}... differs from the "
                        "ReplayAttributor's training rows; feed the rows in the attributor's "
                        "order (or pass a ReplaySettings and let featurize give the rows)."
                    )
        else:
            self._columns = _keep_rows(self._columns, batch, rows, self.n)
        self.done[idx] = True

    def _run_fingerprint(self, attributor: ReplayAttributor) -> str:
        data = {f"column {j}": t for j, t in enumerate(attributor.data)}
        return checkpoint_fingerprint({**data, "order": torch.cat(attributor.order)})

    def finalize(self, ids: Iterable[int], del_grads: bool) -> None:
        """Train the replayed run (a given, trained ReplayAttributor is used as it is)."""
        ids = [int(i) for i in ids]
        if len(ids) != 1 or (self.model_id is not None and ids != [self.model_id]):
            raise ModelIDException(
                f"finalize_features: `model_ids`={ids} but the replay has one run (model id "
                f"{self.model_id}); {_ONE_RUN}."
            )
        if self.model_id is None:
            raise ModelIDException(
                "no checkpoint loaded; call load_checkpoint(state_dict, model_id) and featurize "
                "the training rows before finalize_features."
            )
        if self._attributor is None:
            require_all_rows(self.model_id, self.done, " The replay trains on every row.")
            assert self._columns is not None
            self._attributor = ReplayAttributor(
                self.model,
                self.task,
                tuple(self._columns),
                self.settings,
                memory_budget=self.memory_budget,
                progress=self.progress,
            )
        run = self._run_fingerprint(self._attributor)
        # Every rank replays the same run, or the ranks' queries would not be comparable.
        require_same_across_ranks(
            "the replayed run (training rows and batch order)",
            run,
            fix="Give every rank every training row, in the same order, with the same settings.",
        )
        stored = self.records.checkpoint(self.model_id).get("run")
        if stored not in (None, run) and self.load_from_save_dir:
            raise SettingsMismatchError(
                f"model id {self.model_id} in `{self.records.save_dir}` was replayed on other "
                f"training rows or another batch order (run fingerprint {stored!r}, now "
                f"{run!r}); its stored query rows belong to that run. Use another save_dir, or "
                "pass load_from_save_dir=False to score the queries again."
            )
        if self._attributor.final is None:
            self._attributor.train()
        barrier()  # every rank has read the record before rank 0 rewrites it
        if rank_and_world()[0] == 0:
            self.records.update_checkpoint(self.model_id, finalized=True, run=run)
        barrier()

    @property
    def attributor(self) -> ReplayAttributor:
        """The :class:`ReplayAttributor` of the run (after ``finalize_features``)."""
        if self._attributor is None or self._attributor.final is None:
            raise ModelIDException(
                "the run is not trained yet; featurize the training rows and call "
                "finalize_features() first."
            )
        return self._attributor

    # -- queries ------------------------------------------------------------------------
    def load_weights(self, checkpoint: Mapping[str, Any], model_id: int) -> None:
        """Check that ``checkpoint`` is the run's start: queries are scored at its end."""
        self._check_run(model_id, "start_scoring_checkpoint")
        with rank_zero_first():
            self.records.claim_checkpoint(model_id, checkpoint_fingerprint(checkpoint))

    def target_rows(
        self, batch: tuple[Tensor, ...], model_id: int, per_token: bool
    ) -> tuple[Tensor, Tensor | None]:
        """``[B, n]`` metagradients of the queries, and ``[B, T, n]`` per token."""
        replay = self.attributor
        if not per_token:
            return replay.metagradients(batch).T.double().cpu(), None
        size = int(batch[0].shape[0])
        expanded = tuple(self.task.per_token_batch(batch))
        flat = replay.metagradients(expanded).double().cpu()  # [n, B * T], target-major
        scores = flat.reshape(self.n, size, -1)
        # The whole query's row sums its tokens as numpy sums the [n, B, T] scores.
        whole = torch.from_numpy(np.ascontiguousarray(scores.numpy()).sum(-1)).T
        return whole, scores.permute(1, 2, 0)

    def row_arrays(self, model_id: int) -> list[str]:
        """No training rows are stored."""
        return []

    def checkpoint_grads(
        self, model_id: int, record: Mapping[str, Any], targets: Any
    ) -> CheckpointGrads:
        """The query rows are the scores' columns."""
        return CheckpointGrads(None, targets, None, scores_given=True)

    def preconditioner(self, model_id: int) -> Any:
        """Not available: the replay fits no preconditioner."""
        raise ValueError(
            "method='replay' fits no preconditioner (its scores are exact metagradients); use "
            "traker.attributor for the run."
        )

    def stored_features(self, model_id: int, name: str = "grads") -> Any:
        """Not available: the replay stores no training features."""
        raise ValueError(
            "method='replay' stores no training features (its training rows stay in memory, its "
            "query rows are the scores); use traker.attributor for the run."
        )
