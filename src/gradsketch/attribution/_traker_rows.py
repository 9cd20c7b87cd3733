"""The forms of a checkpoint's stored training rows: dense, rank-one or token factors.

Projected methods (TRAK) store dense ``[n, k]`` rows. Per-layer methods
store, per row, each factored layer's gradient ``vec(sum_t g_t a_tᵀ)``, and
keep it compact while they can:

- ``rank_one``: each layer's ``[a, g]`` where every layer sees one position;
- ``token_factors``: each layer's positions' ``[a, g]`` (padded to the first
  batch's counts), where narrower than the dense row;
- ``grads`` (and ``fisher_grads``): dense rows, once a batch needs them.

Rows already stored are rewritten in the new form, so every stored row is in
the newest form; :meth:`StoredRows.array` reads any form as ``[n, k]``.

Under ``torch.distributed`` every rank writes only its own rows (whole chunks)
and widens the form by itself, as one process does: the first rank whose
layers see several positions creates ``token_factors`` under the store's
write lock and records its counts; a rank that comes later takes those
counts (dense rows where its batch does not fit them); each rank rewrites
only its own rows. Ranks may then hold narrower forms than the store's
(which is the widest any rank asked for): :meth:`StoredRows.settle`, called
once every rank is done featurizing (``finalize_features``, the next
``load_checkpoint``), rewrites each rank's rows into the store's form. So
the rows per document, the finalize and the scoring are one process's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from gradsketch._store import RowStore
from gradsketch.attribution import _layout as layout
from gradsketch.attribution._kronecker_features import FactoredRows, KroneckerFeaturizer
from gradsketch.attribution._traker_records import TRAKRecords

#: Per-layer rows kept dense only where a layer sees several positions per example.
DENSE_ROWS = ("grads", "fisher_grads")


class StoredRows:
    """Which form the training rows of the loaded checkpoint are stored in.

    Args:
        records: the store's records.
        featurizer: the per-layer featurizer (``None``: projected rows, always dense).
        train_set_size: n.
        width: k, the width of a dense row.
        dtype: numpy storage dtype.
        dense_chunk_rows: rows per chunk of dense arrays.
        chunk_rows: rows per chunk of the narrow arrays (whole dense chunks).
        stored_arrays: the preconditioner's extra per-row arrays.
    """

    def __init__(
        self,
        records: TRAKRecords,
        featurizer: KroneckerFeaturizer | None,
        train_set_size: int,
        width: int,
        dtype: Any,
        dense_chunk_rows: int,
        chunk_rows: int,
        stored_arrays: Sequence[str],
    ) -> None:
        self.records = records
        self.featurizer = featurizer
        self.n, self.width, self.dtype = train_set_size, width, dtype
        self.dense_chunk_rows, self.chunk_rows = dense_chunk_rows, chunk_rows
        self.stored_arrays = tuple(stored_arrays)
        self.dense = featurizer is None
        self.tokens: list[int] | None = None
        #: Boolean ``[n]``: the rows this process writes (``None``: every row).
        self.owned: np.ndarray | None = None

    @property
    def store(self) -> RowStore:
        """The row store."""
        return self.records.store

    def _featurizer(self) -> KroneckerFeaturizer:
        assert self.featurizer is not None, "projected rows have one form"
        return self.featurizer

    def resume(self, model_id: int, owned: np.ndarray | None = None) -> None:
        """Take the form of ``model_id``'s stored rows; this process writes the rows ``owned``.

        A row of ``owned`` stored in a narrower form than the store's (a rank
        killed before :meth:`settle`) is found missing by the store's checks
        and featurized again.
        """
        self.owned = owned
        self.dense = self.featurizer is None or self.store.has(
            layout.checkpoint_array(model_id, "grads")
        )
        self.tokens = None if self.dense else self.records.checkpoint(model_id).get("tokens")

    def row_arrays(self, model_id: int) -> list[str]:
        """The stored per-row arrays of ``model_id`` (those that exist)."""
        names = dict.fromkeys(
            ("grads", "out_to_loss", "features", *self.stored_arrays, "token_factors")
        )
        if self.store.has(layout.checkpoint_array(model_id, "grads")):
            # Dense rows stored: every row is there (NaN rank-one rows mark them).
            names.pop("rank_one", None)
            names.pop("token_factors", None)
        elif self.store.has(layout.checkpoint_array(model_id, "token_factors")):
            names.pop("rank_one", None)
        arrays = [layout.checkpoint_array(model_id, name) for name in names]
        return [a for a in arrays if self.store.has(a)]

    def mode(self, model_id: int, tokens: Sequence[int]) -> str:
        """How a batch's per-layer rows are kept: ``"rank_one"``, ``"factored"`` or ``"dense"``.

        Rows start as each layer's ``[a, g]`` (``rank_one``). The first batch
        whose layers see several positions picks ``token_factors`` where that
        is narrower than the dense ``vec(sum_t g_t a_tᵀ)``, else dense rows; a
        later batch with more positions than stored turns the store dense.
        Under ``torch.distributed`` the first rank to get there picks the
        counts (:meth:`_claim_tokens`) and the others take them.
        """
        if self.dense:
            return "dense"
        if self.tokens is None and all(t == 1 for t in tokens):
            return "rank_one"
        if self.tokens is None:
            claimed = self._claim_tokens(model_id, list(tokens))
            if claimed is not None:
                self._to_tokens(model_id, claimed)
        if self.tokens is not None and all(t <= s for t, s in zip(tokens, self.tokens)):
            return "factored"
        self.require_dense(model_id)
        return "dense"

    def _claim_tokens(self, model_id: int, tokens: list[int]) -> list[int] | None:
        """The store's positions per layer: ``tokens`` if this process picks them first.

        Under the store's write lock (other ranks may get here at once): the
        counts another rank recorded with its ``token_factors``, else
        ``tokens`` (recorded, and the array created) where that form is
        narrower than the dense rows. ``None``: dense rows.
        """
        featurizer = self._featurizer()
        arr = functools.partial(layout.checkpoint_array, model_id)
        self.store.flush()  # before the lock: the background writer takes it too
        with self.store.lock.held():
            if self.store.has(arr("grads")):
                return None  # another rank turned the rows dense
            stored = self.records.checkpoint(model_id).get("tokens")
            if stored is not None and self.store.has(arr("token_factors")):
                return [int(t) for t in stored]
            width = featurizer.row_width("token_factors", tokens)
            if width >= featurizer.dense_width():
                return None
            # Created, or (left by a run restarted with load_from_save_dir=False) checked.
            self.store.require_array(
                arr("token_factors"), (self.n, width), self.dtype, chunk_rows=self.dense_chunk_rows
            )
            self.records.update_checkpoint(model_id, tokens=tokens)
        return tokens

    def compact(self, model_id: int, rows: np.ndarray) -> Any:
        """Per-layer parts of stored factored rows ``rows`` (rank-one or token factors)."""
        name = "rank_one" if self.tokens is None else "token_factors"
        x = self.store.array(layout.checkpoint_array(model_id, name)).oindex[rows]
        return self._featurizer().split_rank_one(torch.from_numpy(np.asarray(x)), self.tokens)

    def _rewrite(self, model_id: int, write: Callable[[np.ndarray, Any], None]) -> None:
        """``write(rows, parts)`` for this process's stored rows of ``model_id``, chunk by chunk."""
        self.store.flush()
        done = self.store.done_rows(layout.checkpoint_array(model_id, "done"))
        if self.owned is not None:
            done &= self.owned  # other ranks' rows are theirs to rewrite
        for start in range(0, self.n, self.chunk_rows):
            rows = np.nonzero(done[start : start + self.chunk_rows])[0] + start
            if rows.size:
                write(rows, self.compact(model_id, rows))

    def _to_tokens(self, model_id: int, tokens: list[int]) -> None:
        """Rewrite this process's rank-one rows into ``token_factors`` (which must exist)."""
        featurizer = self._featurizer()
        factored = self.store.array(layout.checkpoint_array(model_id, "token_factors"))

        def write(rows: np.ndarray, parts: Any) -> None:
            factored.oindex[rows] = featurizer.factored_rows(parts, tokens).numpy()

        self._rewrite(model_id, write)
        self.tokens = tokens

    def settle(self, model_id: int) -> None:
        """Rewrite this process's rows of ``model_id`` into the store's form, if narrower.

        Under ``torch.distributed`` another rank may have widened the form
        (``token_factors``, or dense rows) after this one stored its rows;
        call it once every rank is done featurizing ``model_id``, on every
        rank. In one process the rows are always in the store's form.
        """
        if self.featurizer is None or self.dense:
            return
        arr = functools.partial(layout.checkpoint_array, model_id)
        if self.store.has(arr("grads")):
            self.require_dense(model_id)
            return
        tokens = self.records.checkpoint(model_id).get("tokens")
        if self.tokens is None and tokens is not None:  # another rank recorded positions
            self._to_tokens(model_id, [int(t) for t in tokens])

    def require_dense(self, model_id: int) -> None:
        """Create the dense per-layer rows of ``model_id``, filled for its stored rows."""
        featurizer = self._featurizer()
        for name in (x for x in ("grads", *self.stored_arrays) if x in DENSE_ROWS):
            dense = self.store.require_array(
                layout.checkpoint_array(model_id, name),
                (self.n, self.width),
                self.dtype,
                chunk_rows=self.dense_chunk_rows,
            )
            sampled = name == "fisher_grads"

            def write(rows: np.ndarray, parts: Any, dense: Any = dense, s: bool = sampled) -> None:
                pairs = [(a, gs if s and gs is not None else g) for a, g, gs in parts]
                dense.oindex[rows] = featurizer.features(pairs).numpy()

            self._rewrite(model_id, write)
        self.dense = True

    def array(self, model_id: int, name: str = "grads") -> Any:
        """The stored ``[n, k]`` rows ``name`` of checkpoint ``model_id``, as an array.

        Compact rows come as a view that expands ``vec(g aᵀ)`` as row slices
        are read (``view[i:j]``, a numpy array).
        """
        arr = functools.partial(layout.checkpoint_array, model_id)
        if self.featurizer is None or self.store.has(arr(name)):
            return self.store.array(arr(name))
        tokens = self.records.checkpoint(model_id).get("tokens")
        return FactoredRows(
            self.store.array(arr("rank_one" if tokens is None else "token_factors")),
            self.featurizer,
            tokens=tokens,
            sampled=name == "fisher_grads",
        )

    def factored(self, model_id: int) -> tuple[Any, list[int] | None]:
        """The compact rows of ``model_id`` and their token counts (``None``: dense rows)."""
        arr = functools.partial(layout.checkpoint_array, model_id)
        if self.featurizer is None or self.store.has(arr("grads")):
            return None, None
        tokens = self.records.checkpoint(model_id).get("tokens")
        return self.store.array(arr("rank_one" if tokens is None else "token_factors")), tokens
