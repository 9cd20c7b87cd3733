"""The TRAK scoring kernel: ensemble of damped least-squares influence, streamed in tiles.

For checkpoints ``c = 1..C`` with projected, normalised training gradients
``X_c`` ``[n, k]``, target gradients ``T_c`` ``[m, k]`` and out-to-loss terms
``Q_c`` ``[n]``, the TRAK scores are (Park et al., "TRAK: Attributing Model
Behavior at Scale", ICML 2023, eq. 8 with ridge damping)::

    scores = (1/C Σ_c X_c (X_cᵀX_c + λI)⁻¹ T_cᵀ) ⊙ (1/C Σ_c Q_c)      [n, m]

Deliberate differences from ``traker``:

* traker rescales each checkpoint's inverse by its mean absolute entry
  (``xtx_inv /= xtx_inv.abs().mean()``) before the float16 cast. That
  multiplies checkpoint ``c``'s term by an arbitrary constant, so checkpoints
  are weighted by how large their inverse happens to be. gradsketch keeps
  float32 throughout and applies the formula as written: every checkpoint
  weighs ``1/C``. With one checkpoint the two differ by a global scale only.
* No ``n x k`` feature matrix is formed when ``m < n``: ``(XᵀX + λI)⁻¹`` is
  applied to the ``m`` targets (``k² m`` flops) instead of to the ``n``
  training rows (``n k²`` flops); the scores are the same.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from torch import Tensor
from tqdm.auto import tqdm

from gradsketch._checks import check_number, positive_int
from gradsketch._store import array_options
from gradsketch.attribution._distributed import (
    ColumnWindow,
    all_gather_columns,
    barrier,
    column_shard,
    rank_and_world,
    shard_checkpoint_targets,
)
from gradsketch.attribution._io import (
    array_writer,
    block_plan,
    ceil_div,
    default_block_rows,
    iter_row_blocks,
    rows_as_tensor,
)
from gradsketch.attribution._linalg import (
    damped_inverse,
    damped_solver,
    matmul_nt,
    resolve_lambda,
    resolve_precision,
    xtx_blocked,
)
from gradsketch.errors import MemoryBudgetError

logger = logging.getLogger(__name__)

#: Allowed values of ``apply_inverse_to``.
APPLY_INVERSE_TO = ("auto", "targets", "train")


#: How to fix a bad ``memory_budget`` (shared by every function that takes one).
MEMORY_BUDGET_FIX = "pass a number of bytes, e.g. memory_budget=2 * 1024**3, or None"


@dataclass
class CheckpointGrads:
    """One checkpoint's inputs to the scoring kernel.

    Attributes:
        train: ``[n, k]`` normalised projected training gradients (tensor,
            numpy array, memmap or zarr array).
        targets: ``[m, k]`` normalised projected target gradients.
        out_to_loss: ``[n]`` or ``[n, 1]`` out-to-loss terms Q.
        xtx: optional precomputed ``[k, k]`` XᵀX (skips a pass over ``train``).
        preconditioned: ``train`` already holds the features ``X (XᵀX + λI)⁻¹``.
        solve: optional ``[m, k] -> [m, k]`` map applied to the targets in
            place of ``(XᵀX + λI)⁻¹`` (a fitted preconditioner's ``P⁻¹``).
        q_per_checkpoint: weight this checkpoint's scores by its own Q
            (``mean_c Q_c ⊙ X_c P_c⁻¹ T_cᵀ``) instead of the checkpoints' mean Q.
        scores_given: ``targets`` holds the scores themselves, ``[m, n]``, one
            row per target (the replay's metagradients); ``train`` and
            ``out_to_loss`` are unused.
        cache: where this checkpoint's damped factor (and rows) are kept
            between calls (a TRAKer's
            :class:`~gradsketch.attribution._score_cache.CheckpointCache`);
            used with ``xtx`` given, where the inverse applies to the targets.
    """

    train: Any
    targets: Any
    out_to_loss: Any
    xtx: Tensor | None = None
    preconditioned: bool = False
    solve: Callable[[Tensor], Tensor] | None = None
    q_per_checkpoint: bool = False
    scores_given: bool = False
    cache: Any = None

    @property
    def sizes(self) -> tuple[int, int, int]:
        """``(n, k, m)``: training rows, row width, targets (``k = n`` for given scores)."""
        m = int(self.targets.shape[0])
        if self.scores_given:
            n = int(self.targets.shape[1])
            return n, n, m
        n, k = (int(s) for s in self.train.shape)
        return n, k, m


def _forms_gram(
    checkpoints: Sequence[CheckpointGrads], solves: Sequence[Any] | None = None
) -> bool:
    """Whether scoring forms TRAK's ``k x k`` XᵀX (counted in a memory budget).

    It does for any checkpoint whose rows are not preconditioned already and
    that has no solve in ``solves`` (default: the preconditioners' own; a
    factor kept by a scoring cache counts as one, as the cache holds it).
    """
    given = solves if solves is not None else [ck.solve for ck in checkpoints]
    return any(not ck.preconditioned and s is None for ck, s in zip(checkpoints, given))


def _order(checkpoints: Sequence[CheckpointGrads], apply_inverse_to: str, n: int, m: int) -> str:
    """``"targets"`` or ``"train"``: where the damped inverse is applied."""
    if any(ck.solve is not None for ck in checkpoints):
        return "targets"  # a preconditioner's solve applies to the targets only
    if apply_inverse_to == "auto":
        # k² m flops to apply the inverse to the targets, n k² to the train rows.
        return "targets" if m <= n else "train"
    return apply_inverse_to


def _cached_inputs(
    checkpoints: Sequence[CheckpointGrads],
    lam_setting: float | str,
    dev: torch.device,
    work: torch.dtype,
) -> tuple[list[Any], list[Any]]:
    """Each checkpoint's solve and rows from its cache (``ck.cache``), or ``None`` / its rows.

    Only checkpoints with a given XᵀX and a cache: the solve is the cached
    factor's (made and kept where it fits), and the rows are held in memory
    where they fit beside it (:mod:`~gradsketch.attribution._score_cache`).
    """
    solves: list[Any] = [ck.solve for ck in checkpoints]
    trains: list[Any] = [ck.train for ck in checkpoints]
    for c, ck in enumerate(checkpoints):
        if ck.cache is None or ck.xtx is None or ck.preconditioned or ck.solve is not None:
            continue
        xtx = ck.xtx.to(device=dev, dtype=torch.float32)
        lam = resolve_lambda(lam_setting, xtx)
        solves[c] = ck.cache.solver(xtx, lam, functools.partial(damped_solver, xtx, lam))
        n = int(ck.train.shape[0])
        read = functools.partial(rows_as_tensor, ck.train, 0, n, device=dev, dtype=work)
        trains[c] = ck.cache.rows(ck.train, work, read)
    return solves, trains


def _is_float64(array: Any) -> bool:
    dtype = getattr(array, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype == torch.float64
    return dtype is not None and np.dtype(dtype) == np.float64


def check_lambda(lambda_reg: object) -> float | str:
    """``lambda_reg`` is a non-negative finite number or ``"auto"``."""
    fix = "use 0.0 for TRAK's default or 'auto' for the cheap damping heuristic"
    value = check_number("lambda_reg", lambda_reg, low=0, also=("auto",), fix=fix)
    return "auto" if value == "auto" else float(value)


def _check_shapes(ckpts: Sequence[CheckpointGrads]) -> tuple[int, int, int]:
    if not ckpts:
        raise ValueError("`checkpoints` is empty; pass at least one checkpoint's gradients.")
    n, k, m = ckpts[0].sizes
    given = [ck.scores_given for ck in ckpts]
    if any(given) and not all(given):
        raise ValueError(
            "`checkpoints` mix given scores (scores_given=True) and gradients; ensemble one "
            "method's checkpoints at a time."
        )
    for c, ck in enumerate(ckpts):
        if ck.scores_given:
            if ck.sizes != (n, k, m):
                raise ValueError(
                    f"the given scores of checkpoint {c} have shape {tuple(ck.targets.shape)}; "
                    f"expected ({m}, {n}) [n_targets, n_train] like the first checkpoint."
                )
            continue
        if len(ck.train.shape) != 2 or tuple(ck.train.shape) != (n, k):
            raise ValueError(
                f"`train_grads` of checkpoint {c} has shape {tuple(ck.train.shape)}; expected "
                f"({n}, {k}) [n_train, proj_dim] like the first checkpoint."
            )
        if len(ck.targets.shape) != 2 or tuple(ck.targets.shape) != (m, k):
            raise ValueError(
                f"`target_grads` has shape {tuple(ck.targets.shape)} but the training gradients "
                f"have proj_dim {k}; expected ({m}, {k}) [n_targets, proj_dim]. Project targets "
                "and training examples with the same projector."
            )
        q_shape = tuple(int(s) for s in ck.out_to_loss.shape)
        if q_shape not in ((n,), (n, 1)):
            raise ValueError(
                f"`out_to_loss` has shape {q_shape}; expected ({n},) or ({n}, 1), one entry per "
                "training row."
            )
    return n, k, m


def create_score_array(
    path: str | Path, n: int, m: int, chunks: tuple[int, int], dtype: str = "float32"
) -> Any:
    """A fresh ``[n, m]`` zarr score matrix at ``path`` (replacing one there).

    Uncompressed (scores barely compress), checksummed, and zero-filled, so
    tiles not yet written read as 0.
    """
    return zarr.create_array(
        str(path),
        shape=(n, m),
        dtype=dtype,
        chunks=chunks,
        overwrite=True,
        **array_options(dtype, fill_value=0),  # a crc32c checksum per chunk
    )


def score_dtype(checkpoints: Sequence[CheckpointGrads]) -> str:
    """``"float64"`` for given float64 scores (the replay's), else ``"float32"``."""
    given = all(ck.scores_given for ck in checkpoints)
    return "float64" if given and _is_float64(checkpoints[0].targets) else "float32"


def _prepare_out(
    out: Any,
    n: int,
    m: int,
    n_block: int,
    m_block: int,
    memory_budget: int | None,
    dtype: str = "float32",
) -> Any:
    """Where the scores go: a fresh numpy array, the caller's array, or a zarr array on disk."""
    if out is None:
        size = np.dtype(dtype).itemsize * n * m
        if memory_budget is not None and size > memory_budget:
            raise MemoryBudgetError(
                f"the score matrix needs {size} bytes ({n} x {m} {dtype}) but "
                f"`memory_budget`={memory_budget}; pass out='some/dir.zarr' (or a zarr array) "
                "to write it to disk in tiles, or raise the budget."
            )
        # A numpy array backed by torch's allocator: numpy asks for transparent
        # huge pages on large arrays, and where the kernel compacts memory to
        # serve them (THP defrag "madvise"), first-touching a 1 GB score matrix
        # inside the GEMM cost 0.4-1.3 s more than regular pages.
        return torch.empty((n, m), dtype=getattr(torch, dtype)).numpy()
    if isinstance(out, (str, Path)):
        return create_score_array(out, n, m, (n_block, m_block), dtype)
    if tuple(out.shape) != (n, m):
        raise ValueError(
            f"`out` has shape {tuple(out.shape)}; the scores need ({n}, {m}) [n_train, n_targets]."
        )
    return out


def score_checkpoints(
    checkpoints: Sequence[CheckpointGrads],
    lambda_reg: float | str = 0.0,
    memory_budget: int | None = None,
    *,
    out: Any = None,
    apply_inverse_to: str = "auto",
    copy_to: Any = None,
    precision: str = "float32",
    device: torch.device | str | None = None,
    progress: bool = True,
) -> Any:
    """Ensemble TRAK scores over checkpoints (module docstring formula), in tiles.

    Every checkpoint's rows are read once per target block, one row block at
    a time (without a budget: blocks of about 64 MB), the next block being
    read from disk while the current one is multiplied; tiles bound for disk
    are written in the background while the next tile is multiplied.

    Args:
        checkpoints: one :class:`CheckpointGrads` per checkpoint.
        lambda_reg: ridge damping λ >= 0, or ``"auto"``.
        memory_budget: bytes of working memory (``None``: unbounded).
        out: destination: ``None`` (a new numpy array), an array of shape
            ``[n, m]``, or a path where a zarr array is created.
        apply_inverse_to: ``"targets"`` (``X (A⁻¹ Tᵀ)``), ``"train"``
            (``(X A⁻¹) Tᵀ``, TRAK's order) or ``"auto"`` (the cheaper).
        copy_to: optional second ``[n, m]`` destination (say a zarr array
            that keeps the in-memory result on disk) filled tile by tile in
            the background.
        precision: ``"float32"``, ``"bf16x3"`` or ``"auto"`` for the large GEMM.
        device: where to multiply (default: CPU, or the inputs' device).
        progress: show a tqdm bar over tiles.

    Returns:
        ``[n, m]`` float32 scores: ``out`` (or the new numpy array); float64
        for given float64 scores (``scores_given``).
    """
    lam_setting = check_lambda(lambda_reg)
    if apply_inverse_to not in APPLY_INVERSE_TO:
        raise ValueError(
            f"`apply_inverse_to` must be one of {list(APPLY_INVERSE_TO)}, got {apply_inverse_to!r}."
        )
    positive_int("memory_budget", memory_budget, optional=True, fix=MEMORY_BUDGET_FIX)
    n, k, m = _check_shapes(checkpoints)
    if checkpoints[0].scores_given:
        return _given_scores(checkpoints, memory_budget, out=out, copy_to=copy_to)
    if device is None:
        first = checkpoints[0].train
        device = first.device if isinstance(first, Tensor) else "cpu"
    dev = torch.device(device)
    prec = resolve_precision(precision, dev)
    cks = len(checkpoints)
    order = _order(checkpoints, apply_inverse_to, n, m)
    # float64 stores (influence's exact mode) are multiplied in float64.
    work = torch.float64 if any(_is_float64(ck.train) for ck in checkpoints) else torch.float32
    solves, trains = [ck.solve for ck in checkpoints], [ck.train for ck in checkpoints]
    if order == "targets":
        solves, trains = _cached_inputs(checkpoints, lam_setting, dev, work)
    held = max((ck.cache.held for ck in checkpoints if ck.cache is not None), default=0)
    # What the cache holds counts against the budget: the blocks get the rest.
    budget = memory_budget if memory_budget is None or not held else memory_budget - held
    # A factor made for this call only (not kept by a cache) is held with the blocks.
    kept = [s if ck.cache is None or ck.cache.kept else None for ck, s in zip(checkpoints, solves)]
    gram = _forms_gram(checkpoints, kept)
    try:
        n_block, m_block = block_plan(n, m, k, cks, budget, gram=gram)
    except ValueError:
        if budget == memory_budget:
            raise
        # The blocks do not fit beside the cache (a checkpoint not cached still forms its
        # XᵀX): the cache lets go of these checkpoints, and the blocks get the whole budget.
        for ck in checkpoints:
            if ck.cache is not None:
                ck.cache.forget()
        trains = [ck.train for ck in checkpoints]
        n_block, m_block = block_plan(n, m, k, cks, memory_budget, gram=gram)
    if memory_budget is None:
        # Unbounded memory still reads in blocks: a whole [n, k] store at once
        # would double the peak memory for no speed (each block's GEMM is large).
        n_block = default_block_rows(n, k)
    if copy_to is not None and tuple(copy_to.shape) != (n, m):
        raise ValueError(f"`copy_to` has shape {tuple(copy_to.shape)}; the scores need ({n}, {m}).")
    chunk = getattr(copy_to, "chunks", None)
    if chunk and n_block > int(chunk[0]):
        # Whole chunks per tile, so that no two tile writes share a chunk file.
        n_block -= n_block % int(chunk[0])
    result = _prepare_out(out, n, m, n_block, m_block, memory_budget)
    per_ckpt = [ck.q_per_checkpoint for ck in checkpoints]
    if any(per_ckpt) and not all(per_ckpt):
        raise ValueError(
            "`checkpoints` mix q_per_checkpoint=True and False; ensemble one method's "
            "checkpoints at a time."
        )
    # Pass 1: per checkpoint, XᵀX and its damped inverse (applied to the
    # targets: only its solve, never the [k, k] matrix); mean out-to-loss.
    inverses: list[Tensor | None] = [None] * cks
    q_mean = torch.zeros(n, dtype=work)
    q_each: list[Tensor] = []
    for c, ck in enumerate(checkpoints):
        q_c = rows_as_tensor(ck.out_to_loss, 0, n, device=torch.device("cpu"), dtype=work)
        q_mean += q_c.reshape(n)
        if ck.q_per_checkpoint:
            q_each.append((q_c.reshape(n) / cks).to(dev))
        if ck.preconditioned or solves[c] is not None:
            continue
        xtx = ck.xtx
        if xtx is None:
            xtx = xtx_blocked(
                ck.train, block_rows=n_block, device=dev, prefetch=memory_budget is None
            )
        xtx = xtx.to(device=dev, dtype=torch.float32)
        lam = resolve_lambda(lam_setting, xtx)
        logger.debug("damping λ = %g (lambda_reg=%r)", lam, lambda_reg)
        if order == "targets":
            solves[c] = damped_solver(xtx, lam)
        else:
            inverses[c] = damped_inverse(xtx, lam)
    q_mean /= cks

    n_tiles = ceil_div(n, n_block) * ceil_div(m, m_block)
    bar = tqdm(total=n_tiles, desc="scoring tiles", disable=not progress or n_tiles < 2)
    row_weight = (q_mean / cks).to(dev)
    # The row weights Q/C are shared by every checkpoint: they scale a tile of
    # scores once (n m_block work) or X's rows per checkpoint (C n k), the cheaper.
    # Per-checkpoint weights can only scale each checkpoint's rows.
    weight_scores = m_block <= cks * k and not q_each
    in_memory = isinstance(result, np.ndarray)
    direct = in_memory and dev.type == "cpu" and m_block == m
    writers = [array_writer(a) for a in ((copy_to,) if copy_to is not None else ())]
    if not in_memory:
        writers.append(array_writer(result))
    try:
        for j0 in range(0, m, m_block):
            j1 = min(m, j0 + m_block)
            # Right-hand sides for these targets: (A_c⁻¹ T_cᵀ)ᵀ = T_c A_c⁻¹ ([mj, k]).
            rhs = []
            for ck, solve in zip(checkpoints, solves):
                t = rows_as_tensor(ck.targets, j0, j1, device=dev, dtype=work)
                rhs.append(t if solve is None else solve(t).to(work))
            streams = [
                iter_row_blocks(
                    train,
                    n_block,
                    device=dev,
                    dtype=work,
                    prefetch=memory_budget is None,
                )
                for train in trains
            ]
            for i0 in range(0, n, n_block):
                i1 = min(n, i0 + n_block)
                if direct and work == torch.float32:
                    # Multiply straight into the result's memory: no temporary, no copy.
                    acc = torch.from_numpy(result[i0:i1])
                else:
                    acc = torch.empty(i1 - i0, j1 - j0, dtype=work, device=dev)
                for c, (stream, inv, r) in enumerate(zip(streams, inverses, rhs)):
                    _, _, x = next(stream)
                    weight = q_each[c] if q_each else row_weight
                    if not weight_scores and isinstance(trains[c], zarr.Array):
                        x.mul_(weight[i0:i1, None])  # a fresh copy read from disk
                    elif not weight_scores:
                        x = x * weight[i0:i1, None]  # may be a view of the caller's data
                    if order == "train" and inv is not None:
                        x = x @ inv
                    matmul_nt(x, r, prec, out=acc, accumulate=c > 0)
                if weight_scores:
                    acc.mul_(row_weight[i0:i1, None])
                tile = acc.float().cpu().numpy()
                if in_memory and not (direct and work == torch.float32):
                    result[i0:i1, j0:j1] = tile
                for writer in writers:
                    # The tile is not touched again, so the thread may read it later.
                    writer.submit((slice(i0, i1), slice(j0, j1), tile))
                bar.update(1)
            for stream in streams:
                stream.close()
    finally:
        for writer in writers:
            writer.close()
    bar.close()
    return result


def _given_scores(
    checkpoints: Sequence[CheckpointGrads],
    memory_budget: int | None,
    *,
    out: Any,
    copy_to: Any,
) -> Any:
    """The mean of given ``[m, n]`` score rows, transposed into ``[n, m]`` tiles.

    One checkpoint's scores are copied exactly (no arithmetic); ``out`` and
    ``copy_to`` are filled as :func:`score_checkpoints` fills them.
    """
    n, _, m = checkpoints[0].sizes
    dtype = score_dtype(checkpoints)
    width = np.dtype(dtype).itemsize * n * (len(checkpoints) + 1)
    m_block = m if memory_budget is None else max(1, min(m, memory_budget // width))
    if copy_to is not None and tuple(copy_to.shape) != (n, m):
        raise ValueError(f"`copy_to` has shape {tuple(copy_to.shape)}; the scores need ({n}, {m}).")
    result = _prepare_out(out, n, m, n, m_block, memory_budget, dtype)
    for j0 in range(0, m, m_block):
        j1 = min(m, j0 + m_block)
        rows = [np.asarray(ck.targets[j0:j1], dtype=dtype) for ck in checkpoints]
        tile = rows[0] if len(rows) == 1 else np.mean(rows, axis=0, dtype=dtype)
        for dest in (result, copy_to):
            if dest is not None:
                dest[0:n, j0:j1] = tile.T
    return result


def trak_scores(
    train_grads: Any,
    target_grads: Any,
    out_to_loss: Any,
    lambda_reg: float | str = 0.0,
    memory_budget: int | None = None,
    *,
    out: Any = None,
    apply_inverse_to: str = "auto",
    precision: str = "float32",
    device: torch.device | str | None = None,
    progress: bool = False,
) -> Any:
    """TRAK scores of one checkpoint from projected gradients, streamed in row blocks.

    ``scores = X (XᵀX + λI)⁻¹ Tᵀ ⊙ Q`` (Park et al., ICML 2023), where the
    gradients are already projected and divided by ``sqrt(#coordinates)``.
    XᵀX is built from symmetric tiles; the inverse is applied to the targets
    when ``m <= n`` (never forming the ``[n, k]`` features). Average several
    checkpoints with :class:`TRAKer` (or call it per checkpoint and average).

    Args:
        train_grads: ``[n, k]`` torch tensor, numpy array, memmap or zarr array.
        target_grads: ``[m, k]``, same kinds.
        out_to_loss: ``[n]`` or ``[n, 1]`` out-to-loss terms Q.
        lambda_reg: ridge damping λ >= 0, or ``"auto"`` (``0.1 * trace(XᵀX)/k``).
        memory_budget: bytes of working memory; ``None`` for unbounded. A score
            matrix larger than the budget needs ``out``.
        out: ``None`` (returns a numpy array), an ``[n, m]`` array to fill, or
            a path where a zarr array is created and returned.
        apply_inverse_to: ``"auto"``, ``"targets"`` or ``"train"`` (same scores).
        precision: ``"float32"`` (default), ``"bf16x3"`` (float32-accurate
            split-bfloat16 GEMM; measured slower on CPU, see
            :func:`~gradsketch.attribution._linalg.resolve_precision`) or
            ``"auto"`` (currently float32).
        device: where to multiply.
        progress: show a tqdm bar.

    Returns:
        ``[n, m]`` float32 scores (numpy array, or ``out``).

    Example:
        >>> g = torch.randn(50, 8, generator=torch.Generator().manual_seed(0))
        >>> s = trak_scores(g, g[:3], torch.ones(50))
        >>> s.shape
        (50, 3)
        >>> ref = g[:3] @ torch.linalg.inv(g.T @ g) @ g[:3].T
        >>> bool(np.allclose(s[:3], ref.numpy(), atol=1e-4))
        True
    """
    return score_checkpoints(
        [CheckpointGrads(train_grads, target_grads, out_to_loss)],
        lambda_reg,
        memory_budget,
        out=out,
        apply_inverse_to=apply_inverse_to,
        precision=precision,
        device=device,
        progress=progress,
    )


def ensemble_scores(
    checkpoints: Sequence[CheckpointGrads],
    lambda_reg: float | str,
    memory_budget: int | None,
    *,
    path: Path,
    copy_to: Callable[[], Any] | None = None,
    score_computer: Any = None,
    precision: str = "float32",
    device: torch.device | str | None = None,
    progress: bool = False,
) -> Any:
    """TRAKer's ensembled scores of several checkpoints, on one process or several.

    Three ways, same scores: under ``torch.distributed`` each rank scores its
    :func:`column_shard` of the targets; with a TRAK ``score_computer`` its
    in-memory matmuls are used; otherwise :func:`score_checkpoints` streams
    the tiles. A result larger than ``memory_budget`` goes to a zarr array
    at ``path``.

    Args:
        checkpoints: each checkpoint's gradients (same ``n``, ``m`` and ``k``).
        lambda_reg: ridge damping λ >= 0, or ``"auto"``.
        memory_budget: bytes of working memory; ``None`` for unbounded.
        path: where the zarr scores are created when they exceed the budget.
        copy_to: for an in-memory result, gives an ``[n, m]`` array that the
            scores are also written to (on rank 0, tile by tile where possible).
        score_computer: an :class:`AbstractScoreComputer`, or ``None``.
        precision: GEMM precision of :func:`score_checkpoints`.
        device: where to multiply.
        progress: show a tqdm bar (rank 0).

    Returns:
        ``[n, m]`` float32 scores: a numpy array, or the zarr array at ``path``.
    """
    n, _, m = checkpoints[0].sizes
    size = np.dtype(score_dtype(checkpoints)).itemsize * n * m
    on_disk = memory_budget is not None and size > memory_budget
    rank, world = rank_and_world()
    if world > 1:
        scores = _distributed_scores(
            checkpoints,
            lambda_reg,
            memory_budget,
            path if on_disk else None,
            score_computer=score_computer,
            precision=precision,
            device=device,
            progress=progress and rank == 0,
        )
    elif score_computer is not None:
        scores = scores_with_computer(score_computer, checkpoints, device=device)
    else:
        return score_checkpoints(
            checkpoints,
            lambda_reg,
            memory_budget,
            out=str(path) if on_disk else None,
            precision=precision,
            device=device,
            progress=progress,
            # The in-memory scores are saved tile by tile while the next
            # tile is multiplied, not in one pass at the end.
            copy_to=None if on_disk or copy_to is None else copy_to(),
        )
    if rank == 0 and not on_disk and copy_to is not None:
        copy_to()[:] = scores
    return scores


def _distributed_scores(
    checkpoints: Sequence[CheckpointGrads],
    lambda_reg: float | str,
    memory_budget: int | None,
    path: Path | None,
    *,
    score_computer: Any,
    precision: str,
    device: torch.device | str | None,
    progress: bool,
) -> Any:
    """Each rank scores the targets of its :func:`column_shard`; columns are assembled.

    Every score column depends on its own target only, so splitting the
    targets splits the work with no communication until the end:
    ``all_gather`` of the ``[n, m / W]`` blocks in memory, or each rank
    writing its own column chunk of the on-disk zarr array (at ``path``;
    ``None``: the scores fit in memory).
    """
    n, k, m = checkpoints[0].sizes
    rank, world = rank_and_world()
    cols = column_shard(m)
    mine = shard_checkpoint_targets(checkpoints, cols)
    out: Any = None
    if path is not None:
        width = len(column_shard(m, rank=0, world_size=world))
        cks = len(checkpoints)
        n_block, _ = block_plan(n, width, k, cks, memory_budget, gram=_forms_gram(checkpoints))
        if rank == 0:
            create_score_array(path, n, m, (n_block, width), score_dtype(checkpoints))
        barrier()
        scores = zarr.open_array(str(path), mode="r+")
        out = ColumnWindow(scores, cols.start, cols.stop)
    if len(cols) == 0:
        local = np.zeros((n, 0), dtype=score_dtype(checkpoints))
    elif score_computer is not None:
        local = scores_with_computer(score_computer, mine, device=device)
        if out is not None:
            out[:, :] = local
    else:
        local = score_checkpoints(
            mine,
            lambda_reg,
            memory_budget,
            out=out,
            precision=precision,
            device=device,
            progress=progress,
        )
    if path is not None:
        barrier()
        return zarr.open_array(str(path), mode="r")
    return all_gather_columns(torch.from_numpy(np.asarray(local)), m).numpy()


def scores_with_computer(
    score_computer: Any,
    checkpoints: Sequence[CheckpointGrads],
    *,
    device: torch.device | str | None = None,
) -> np.ndarray:
    """TRAK's in-memory path through a user-supplied score computer (``[n, m]`` float32)."""
    n = int(checkpoints[0].train.shape[0])
    acc = torch.zeros(n, int(checkpoints[0].targets.shape[0]))
    q = np.zeros((n, 1), dtype=np.float32)
    for ck in checkpoints:
        x = torch.as_tensor(np.asarray(ck.train[:]), device=device).float()
        feats = (
            x if ck.preconditioned else score_computer.get_x_xtx_inv(x, score_computer.get_xtx(x))
        )
        t = torch.as_tensor(np.asarray(ck.targets[:]), device=device).float()
        score_computer.get_scores(feats, t, accumulator=acc)
        q += np.asarray(ck.out_to_loss[:], dtype=np.float32)
    c = len(checkpoints)
    return (acc.numpy() / c) * (q / c)
