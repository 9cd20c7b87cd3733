"""Recompute mode: exact attribution without storing the training rows (``rows="recompute"``).

Stored mode keeps one row per training document (projected gradients or
per-layer factors), so the store grows with the documents. Recompute mode
keeps only what the preconditioner needs (K-FAC's factors and eigenbases,
EK-FAC's corrected eigenvalues, TRAK's ``XᵀX``), Q (one number per
document) and the done flags, and computes the training gradients again
from the training loader while scoring (Kronfluence's way, Grosse et al.,
2023): disk grows with the factors, not with the documents.

* Featurizing accumulates the curvature statistics (K-FAC's factors as in
  stored mode; TRAK's ``XᵀX`` through :class:`AccumulatedGram`) and
  writes Q and the done flags only.
* ``finalize_features`` passes over the training rows again where the
  method needs one (EK-FAC's eigenvalue correction; a registered
  preconditioner reading its rows): :class:`RecomputedRows` is an ``[n, k]``
  array whose row slices are computed from the loader when read.
* Scoring (:meth:`Recompute.scores`) streams blocks of recomputed training
  rows against all the queries' preconditioned features, ``P⁻¹ φ_q``, held
  in memory (``C m k`` numbers: score fewer targets per experiment where
  they do not fit ``memory_budget``). Each block's score rows are written to
  ``scores/{exp_name}`` with a done flag (``scores/{exp_name}.done``), so a
  killed ``finalize_scores`` resumes at the first missing block. Under
  ``torch.distributed`` each rank scores its :func:`chunk_shard` of the
  blocks.

The training loader is the one given to ``featurize_loader`` (kept by
reference, so it must be re-iterable: a ``DataLoader``, a
``datasets.Dataset``, a list of batches); the weights of each checkpoint are
those given to ``load_checkpoint`` or ``start_scoring_checkpoint`` (kept by
reference and checked against the checkpoint's fingerprint before use).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from gradsketch._device import to_device
from gradsketch.attribution import _layout as layout
from gradsketch.attribution._distributed import (
    all_reduce_sum_,
    barrier,
    chunk_shard,
    rank_and_world,
    rank_zero_first,
    shard_loader,
    shardable_size,
)
from gradsketch.attribution._io import default_block_rows, rows_as_tensor
from gradsketch.attribution._linalg import damped_inverse, resolve_lambda
from gradsketch.attribution._lm_data import as_loader, as_task_batch
from gradsketch.attribution._preconditioners import (
    FeatureBatch,
    GramPreconditioner,
    PreconditionerSpec,
    TrainRows,
)
from gradsketch.attribution._scores import CheckpointGrads
from gradsketch.attribution._topk import TopK, TopKCollector
from gradsketch.attribution._traker_records import checkpoint_fingerprint
from gradsketch.errors import MemoryBudgetError, ModelIDException

#: Allowed values of ``TRAKer(rows=...)``.
ROWS = ("stored", "recompute", "auto")


def check_rows(rows: object) -> str:
    """``rows`` is one of :data:`ROWS`."""
    if not isinstance(rows, str) or rows not in ROWS:
        raise ValueError(
            f"`rows` must be one of {list(ROWS)}, got {rows!r}: 'stored' keeps each training "
            "document's row on disk, 'recompute' recomputes them while scoring, 'auto' lets the "
            "plan pick."
        )
    return rows


def refuse_one_shot(loader: Any) -> None:
    """Refuse a loader that can be read only once (recompute mode reads it again)."""
    if isinstance(loader, Iterator):
        raise ValueError(
            f"`loader` is a one-shot iterator ({type(loader).__name__}), but rows='recompute' "
            "reads the training data again at finalize_features and finalize_scores. Pass a "
            "re-iterable: a DataLoader, a datasets.Dataset or a list of batches (e.g. "
            "list(loader)); or construct the TRAKer with rows='stored'."
        )


class AccumulatedGram(GramPreconditioner):
    """TRAK's ``XᵀX`` summed (in float64) from each featurized batch, not from stored rows.

    Recompute mode's TRAK: the sum is saved with the rows it covers, as
    K-FAC's factors are, and :meth:`finalize` only sums it across ranks.
    Its finalized state is :class:`GramPreconditioner`'s (``xtx``).
    """

    accumulates = True

    def __init__(self, spec: PreconditionerSpec) -> None:
        super().__init__(spec)
        self.xtx_sum: Tensor | None = None

    def accumulate(self, batch: FeatureBatch) -> None:
        assert batch.features is not None
        x = batch.features.to(torch.float64)
        if self.xtx_sum is None:
            k = int(x.shape[1])
            self.xtx_sum = torch.zeros(k, k, dtype=torch.float64, device=x.device)
        self.xtx_sum.addmm_(x.T, x)

    def finalize(self, train: TrainRows) -> None:
        k = self.spec.feature_dim
        total = self.xtx_sum
        if total is None:  # this rank featurized no rows
            total = torch.zeros(k, k, dtype=torch.float64, device=train.device)
        self.xtx = train.reduce(total.to(train.device)).float()

    def state_dict(self) -> dict[str, np.ndarray]:
        if self.xtx is not None:
            return super().state_dict()
        if self.xtx_sum is None:
            return {}
        return {"xtx_sum": self.xtx_sum.cpu().numpy()}

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        if "xtx" in state:
            super().load_state_dict(state)
        elif "xtx_sum" in state:
            self.xtx_sum = torch.from_numpy(np.array(state["xtx_sum"])).to(self.spec.device)


class LoaderRows:
    """The training batches of one checkpoint, by row, from the loaders it was featurized from.

    Each ``featurize_loader`` call adds a segment: its loader and the row of
    its first example. An in-order map-style ``DataLoader`` is read at the
    rows asked for (:func:`shard_loader`); other loaders are read from the
    start, the position kept between reads so that reading blocks in order
    reads the loader once.
    """

    def __init__(self) -> None:
        self.segments: dict[int, Any] = {}
        self._head: tuple[int, tuple[Tensor, ...]] | None = None
        self._stream: Iterator[tuple[int, tuple[Tensor, ...]]] | None = None

    def add(self, first: int, loader: Any) -> None:
        """Read rows ``first, first + 1, ...`` from ``loader`` (replacing one at ``first``)."""
        self.segments[int(first)] = loader
        self._head = self._stream = None

    def _batches(self, task: Any) -> Iterator[tuple[int, tuple[Tensor, ...]]]:
        for first in sorted(self.segments):
            row = first
            for raw in self.segments[first]:
                batch = as_task_batch(task, raw)
                yield row, batch
                row += int(batch[0].shape[0])

    def rows(
        self, task: Any, start: int, stop: int, device: torch.device
    ) -> Iterator[tuple[tuple[Tensor, ...], np.ndarray]]:
        """``(batch, rows)`` covering exactly rows ``start:stop`` in order, on ``device``."""
        pos = start
        for first in sorted(self.segments):
            loader = self.segments[first]
            size = shardable_size(loader)
            if size is None:
                continue
            lo, hi = max(pos, first), min(stop, first + size)
            if lo != pos or hi <= lo:
                continue
            sub = shard_loader(loader, np.arange(lo - first, hi - first))
            assert sub is not None
            for raw in sub:
                batch = as_task_batch(task, raw)
                count = int(batch[0].shape[0])
                yield to_device(batch, device), np.arange(pos, pos + count)
                pos += count
        if pos < stop:
            yield from self._iterated(task, pos, stop, device)

    def _iterated(
        self, task: Any, start: int, stop: int, device: torch.device
    ) -> Iterator[tuple[tuple[Tensor, ...], np.ndarray]]:
        if self._head is None or self._head[0] > start:
            self._stream = self._batches(task)
            self._head = next(self._stream, None)
        pos = start
        while self._head is not None and pos < stop:
            row, batch = self._head
            count = int(batch[0].shape[0])
            if row + count <= pos:
                assert self._stream is not None
                self._head = next(self._stream, None)
                continue
            if row > pos:
                break  # a gap between segments
            lo, hi = pos - row, min(count, stop - row)
            part = batch if (lo, hi) == (0, count) else tuple(t[lo:hi] for t in batch)
            yield to_device(part, device), np.arange(row + lo, row + hi)
            pos = row + hi
        if pos < stop:
            raise ModelIDException(
                f"rows {pos}..{stop - 1} are not in the loaders given to featurize_loader in this "
                "process; rows='recompute' reads the training rows again from them. Call "
                "traker.load_checkpoint(...) and traker.featurize_loader(loader) with the whole "
                "training set (rows already featurized are skipped) before finalizing or scoring."
            )


class RecomputedRows:
    """``[n, k]`` training rows of one checkpoint, computed when a row slice is read.

    Reads as the stored array would (``rows[i:j]`` is a numpy array in the
    storage dtype), so the finalize passes and the scoring blocks take it in
    place of the stored rows.

    Args:
        compute: ``(batch, rows) -> [B, k]`` features of those training rows.
        source: where the rows' batches come from (``None``: nowhere; reading
            raises ``missing``).
        task: the task (converts batches).
        shape: ``(n, k)``.
        dtype: the storage dtype (numpy).
        device: where gradients are computed.
    """

    def __init__(
        self,
        compute: Callable[[tuple[Tensor, ...], np.ndarray], Tensor],
        source: LoaderRows | None,
        task: Any,
        shape: tuple[int, int],
        dtype: Any,
        device: torch.device,
        missing: str = "",
    ) -> None:
        self._compute, self._source, self._task = compute, source, task
        self._missing = missing
        self.shape = (int(shape[0]), int(shape[1]))
        self.dtype = np.dtype(dtype)
        self._device = device

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice):
            raise TypeError(f"recomputed rows are read by row slices, got {key!r}.")
        start, stop, step = key.indices(self.shape[0])
        if step != 1:
            raise TypeError(f"recomputed rows are read by contiguous row slices, got {key!r}.")
        if stop <= start:
            return np.zeros((0, self.shape[1]), dtype=self.dtype)
        if self._source is None:
            raise ModelIDException(self._missing)
        torch_dtype = getattr(torch, self.dtype.name)
        parts = [
            self._compute(batch, rows).detach().to(torch_dtype)
            for batch, rows in self._source.rows(self._task, start, stop, self._device)
        ]
        return torch.cat(parts).cpu().numpy()


class Recompute:
    """The recompute mode of a :class:`~gradsketch.attribution._traker_method.FeatureMethod`.

    Keeps, per checkpoint, the loaders and weights to recompute training
    rows from, and scores with them (see the module docstring).

    Args:
        method: the feature method (its maker, records, curvature, dtype).
        logger: the TRAKer's logger.
    """

    def __init__(self, method: Any, logger: logging.Logger) -> None:
        self.method = method
        self.logger = logger
        self.sources: dict[int, LoaderRows] = {}
        self.weights: dict[int, Mapping[str, Any]] = {}
        self._checked: set[int] = set()
        self.loaded: int | None = None
        self._cleared: set[str] = set()

    # -- what rows are recomputed from -------------------------------------------------
    def keep_loader(self, model_id: int, first: int, loader: Any, batch_size: int) -> None:
        """Keep ``loader`` (refused if one-shot) as the rows of ``model_id`` from ``first``."""
        data = as_loader(loader, self.method.maker.task, batch_size)
        refuse_one_shot(data)
        self.sources.setdefault(int(model_id), LoaderRows()).add(first, data)

    def keep_weights(self, model_id: int, checkpoint: Mapping[str, Any]) -> None:
        """Keep ``checkpoint`` as the weights of ``model_id`` (they are loaded now)."""
        if self.weights.get(int(model_id)) is not checkpoint:
            self._checked.discard(int(model_id))
        self.weights[int(model_id)] = checkpoint
        self.loaded = int(model_id)

    def _load(self, model_id: int) -> None:
        """Load the weights of ``model_id`` into the model, checked against its fingerprint."""
        if self.loaded == model_id:
            return
        weights = self.weights.get(model_id)
        if weights is None:
            raise ModelIDException(
                f"rows='recompute' recomputes the training rows of model id {model_id} from its "
                "weights, but none were given in this process; call "
                f"traker.load_checkpoint(state_dict, model_id={model_id}) or "
                f"traker.start_scoring_checkpoint(..., model_id={model_id}) first."
            )
        if model_id not in self._checked:
            expected = self.method.records.checkpoint(model_id).get("checkpoint")
            if checkpoint_fingerprint(weights) != expected:
                raise ModelIDException(
                    f"the weights kept for model id {model_id} changed since they were given "
                    "(a state_dict shares memory with the model, which was trained since?); "
                    "rows='recompute' needs them at finalize and scoring time. Pass a copy, "
                    "e.g. {k: v.clone() for k, v in model.state_dict().items()}, or call "
                    f"start_scoring_checkpoint(..., model_id={model_id}) with them again."
                )
            self._checked.add(model_id)
        self.method.maker.load_weights(weights, model_id)
        self.loaded = model_id

    def _features(
        self, model_id: int, name: str, batch: tuple[Tensor, ...], rows: np.ndarray
    ) -> Tensor:
        """The stored-mode row ``name`` of training rows ``rows`` (``[B, k]``)."""
        self._load(model_id)
        maker = self.method.maker
        if not maker.layered:
            return maker.features(batch, model_id)
        featurizer = maker.kronecker()
        sampled = self.method.curvature == "sampled"
        parts, _ = featurizer.layer_parts(batch, rows if sampled else None)
        fisher = name == "fisher_grads"
        return featurizer.features(
            [(a, gs if fisher and gs is not None else g) for a, g, gs in parts]
        )

    def rows(self, model_id: int, name: str = "grads") -> RecomputedRows:
        """The ``[n, k]`` training rows ``name`` of ``model_id``, recomputed when read."""
        method = self.method
        missing = (
            f"rows='recompute' reads the training rows of model id {model_id} again from the "
            "loader given to featurize_loader, but none was given in this process. Call "
            f"traker.load_checkpoint(state_dict, model_id={model_id}) and "
            "traker.featurize_loader(loader) (rows already featurized are skipped); "
            "featurize(batch, ...) keeps no loader."
        )
        return RecomputedRows(
            lambda batch, rows: self._features(int(model_id), name, batch, rows),
            self.sources.get(int(model_id)),
            method.maker.task,
            (method.n, method.width),
            method.np_dtype,
            method.maker.device,
            missing,
        )

    # -- scoring -------------------------------------------------------------------------
    def _work(self) -> torch.dtype:
        return torch.float64 if self.method.dtype == torch.float64 else torch.float32

    def _right_sides(self, ckpts: Sequence[CheckpointGrads], lambda_reg: Any) -> list[Tensor]:
        """Per checkpoint ``P_c⁻¹ φ_q`` of every target, ``[m, k]`` (in memory)."""
        dev, work = self.method.maker.device, self._work()
        out = []
        for ck in ckpts:
            t = rows_as_tensor(ck.targets, 0, int(ck.targets.shape[0]), device=dev, dtype=work)
            if ck.solve is not None:
                out.append(ck.solve(t).to(work))
            elif ck.xtx is not None:
                xtx = ck.xtx.to(dev, torch.float32)
                out.append(t @ damped_inverse(xtx, resolve_lambda(lambda_reg, xtx)).to(work))
            else:
                out.append(t)
        return out

    def _row_weights(self, ckpts: Sequence[CheckpointGrads]) -> list[Tensor]:
        """Per checkpoint the ``[n]`` row weights: ``Q_c / C``, or the checkpoints' mean Q / C."""
        n, cks, work = self.method.n, len(ckpts), self._work()
        qs = [
            torch.from_numpy(np.asarray(ck.out_to_loss[:], dtype=np.float64).reshape(n))
            for ck in ckpts
        ]
        if ckpts[0].q_per_checkpoint:
            return [(q / cks).to(work) for q in qs]
        mean = torch.stack(qs).sum(0) / cks
        return [(mean / cks).to(work)] * cks

    def _block_rows(self, m: int, rhs_bytes: int, memory_budget: int | None) -> int:
        """Training rows per scoring block: their rows and score tiles in the budget."""
        k, item = self.method.width, torch.empty(0, dtype=self._work()).element_size()
        if memory_budget is None:
            return default_block_rows(self.method.n, k + m, item)
        left = memory_budget - rhs_bytes
        per_row = item * (2 * k + m)
        if left < per_row:
            raise MemoryBudgetError(
                f"rows='recompute' holds every target's preconditioned features ({rhs_bytes} "
                f"bytes) and at least one training row ({per_row} bytes) while scoring, but "
                f"`memory_budget`={memory_budget}; score fewer targets per experiment, or raise "
                "the budget."
            )
        return max(1, min(self.method.n, left // per_row))

    def _score_block(
        self,
        ids: Sequence[int],
        rhs: Sequence[Tensor],
        weights: Sequence[Tensor],
        start: int,
        stop: int,
    ) -> Tensor:
        """``[stop - start, m]`` scores of training rows ``start:stop`` (work dtype)."""
        dev, work = self.method.maker.device, self._work()
        acc = torch.zeros(stop - start, int(rhs[0].shape[0]), dtype=work, device=dev)
        for model_id, r, w in zip(ids, rhs, weights, strict=True):
            x = rows_as_tensor(
                self.rows(model_id)[start:stop], 0, stop - start, device=dev, dtype=work
            )
            acc.addmm_(x * w[start:stop, None].to(dev), r.T)
        return acc

    def _key(self, ids: Sequence[int], ckpts: Sequence[CheckpointGrads], lambda_reg: Any) -> str:
        """What the scores depend on: a finished block is kept only while it is the same."""
        digest = hashlib.sha256(repr((list(ids), lambda_reg)).encode())
        for ck in ckpts:
            for array in (ck.targets, ck.out_to_loss):
                digest.update(np.ascontiguousarray(np.asarray(array[:])).tobytes())
        return digest.hexdigest()[:16]

    def scores(
        self,
        exp_name: str,
        ids: Sequence[int],
        ckpts: Sequence[CheckpointGrads],
        *,
        lambda_reg: Any,
        memory_budget: int | None,
        progress: bool,
    ) -> Any:
        """``[n, m]`` float32 scores of ``exp_name``, written block by block, resumed.

        Returns a numpy array, or the zarr array ``scores/{exp_name}`` when the
        scores exceed ``memory_budget``.
        """
        store = self.method.records.store
        n, m = self.method.n, int(ckpts[0].targets.shape[0])
        self._checked.clear()  # the kept weights are checked again once per scoring
        rhs = self._right_sides(ckpts, lambda_reg)
        rhs_bytes = sum(int(r.numel()) * r.element_size() for r in rhs)
        block = self._block_rows(m, rhs_bytes, memory_budget)
        name, done = layout.scores_array(exp_name), layout.scores_done(exp_name)
        key = self._key(ids, ckpts, lambda_reg)
        with rank_zero_first() as first:
            scores = store.require_array(name, (n, m), np.float32, chunk_rows=block)
            store.require_done(done, n, chunk_rows=int(scores.chunks[0]))
            flags = store.array(done)
            fresh = not self.method.load_from_save_dir and exp_name not in self._cleared
            if first and (flags.attrs.get("recompute") != key or fresh):
                # Scores of other targets, checkpoints or damping: every block is scored again.
                flags[:] = np.zeros(n, dtype=np.uint8)
                flags.attrs["recompute"] = key
        self._cleared.add(exp_name)
        chunk = int(scores.chunks[0])
        block = max(chunk, block - block % chunk)  # whole chunks: ranks never share one
        finished = store.done_rows(done)
        _, world = rank_and_world()
        mine = chunk_shard(n, chunk) if world > 1 else range(n)
        todo = [
            (i0, min(mine.stop, i0 + block))
            for i0 in range(mine.start, mine.stop, block)
            if not finished[i0 : min(mine.stop, i0 + block)].all()
        ]
        if len(todo) < -(-len(mine) // block):
            self.logger.info(
                "scores of %r: resuming, %d of %d training blocks left",
                exp_name,
                len(todo),
                -(-len(mine) // block),
            )
        weights = self._row_weights(ckpts)
        before = self.loaded
        for i0, i1 in tqdm(
            todo, desc=f"scoring {exp_name} (recomputed rows)", disable=not progress
        ):
            tile = self._score_block(ids, rhs, weights, i0, i1).float().cpu().numpy()
            store.write_rows(slice(i0, i1), {name: tile}, done=done)
        self.restore(before)
        store.flush()
        barrier()
        scores = store.array(name)
        if memory_budget is not None and 4 * n * m > memory_budget:
            return scores
        return np.asarray(scores[:])

    def in_memory(
        self,
        ids: Sequence[int],
        ckpts: Sequence[CheckpointGrads],
        *,
        lambda_reg: Any,
        memory_budget: int | None,
        progress: bool,
    ) -> np.ndarray:
        """``[n, m]`` float32 scores in memory, not saved (per-token scores' targets).

        Under ``torch.distributed`` each rank scores its :func:`chunk_shard` of
        the training rows and the rows are summed across ranks (exactly: the
        other ranks add zeros).
        """
        n, m = self.method.n, int(ckpts[0].targets.shape[0])
        self._checked.clear()
        rhs = self._right_sides(ckpts, lambda_reg)
        rhs_bytes = sum(int(r.numel()) * r.element_size() for r in rhs)
        block = self._block_rows(m, rhs_bytes + 4 * n * m, memory_budget)
        _, world = rank_and_world()
        mine = chunk_shard(n, block) if world > 1 else range(n)
        weights = self._row_weights(ckpts)
        out = torch.zeros(n, m)
        before = self.loaded
        spans = [(i0, min(mine.stop, i0 + block)) for i0 in range(mine.start, mine.stop, block)]
        for i0, i1 in tqdm(spans, desc="scoring (recomputed rows)", disable=not progress):
            out[i0:i1] = self._score_block(ids, rhs, weights, i0, i1).float().cpu()
        self.restore(before)
        return all_reduce_sum_(out).numpy()

    def topk(self, scores: Any, k: int, memory_budget: int | None) -> TopK:
        """The top ``k`` of each column of the ``[n, m]`` scores, read in row blocks."""
        n, m = (int(s) for s in scores.shape)
        collector = TopKCollector(n, m, k)
        step = n if memory_budget is None else max(1, memory_budget // (8 * max(m, 1)))
        for i0 in range(0, n, step):
            i1 = min(n, i0 + step)
            collector[slice(i0, i1), slice(0, m)] = np.asarray(scores[i0:i1])
        return collector.result()

    def restore(self, model_id: int | None) -> None:
        """Load again the weights loaded before scoring (targets may be scored next)."""
        if model_id is not None and model_id in self.weights:
            self._load(model_id)


def recompute_train_rows(
    method: Any, model_id: int, names: Iterable[str], rows_q: Any, mine: range, block_rows: int
) -> TrainRows:
    """The finalize pass's view of ``model_id``'s training rows, recomputed when read."""
    method.recompute._checked.discard(int(model_id))
    arrays = {name: method.recompute.rows(model_id, name) for name in names}
    return TrainRows(
        arrays,
        rows_q,
        mine,
        size=method.n,
        block_rows=block_rows,
        device=method.maker.device,
        prefetch=False,  # one model, one thread: rows are computed, not read
    )
