"""TRAKer's on-disk layout under ``save_dir``, named in one place.

Every name below is relative to ``save_dir`` (the root of the
:class:`gradsketch._store.RowStore`); arrays are zarr arrays of that store,
records are JSON files::

    settings.json                           the TRAKSettings record (every array also
                                            records its fingerprint in its attributes)
    checkpoints/{model_id}/checkpoint.json  {"checkpoint": fingerprint, "finalized", "features"}
                                            (method="replay": also "run", its rows' and
                                            order's fingerprint; one model id per store)
    checkpoints/{model_id}/grads            [n, k] projected training gradients
    checkpoints/{model_id}/out_to_loss      [n, 1] out-to-loss terms Q
    checkpoints/{model_id}/done             uint8 [n] rows featurized
    checkpoints/{model_id}/xtx              [k, k] XᵀX (finalize_features)
    checkpoints/{model_id}/features         [n, k] X (XᵀX + λI)⁻¹ (del_grads=True)
    checkpoints/{model_id}/fisher_grads     [n, k] features under sampled labels (EK-FAC)
    checkpoints/{model_id}/rank_one         [n, Σ k_in + k_out] each layer's [a, g] (per-layer
                                            methods, where every layer sees one position)
    checkpoints/{model_id}/token_factors    [n, Σ T_l (k_in + k_out)] each layer's T_l positions
                                            of [a, g] (where narrower than the dense rows;
                                            T_l in the checkpoint record's "tokens")
    checkpoints/{model_id}/{key}            a finalized preconditioner's state arrays
    experiments/{exp_name}/experiment.json  {"num_targets"}
    experiments/{exp_name}/{model_id}/grads [m, k] projected target gradients (method="replay":
                                            [m, n] float64, each query's metagradients)
    experiments/{exp_name}/{model_id}/done  uint8 [m] targets featurized
    scores/{exp_name}                       [n, m] scores (float64 for method="replay")
    scores/{exp_name}.json                  {"model_ids", "num_targets"}
    scores/{exp_name}.done                  uint8 [n] score rows written (rows="recompute":
                                            a killed finalize_scores resumes from them)

Example:
    >>> checkpoint_array(3, "grads")
    'checkpoints/3/grads'
    >>> target_array("val", 3, "done")
    'experiments/val/3/done'
"""

from __future__ import annotations

from pathlib import Path

#: Directory of the per-checkpoint arrays and records.
CHECKPOINTS = "checkpoints"
#: Directory of the per-experiment target features.
EXPERIMENTS = "experiments"
#: Directory of the finished scores.
SCORES = "scores"
#: File name of a checkpoint's record.
CHECKPOINT_RECORD = "checkpoint.json"
#: File name of an experiment's record.
EXPERIMENT_RECORD = "experiment.json"
#: Arrays stored per checkpoint.
CHECKPOINT_ARRAYS = (
    "grads",
    "out_to_loss",
    "done",
    "xtx",
    "features",
    "fisher_grads",
    "rank_one",
    "token_factors",
)
#: Arrays stored per experiment and checkpoint (``token_grads``: per-token targets).
TARGET_ARRAYS = ("grads", "done", "token_grads")


def _check(array: str, allowed: tuple[str, ...]) -> str:
    if array not in allowed:
        raise ValueError(f"`array` must be one of {list(allowed)}, got {array!r}.")
    return array


def checkpoint_dir(model_id: int) -> str:
    """``checkpoints/{model_id}``."""
    return f"{CHECKPOINTS}/{int(model_id)}"


def checkpoint_array(model_id: int, array: str) -> str:
    """``checkpoints/{model_id}/{array}`` for ``array`` in :data:`CHECKPOINT_ARRAYS`."""
    return f"{checkpoint_dir(model_id)}/{_check(array, CHECKPOINT_ARRAYS)}"


def checkpoint_record(model_id: int) -> str:
    """``checkpoints/{model_id}/checkpoint.json``: fingerprint and finalization state."""
    return f"{checkpoint_dir(model_id)}/{CHECKPOINT_RECORD}"


def checkpoint_ids(save_dir: Path) -> list[int]:
    """Model ids that have a checkpoint record under ``save_dir``, sorted."""
    root = save_dir / CHECKPOINTS
    if not root.exists():
        return []
    return sorted(int(p.name) for p in root.iterdir() if (p / CHECKPOINT_RECORD).exists())


def experiment_dir(exp_name: str) -> str:
    """``experiments/{exp_name}``."""
    return f"{EXPERIMENTS}/{exp_name}"


def experiment_record(exp_name: str) -> str:
    """``experiments/{exp_name}/experiment.json``: the experiment's ``num_targets``."""
    return f"{experiment_dir(exp_name)}/{EXPERIMENT_RECORD}"


def target_array(exp_name: str, model_id: int, array: str) -> str:
    """``experiments/{exp_name}/{model_id}/{array}`` for ``array`` in :data:`TARGET_ARRAYS`."""
    return f"{experiment_dir(exp_name)}/{int(model_id)}/{_check(array, TARGET_ARRAYS)}"


def scores_array(exp_name: str) -> str:
    """``scores/{exp_name}``: the ensembled ``[n, m]`` scores."""
    return f"{SCORES}/{exp_name}"


def scores_done(exp_name: str) -> str:
    """``scores/{exp_name}.done``: which rows of the scores are written (``rows="recompute"``)."""
    return f"{SCORES}/{exp_name}.done"


def scores_record(exp_name: str) -> str:
    """``scores/{exp_name}.json``: which model ids were ensembled, and ``num_targets``."""
    return f"{SCORES}/{exp_name}.json"


#: Per-checkpoint arrays the features and preconditioner state must not be named.
_ROW_ARRAYS = (
    "grads",
    "out_to_loss",
    "done",
    "features",
    "fisher_grads",
    "rank_one",
    "token_factors",
)


def checkpoint_state(model_id: int, key: str) -> str:
    """``checkpoints/{model_id}/{key}``: one array of a finalized preconditioner's state.

    TRAK's is ``xtx``; K-FAC's ``q_a_{i}``, ``q_s_{i}``, ``eigenvalues_{i}`` per layer.

    Example:
        >>> checkpoint_state(0, "xtx")
        'checkpoints/0/xtx'
    """
    if not key.isidentifier() or key in _ROW_ARRAYS:
        raise ValueError(
            f"preconditioner state key {key!r} must be an identifier other than "
            f"{list(_ROW_ARRAYS)}."
        )
    return f"{checkpoint_dir(model_id)}/{key}"
