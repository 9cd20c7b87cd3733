"""TRAKer's per-token scores: ``[n, m, T]``, one score per training row, target and token.

Each target's stored per-token rows (``token_grads``, ``[m, T k]``) are
scored as ``m T`` targets; the scores sum over ``T`` to the ``[n, m]``
scores. Stored rows: under ``torch.distributed`` each rank scores its
column shard of the targets and the columns are gathered. Recomputed rows
(``rows="recompute"``): each rank scores its shard of the training rows and
the rows are summed (:meth:`~gradsketch.attribution._traker_recompute.Recompute.in_memory`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from gradsketch.attribution import _layout as layout
from gradsketch.attribution import _plan
from gradsketch.attribution._distributed import all_gather_columns, column_shard, rank_and_world
from gradsketch.attribution._scores import CheckpointGrads, score_checkpoints
from gradsketch.errors import MemoryBudgetError


def per_token_scores(
    traker: Any,
    exp_name: str,
    experiment: Mapping[str, Any],
    model_ids: Sequence[int],
    ckpts: Sequence[CheckpointGrads],
) -> np.ndarray:
    """``[n, m, T]`` scores of each target token of ``exp_name`` (a TRAKer's, in memory).

    Raises:
        ValueError: the experiment was not started with ``per_token=True``.
        MemoryBudgetError: the scores do not fit ``memory_budget`` or the
            available memory (:func:`check_token_memory`).
    """
    if not experiment.get("per_token"):
        raise ValueError(
            f"experiment {exp_name!r} was not started with per_token=True; start a new one "
            "with start_scoring_checkpoint(..., per_token=True) to get per-token scores."
        )
    n, m = traker.train_set_size, int(experiment["num_targets"])
    wide = np.float64 if traker.dtype == torch.float64 else np.float32
    k = traker.proj_dim
    first = traker.store.array(layout.target_array(exp_name, model_ids[0], "token_grads"))
    check_token_memory(exp_name, n, m, int(first.shape[1]) // k, k, len(model_ids), wide, traker)
    budget = traker.memory_budget
    recompute = getattr(traker._method, "recompute", None)
    rank, world = rank_and_world()
    # Stored rows: each rank scores its column shard of the targets.
    cols = column_shard(m) if world > 1 and recompute is None else range(m)
    per_token, length = [], 0
    for model_id, ck in zip(model_ids, ckpts, strict=True):
        # The targets' rows: [m, T * k] stored, [m * T, k] for the kernel.
        stored = traker.store.array(layout.target_array(exp_name, model_id, "token_grads"))
        length = int(stored.shape[1]) // k
        rows = np.asarray(stored[cols.start : cols.stop], dtype=wide)
        tokens = torch.from_numpy(rows.reshape(len(cols) * length, k))
        per_token.append(dataclasses.replace(ck, targets=tokens))
    if recompute is not None:
        scores = recompute.in_memory(model_ids, per_token, **traker._recompute_args())
        return np.asarray(scores).reshape(n, m, length)
    if len(cols):
        local = score_checkpoints(
            per_token,
            traker.lambda_reg,
            budget,
            precision=traker.precision,
            device=traker.device,
            progress=traker.progress and rank == 0,
        )
        local = torch.as_tensor(np.asarray(local)).reshape(n, len(cols), length)
    else:
        local = torch.zeros(n, 0, length)
    if world == 1:
        return local.numpy()
    # [n, m_r, T] -> [n T, m_r] columns, gathered -> [n, m, T] (bits copied).
    flat = local.permute(0, 2, 1).reshape(n * length, len(cols))
    whole = all_gather_columns(flat, m).reshape(n, length, m).permute(0, 2, 1)
    return whole.contiguous().numpy()


def check_token_memory(
    exp_name: str,
    n: int,
    m: int,
    length: int,
    k: int,
    checkpoints: int,
    dtype: Any,
    traker: Any,
) -> None:
    """Refuse per-token scores that cannot be held, before any is computed.

    The result is ``[n, m, T]`` numbers of ``dtype``, and each checkpoint's
    ``m T`` per-token target rows of ``k`` features are read beside it;
    ``memory_budget`` bounds the result, the available memory both.

    Raises:
        MemoryBudgetError: naming the shape, the bytes and the fixes.
    """
    itemsize = np.dtype(dtype).itemsize
    result = itemsize * n * m * length
    need = result + itemsize * m * length * k * checkpoints
    budget, free = traker.memory_budget, _plan.available_memory()
    if budget is not None and result > budget:
        short = f"`memory_budget`={budget}"
    elif free is not None and need > free:
        short = f"{free / 1e9:.2f} GB is available"
    else:
        return
    raise MemoryBudgetError(
        f"per-token scores of experiment {exp_name!r} ([n={n}, m={m}, T={length}] and "
        f"{checkpoints} checkpoint(s)' per-token target rows) need ~{need} bytes but {short}; "
        "score fewer targets per experiment, or truncate the targets to the tokens of interest."
    )
