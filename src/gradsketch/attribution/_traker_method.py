"""The method object of TRAK, identity, K-FAC, EK-FAC and registered preconditioners.

These methods store one row per training example (projected gradients or
per-layer factors, :mod:`~gradsketch.attribution._traker_features`), fit a
preconditioner ``P`` from them (``finalize_features``), and store one row of
features per target; scoring is the kernel
``Φ P⁻¹ φ_targetᵀ ⊙ Q`` of :mod:`~gradsketch.attribution._scores`. With
``rows="recompute"`` no training row is stored: the statistics are
accumulated while featurizing and the rows are computed again where they
are read (:mod:`~gradsketch.attribution._traker_recompute`).
:class:`~gradsketch.attribution.TRAKer` runs the flow; this object does
each step's method-specific part.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from gradsketch._store import StoreIntegrityError, default_chunk_rows
from gradsketch.attribution import _layout as layout
from gradsketch.attribution._distributed import (
    barrier,
    chunk_shard,
    owned_mask,
    rank_and_world,
    rank_zero_first,
    require_same_across_ranks,
)
from gradsketch.attribution._integrity import check_finite_rows
from gradsketch.attribution._io import default_block_rows, rows_as_tensor
from gradsketch.attribution._linalg import damped_inverse, resolve_lambda
from gradsketch.attribution._preconditioners import (
    CurvaturePreconditioner,
    FeatureBatch,
    GramPreconditioner,
    KFACPreconditioner,
    PreconditionerSpec,
    TrainRows,
)
from gradsketch.attribution._score_cache import ScoringCache
from gradsketch.attribution._scores import CheckpointGrads
from gradsketch.attribution._traker_accumulated import Accumulated
from gradsketch.attribution._traker_features import FeatureMaker, numpy_dtype
from gradsketch.attribution._traker_inputs import select_rows
from gradsketch.attribution._traker_recompute import (
    AccumulatedGram,
    Recompute,
    recompute_train_rows,
)
from gradsketch.attribution._traker_records import TRAKRecords, require_all_rows
from gradsketch.attribution._traker_rows import DENSE_ROWS, StoredRows
from gradsketch.errors import ModelIDException


class FeatureMethod:
    """Stored features and a fitted preconditioner (see the module docstring).

    Args:
        method: the method's name.
        precond_cls: the preconditioner class (:func:`resolve_method`).
        maker: computes the rows of a batch.
        records: the store's records.
        train_set_size: n.
        lambda_reg: the damping.
        curvature: per-layer methods' curvature.
        score_computer: TRAK's optional score computer (an instance).
        chunk_rows: rows per chunk (``None``: about 1 MiB).
        memory_budget: bytes of working memory for finalizing.
        load_from_save_dir: resume stored rows.
        progress: show tqdm bars.
        logger: the TRAKer's logger.
        damping_fraction: per-layer ``"auto"`` damping's fraction of each
            layer's mean eigenvalue (``None``: the library's default).
        rows: ``"stored"`` (one row per training document on disk) or
            ``"recompute"`` (none: :mod:`~gradsketch.attribution._traker_recompute`).
    """

    targets_follow_run = False

    def __init__(
        self,
        method: str,
        precond_cls: type[CurvaturePreconditioner],
        maker: FeatureMaker,
        records: TRAKRecords,
        train_set_size: int,
        *,
        lambda_reg: float | str,
        curvature: str,
        score_computer: Any,
        chunk_rows: int | None,
        memory_budget: int | None,
        load_from_save_dir: bool,
        progress: bool,
        logger: logging.Logger,
        damping_fraction: float | None = None,
        rows: str = "stored",
    ) -> None:
        #: Recompute mode's state (``None``: stored rows).
        self.recompute = Recompute(self, logger) if rows == "recompute" else None
        if self.recompute is not None and precond_cls is GramPreconditioner:
            precond_cls = AccumulatedGram  # XᵀX summed while featurizing: no rows to read
        self.method, self.precond_cls = method, precond_cls
        self.damping_fraction = damping_fraction
        self.maker, self.records, self.n = maker, records, int(train_set_size)
        self.lambda_reg, self.curvature = lambda_reg, curvature
        self.score_computer = score_computer
        self.memory_budget = memory_budget
        self.load_from_save_dir = load_from_save_dir
        self.progress, self.logger = progress, logger
        self.width = maker.proj_dim
        self.dtype = maker.dtype
        self.np_dtype = numpy_dtype(maker.dtype)
        # An instance to ask what it stores beside the features.
        stored = self.new_preconditioner().stored_arrays
        if maker.layered and "rank_one" not in stored and self.recompute is None:
            # Rows whose layers each see one position keep [a, g], not vec(g aᵀ).
            stored = (*stored, "rank_one")
        self.stored_arrays: tuple[str, ...] = tuple(stored)
        self.dense_chunk_rows = chunk_rows or default_chunk_rows(
            (self.width,), np.dtype(self.np_dtype)
        )
        self.chunk_rows = self.dense_chunk_rows
        if chunk_rows is None and "rank_one" in self.stored_arrays:
            # Rank-one rows are narrow: ~1 MiB chunks of them, made of whole dense
            # chunks, so writers splitting rows by chunk never share a dense chunk.
            narrow = default_chunk_rows(
                (maker.kronecker().row_width("rank_one"),), np.dtype(self.np_dtype)
            )
            self.chunk_rows *= max(1, narrow // self.dense_chunk_rows)
        self.done: np.ndarray | None = None
        self.owned: np.ndarray | None = None
        self.model_id: int | None = None
        #: Factors and rows kept between query sets (set by the TRAKer; ``None``: none).
        self.score_cache: ScoringCache | None = None
        self.rows = StoredRows(
            self.records,
            self.maker.featurizer,
            self.n,
            self.width,
            self.np_dtype,
            self.dense_chunk_rows,
            self.chunk_rows,
            self.stored_arrays,
        )
        self.accumulated = Accumulated(
            self.records,
            self.new_preconditioner,
            self.n,
            max(self.chunk_rows, self.n // 10),
            self.logger,
        )

    @property
    def q_dtype(self) -> Any:
        """Q's storage dtype (per-layer methods keep float64: it weighs EK-FAC's squares)."""
        return np.float64 if self.maker.layered else np.float32

    def new_preconditioner(self) -> CurvaturePreconditioner:
        """A fresh preconditioner of the method."""
        spec = PreconditionerSpec(
            feature_dim=self.width,
            damping=self.lambda_reg,
            device=self.maker.device,
            layers=self.maker.layers,
            curvature=self.curvature,
            score_computer=self.score_computer,
            damping_fraction=self.damping_fraction,
        )
        return self.precond_cls(spec)

    # -- featurizing ------------------------------------------------------------------
    def pause(self) -> None:
        """Save the accumulated statistics and free the checkpoint for other processes."""
        self.accumulated.release()

    def load_checkpoint(self, checkpoint: Mapping[str, Any], model_id: int, sha: str) -> None:
        """Open ``model_id``'s rows (resuming those stored) and load its weights."""
        world = rank_and_world()[1]
        if world > 1 and self.model_id is not None:
            # Every rank is done with the previous checkpoint (the caller agreed on this one).
            self.rows.settle(self.model_id)
        n, k = self.n, self.width
        arr = functools.partial(layout.checkpoint_array, model_id)
        if self.score_cache is not None:
            self.score_cache.forget(model_id)  # its rows may change
        if self.precond_cls.accumulates:
            self.accumulated.hold(model_id)
        store = self.records.store
        recompute = self.recompute is not None
        with rank_zero_first() as first:
            self.records.claim_checkpoint(model_id, sha)
            if not self.maker.layered and not recompute:
                store.require_array(arr("grads"), (n, k), self.np_dtype, chunk_rows=self.chunk_rows)
            # Per-layer methods create the dense rows when a batch needs them.
            rows_q = store.require_array(
                arr("out_to_loss"), (n, 1), self.q_dtype, chunk_rows=self.chunk_rows
            )
            for extra in self.stored_arrays:
                if extra in DENSE_ROWS or recompute:
                    continue
                width = self.maker.kronecker().row_width(extra)
                store.require_array(
                    arr(extra), (n, width), self.np_dtype, chunk_rows=self.chunk_rows
                )
            store.require_done(arr("done"), n, chunk_rows=self.chunk_rows)
            if first and not self.load_from_save_dir:
                store.array(arr("done"))[:] = np.zeros(n, dtype=np.uint8)
                for path in self.accumulated.files(model_id):
                    path.unlink()
                self.records.write_checkpoint(model_id, {"checkpoint": sha, "finalized": False})
        # The stored chunking decides the shards (a resumed store keeps its own).
        self.owned = owned_mask(n, int(rows_q.chunks[0]))
        self.done = store.done_rows(arr("done"))
        if self.done.any():
            self.done[self.records.repair_rows(model_id, self.rows.row_arrays(model_id))] = False
        self.rows.resume(model_id, self.owned if world > 1 else None)
        self.accumulated.forget()
        if self.precond_cls.accumulates:
            self.accumulated.start(model_id)
        covered = self.accumulated.covered_any
        if self.done.any() or (covered is not None and covered.any()):
            self.logger.info(
                "model id %d: resuming, %d of %d rows already featurized%s",
                model_id,
                int(self.done.sum()),
                n,
                "" if covered is None else f", {int(covered.sum())} in the curvature statistics",
            )
        self.maker.load_weights(checkpoint, model_id)
        if self.recompute is not None:
            self.recompute.keep_weights(model_id, checkpoint)
        self.model_id = int(model_id)

    def _train_rows(
        self, batch: Sequence[Tensor], idx: np.ndarray
    ) -> tuple[Tensor | None, Tensor, Any, dict[str, Tensor]]:
        """Features, Q, per-layer parts (or None) and extra stored rows of training rows.

        Features are ``None`` where rank-one rows stand for them.
        """
        assert self.model_id is not None
        if self.recompute is not None:
            return self._recompute_rows(batch, idx)
        if not self.maker.layered:
            projected = self.maker.features(batch, self.model_id)
            return projected, self.maker.gradient_computer.compute_loss_grad(batch), None, {}
        featurizer = self.maker.kronecker()
        sampled = self.curvature == "sampled" and (
            self.precond_cls.accumulates or bool(self.stored_arrays)
        )
        parts, q = featurizer.layer_parts(batch, idx if sampled else None)
        mode = self.rows.mode(self.model_id, featurizer.token_counts(parts))
        if mode == "dense":
            phi = featurizer.features([(a, g) for a, g, _ in parts])
            extra = {name: featurizer.extra_rows(name, parts) for name in self.stored_arrays}
            return phi, q, parts, extra
        kept = [x for x in self.stored_arrays if x not in DENSE_ROWS]
        tokens = self.rows.tokens
        if tokens is not None:  # "factored": the positions' [a, g] stand for rank_one too
            kept.remove("rank_one")
        extra = {name: featurizer.extra_rows(name, parts) for name in kept}
        if tokens is not None:
            extra["token_factors"] = featurizer.factored_rows(parts, tokens)
        return None, q, parts, extra

    def _recompute_rows(
        self, batch: Sequence[Tensor], idx: np.ndarray
    ) -> tuple[Tensor | None, Tensor, Any, dict[str, Tensor]]:
        """Recompute mode: Q, and what the curvature statistics read (no rows are stored)."""
        assert self.model_id is not None
        if not self.maker.layered:
            computer = self.maker.gradient_computer
            if not self.precond_cls.accumulates:
                return None, computer.compute_loss_grad(batch), None, {}
            # Rounded to the storage dtype, as the stored rows XᵀX is summed from are.
            phi = self.maker.features(batch, self.model_id).to(self.dtype)
            return phi, computer.compute_loss_grad(batch), None, {}
        sampled = self.curvature == "sampled"
        parts, q = self.maker.kronecker().layer_parts(batch, idx if sampled else None)
        return None, q, parts, {}

    def keep_loader(self, loader: Any, first: int, batch_size: int) -> None:
        """Recompute mode: the loaded checkpoint's rows from ``first`` are read from ``loader``."""
        if self.recompute is not None and self.model_id is not None:
            self.recompute.keep_loader(self.model_id, first, loader, batch_size)

    def featurize(self, batch: tuple[Tensor, ...], idx: np.ndarray) -> None:
        """Compute and store the rows ``idx`` not stored yet (and not yet accumulated)."""
        assert self.done is not None and self.owned is not None and self.model_id is not None
        need_rows = ~self.done[idx]
        need_acc = np.zeros_like(need_rows)
        covered = self.accumulated.covered_any
        if covered is not None:
            need_acc = ~covered[idx]
        need_rows &= self.owned[idx]
        need_acc &= self.owned[idx]
        todo = need_rows | need_acc
        if not todo.any():
            return
        batch, idx = select_rows(batch, idx, todo)
        need_rows, need_acc = need_rows[todo], need_acc[todo]
        phi, q, parts, extra = self._train_rows(batch, idx)
        # Before anything is accumulated or written: one NaN would poison every score.
        checked = {"features": phi, "out_to_loss": q, **extra}
        if phi is not None:
            checked.pop("rank_one", None)  # NaN rows there mark rows kept dense
        check_finite_rows(checked, idx, batch, "featurize")
        if need_acc.any():
            mask = self.maker.kronecker().token_mask(batch) if self.maker.layered else None
            self._accumulate(idx, need_acc, phi, q, parts, mask)
        if not need_rows.any():
            return
        rows = np.nonzero(need_rows)[0]
        if rows.size < idx.size:
            keep_rows = torch.as_tensor(rows, device=q.device)
            phi = None if phi is None else phi[keep_rows.to(phi.device)]
            q = q[keep_rows]
            extra = {name: x[keep_rows] for name, x in extra.items()}
        arr = functools.partial(layout.checkpoint_array, self.model_id)
        arrays = {
            arr("out_to_loss"): q.detach().cpu().numpy().astype(self.q_dtype).reshape(-1, 1),
        }
        if self.recompute is not None:
            phi, extra = None, {}  # recompute mode stores Q and the done flags only
        if phi is not None:  # dense rows: the row form made the store dense already
            arrays[arr("grads")] = phi.detach().to(self.dtype).cpu().numpy()
        for name, x in extra.items():
            arrays[arr(name)] = x.detach().to(self.dtype).cpu().numpy()
        self.records.store.write_rows(
            idx[rows],
            arrays,
            done=arr("done"),
            background=True,  # written while the next batch is computed
        )
        self.done[idx[rows]] = True

    def _accumulate(
        self,
        idx: np.ndarray,
        need: np.ndarray,
        phi: Tensor | None,
        q: Tensor,
        parts: Any,
        token_mask: Tensor | None,
    ) -> None:
        """Hand the rows ``need`` of a batch to the accumulating preconditioner."""
        sel = torch.as_tensor(np.nonzero(need)[0], device=q.device)
        if phi is None and not isinstance(self.accumulated.precond, KFACPreconditioner):
            # K-FAC's statistics come from the layers' parts; a user's may read features.
            phi = self.maker.kronecker().features([(a, g) for a, g, _ in parts])
        every = bool(need.all())

        def pick(t: Tensor) -> Tensor:
            # Most batches hand over every row: no copy then.
            return t if every else t.index_select(0, sel.to(t.device))

        layers = None
        if parts is not None:
            layers = [(pick(a), pick(g), None if gs is None else pick(gs)) for a, g, gs in parts]
        self.accumulated.add(
            FeatureBatch(
                rows=idx[need],
                features=None if phi is None else pick(phi),
                out_to_loss=pick(q),
                layers=layers,
                token_mask=None if token_mask is None else pick(token_mask),
            )
        )

    # -- finalizing -------------------------------------------------------------------
    def _row_block(self) -> int:
        if self.memory_budget is None:
            return default_block_rows(self.n, self.width)
        return max(1, min(self.n, self.memory_budget // (8 * self.width)))

    def finalize(self, ids: Iterable[int], del_grads: bool) -> None:
        """Fit each checkpoint's preconditioner from its stored rows and mark it final."""
        self.pause()
        self.maker.free_memory()
        # Every rank's rows must be on disk before anyone reads the flags.
        store = self.records.store
        store.flush()
        barrier()
        if self.model_id is not None and rank_and_world()[1] > 1:
            # Ranks widen the row form by themselves: each brings its rows to the store's.
            self.rows.settle(self.model_id)
            store.flush()
            barrier()
        rank, _ = rank_and_world()
        bar = tqdm(list(ids), desc="finalizing features", disable=not self.progress or rank != 0)
        for model_id in bar:
            record = self.records.checkpoint(model_id)
            if not record:
                raise ModelIDException(
                    f"model id {model_id} is not in `{self.records.save_dir}`; featurized ids "
                    f"are {self.records.model_ids}."
                )
            done = store.done_rows(layout.checkpoint_array(model_id, "done"))
            precond: CurvaturePreconditioner | None = None
            if self.precond_cls.accumulates:
                precond, _, covered = self.accumulated.read(model_id)
                done = done & covered
            # Ranks decide together, from the same flags, whether to go on.
            require_same_across_ranks(f"model id {model_id} complete", bool(done.all()))
            require_all_rows(model_id, done)
            if record.get("finalized"):
                self.logger.info("model id %d already finalized; skipping", model_id)
                continue
            self._finalize_one(model_id, record, precond or self.new_preconditioner(), del_grads)

    def _finalize_one(
        self,
        model_id: int,
        record: Mapping[str, Any],
        precond: CurvaturePreconditioner,
        del_grads: bool,
    ) -> None:
        store = self.records.store
        arr = functools.partial(layout.checkpoint_array, model_id)
        self.records.require_intact_rows(model_id, self.rows.row_arrays(model_id))
        rows_q = store.array(arr("out_to_loss"))
        # Each rank reads its own rows; the preconditioner sums across ranks.
        world = rank_and_world()[1]
        mine = chunk_shard(self.n, int(rows_q.chunks[0])) if world > 1 else range(self.n)
        names = [x for x in ("grads", *self.stored_arrays) if x != "rank_one"]
        if self.recompute is not None:
            train = recompute_train_rows(self, model_id, names, rows_q, mine, self._row_block())
            self._fit(model_id, record, precond, train, del_grads, mine)
            return
        arrays = {name: self.rows.array(model_id, name) for name in names}
        # Rows kept factored: the preconditioner may read the factors themselves.
        factored, tokens = self.rows.factored(model_id)
        if factored is not None:
            arrays["factored"] = factored
        train = TrainRows(
            arrays,
            rows_q,
            mine,
            size=self.n,
            block_rows=self._row_block(),
            device=self.maker.device,
            prefetch=self.memory_budget is None,
            tokens=tokens,
        )
        self._fit(model_id, record, precond, train, del_grads, mine)

    def _fit(
        self,
        model_id: int,
        record: Mapping[str, Any],
        precond: CurvaturePreconditioner,
        train: TrainRows,
        del_grads: bool,
        mine: range,
    ) -> None:
        """Finalize ``precond`` on ``train``, save its state and mark ``model_id`` final."""
        store = self.records.store
        arr = functools.partial(layout.checkpoint_array, model_id)
        rank = rank_and_world()[0]
        before = None if self.recompute is None else self.recompute.loaded
        if self.score_cache is not None:
            self.score_cache.forget(model_id)
        precond.finalize(train)
        if self.recompute is not None:
            self.recompute.restore(before)  # the pass loaded each checkpoint's weights
        state = precond.state_dict()
        if rank == 0:
            for key, value in state.items():
                name = layout.checkpoint_state(model_id, key)
                store.require_array(name, value.shape, value.dtype)[...] = value
        if del_grads:
            assert isinstance(precond, GramPreconditioner) and precond.xtx is not None
            self._form_features(model_id, precond.xtx, mine)
            barrier()
            if rank == 0:
                store.delete(arr("grads"))
        if rank == 0:
            self.records.write_checkpoint(
                model_id,
                {**record, "finalized": True, "features": del_grads, "state": sorted(state)},
            )
        barrier()

    def _form_features(self, model_id: int, xtx: Tensor, rows: range) -> None:
        store = self.records.store
        grads = store.array(layout.checkpoint_array(model_id, "grads"))
        inv = damped_inverse(xtx.float(), resolve_lambda(self.lambda_reg, xtx.float()))
        with rank_zero_first():
            # Same chunks as the gradients, so each rank's rows fill whole chunks.
            feats = store.require_array(
                layout.checkpoint_array(model_id, "features"),
                tuple(grads.shape),
                np.float32,
                chunk_rows=grads.chunks[0],
            )
        step = self._row_block()
        for start in range(rows.start, rows.stop, step):
            stop = min(rows.stop, start + step)
            x = rows_as_tensor(grads, start, stop, device=self.maker.device, dtype=torch.float32)
            feats[start:stop] = (x @ inv).cpu().numpy()

    def preconditioner(self, model_id: int) -> CurvaturePreconditioner:
        """The finalized preconditioner of ``model_id``, read from the store.

        Raises:
            ModelIDException: ``model_id`` is not finalized.
        """
        return self._load_preconditioner(model_id, self.records.finalized(model_id))

    def _load_preconditioner(
        self, model_id: int, record: Mapping[str, Any]
    ) -> CurvaturePreconditioner:
        keys = record.get("state", ["xtx"] if self.method == "trak" else [])
        state, problem = self.records.read_state(model_id, keys)
        save_dir = self.records.save_dir
        if state is None:
            if record.get("features"):
                raise StoreIntegrityError(
                    f"model id {model_id} in `{save_dir}`: its finalized state is damaged "
                    f"({problem}) and its gradients were deleted (del_grads=True). Fix: "
                    f"featurize it again with load_from_save_dir=False, then finalize."
                )
            # Recomputed from the stored rows (and statistics), as finalize made it.
            self.logger.warning(
                "model id %d: finalized state is damaged (%s); finalizing it again.",
                model_id,
                problem,
            )
            self.records.write_checkpoint(model_id, {**record, "finalized": False})
            self.finalize([model_id], del_grads=False)
            record = self.records.checkpoint(model_id)
            keys = record.get("state", keys)
            state, problem = self.records.read_state(model_id, keys)
            if state is None:
                raise StoreIntegrityError(
                    f"model id {model_id} in `{save_dir}`: its finalized state is still "
                    f"damaged after finalizing again ({problem})."
                )
        precond = self.new_preconditioner()
        precond.load_state_dict(state)
        return precond

    # -- scoring ----------------------------------------------------------------------
    def load_weights(self, checkpoint: Mapping[str, Any], model_id: int) -> None:
        """Load the weights that the targets of ``model_id`` are featurized under."""
        self.maker.load_weights(checkpoint, model_id)
        if self.recompute is not None:
            self.recompute.keep_weights(model_id, checkpoint)

    def target_rows(
        self, batch: tuple[Tensor, ...], model_id: int, per_token: bool
    ) -> tuple[Tensor, Tensor | None]:
        """``[B, k]`` target features, and ``[B, T, k]`` per token with ``per_token``."""
        if not per_token:
            return self.maker.features(batch, model_id), None
        tokens = self.maker.token_features(batch, model_id)
        return tokens.sum(1), tokens

    def row_arrays(self, model_id: int) -> list[str]:
        """The stored per-row arrays of ``model_id`` (checked before scoring)."""
        return self.rows.row_arrays(model_id)

    def checkpoint_grads(
        self, model_id: int, record: Mapping[str, Any], targets: Any
    ) -> CheckpointGrads:
        """Scoring inputs of ``model_id`` with stored target rows ``targets``."""
        arr = functools.partial(layout.checkpoint_array, model_id)
        store = self.records.store
        out_to_loss = store.array(arr("out_to_loss"))
        if record.get("features"):
            # TRAK's del_grads: the rows hold X (XᵀX + λI)⁻¹ already.
            return CheckpointGrads(
                store.array(arr("features")), targets, out_to_loss, preconditioned=True
            )
        precond = self._load_preconditioner(model_id, record)
        ck = precond.checkpoint_grads(self.stored_features(model_id), targets, out_to_loss)
        if self.score_cache is not None and ck.xtx is not None:
            ck.cache = self.score_cache.handle(model_id, rows=self.recompute is None)
        return ck

    def stored_features(self, model_id: int, name: str = "grads") -> Any:
        """The ``[n, k]`` training features of ``model_id`` (recompute mode: computed when read)."""
        if self.recompute is not None:
            return self.recompute.rows(model_id, name)
        return self.rows.array(model_id, name)
