"""Linear datamodeling score (LDS): how well attribution scores predict retraining.

For random training subsets ``S_1..S_M`` and a target ``j``, attribution
scores predict the target's output of a model trained on ``S_i`` as
``g_ij = Σ_{t ∈ S_i} scores[t, j]``. The LDS is the Spearman rank correlation
between ``g_·j`` and the actual outputs ``f_·j``, averaged over targets
(Park et al., ICML 2023, sec. 2; Ilyas et al., "Datamodels", ICML 2022).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, overload

import numpy as np
import torch
from scipy.stats import bootstrap, rankdata
from tqdm.auto import tqdm

from gradsketch._checks import check_int, positive_int


class LDSGroundTruth(NamedTuple):
    """Subsets and the retrained models' outputs.

    Attributes:
        subset_masks: bool ``[num_models, n_train]``, row i = training subset i.
        target_outputs: float ``[num_models, n_targets]``, outputs of model i.
    """

    subset_masks: np.ndarray
    target_outputs: np.ndarray


def _as_numpy(x: Any, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.ndim != 2:
        raise ValueError(f"`{name}` must be 2-D, got shape {arr.shape}.")
    return arr


def _spearman_columns(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Spearman correlation of each column of ``a`` with the same column of ``b``.

    Arrays are ``[..., num_models, n_targets]``; leading axes are batches
    (bootstrap resamples), and ties get average ranks.
    """
    ra = rankdata(a, axis=-2)
    rb = rankdata(b, axis=-2)
    ra = ra - ra.mean(axis=-2, keepdims=True)
    rb = rb - rb.mean(axis=-2, keepdims=True)
    num = (ra * rb).sum(axis=-2)
    den = np.sqrt((ra**2).sum(axis=-2) * (rb**2).sum(axis=-2))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


@overload
def linear_datamodeling_score(
    scores: Any,
    subset_masks: Any,
    target_outputs: Any,
    *,
    return_per_target: Literal[False] = ...,
) -> float: ...


@overload
def linear_datamodeling_score(
    scores: Any,
    subset_masks: Any,
    target_outputs: Any,
    *,
    return_per_target: Literal[True],
) -> tuple[float, np.ndarray]: ...


def linear_datamodeling_score(
    scores: Any,
    subset_masks: Any,
    target_outputs: Any,
    *,
    return_per_target: bool = False,
) -> float | tuple[float, np.ndarray]:
    """Mean over targets of Spearman(predicted subset sums, actual outputs).

    ``LDS = mean_j spearman_i(Σ_t masks[i, t] scores[t, j], target_outputs[i, j])``.
    Targets whose predictions or outputs are constant over subsets have no
    correlation and are left out of the mean.

    Args:
        scores: ``[n_train, n_targets]`` attribution scores.
        subset_masks: bool/0-1 ``[num_models, n_train]``.
        target_outputs: ``[num_models, n_targets]`` outputs of the retrained models.
        return_per_target: also return the ``[n_targets]`` correlations.

    Returns:
        The LDS (and the per-target correlations when asked).

    Example:
        >>> rng = np.random.default_rng(0)
        >>> scores = rng.normal(size=(20, 3))
        >>> masks = rng.random((10, 20)) < 0.5
        >>> round(linear_datamodeling_score(scores, masks, masks @ scores), 6)
        1.0
    """
    s = _as_numpy(scores, "scores").astype(np.float64)
    masks = _as_numpy(subset_masks, "subset_masks").astype(np.float64)
    outputs = _as_numpy(target_outputs, "target_outputs").astype(np.float64)
    if masks.shape[1] != s.shape[0]:
        raise ValueError(
            f"`subset_masks` has {masks.shape[1]} columns but `scores` has {s.shape[0]} "
            "training rows; masks are [num_models, n_train]."
        )
    if outputs.shape != (masks.shape[0], s.shape[1]):
        raise ValueError(
            f"`target_outputs` has shape {outputs.shape}; expected "
            f"({masks.shape[0]}, {s.shape[1]}) = [num_models, n_targets]."
        )
    if masks.shape[0] < 3:
        raise ValueError(
            f"`subset_masks` has {masks.shape[0]} models; a rank correlation needs at least 3 "
            "(30 or more for a stable LDS)."
        )
    per_target = _spearman_columns(masks @ s, outputs)
    valid = per_target[~np.isnan(per_target)]
    lds = float(valid.mean()) if valid.size else float("nan")
    if return_per_target:
        return lds, per_target
    return lds


class LDSInterval(NamedTuple):
    """An LDS (or a difference of two) with its bootstrap confidence interval.

    Attributes:
        estimate: the value on the given retrains.
        low: lower end of the interval.
        high: upper end of the interval.
    """

    estimate: float
    low: float
    high: float


def _lds_of_resamples(predicted: np.ndarray, outputs: np.ndarray) -> np.ndarray:
    """LDS of arrays ``[..., num_models, n_targets]`` (leading axes: resamples)."""
    per_target = _spearman_columns(predicted, outputs)
    valid = ~np.isnan(per_target)
    total = np.where(valid, per_target, 0.0).sum(axis=-1)
    count = valid.sum(axis=-1)
    return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def linear_datamodeling_interval(
    scores: Any,
    subset_masks: Any,
    target_outputs: Any,
    *,
    baseline_scores: Any = None,
    confidence_level: float = 0.95,
    n_resamples: int = 2000,
    seed: int = 0,
) -> LDSInterval:
    """The LDS with a bootstrap confidence interval over the retrained models.

    The retrained models (the random subsets) are resampled with replacement,
    the queries kept, and the LDS recomputed on each resample (ties from
    repeated models get average ranks); the interval is SciPy's BCa
    bootstrap (``scipy.stats.bootstrap``). With ``baseline_scores`` the
    statistic is ``LDS(scores) − LDS(baseline_scores)`` on the same resamples
    (a paired comparison): an interval that holds 0 means the retrains do
    not tell the two methods apart.

    Args:
        scores: ``[n_train, n_targets]`` attribution scores.
        subset_masks: bool/0-1 ``[num_models, n_train]``.
        target_outputs: ``[num_models, n_targets]`` outputs of the retrained models.
        baseline_scores: another method's ``[n_train, n_targets]`` scores to compare with.
        confidence_level: coverage of the interval, in (0, 1).
        n_resamples: bootstrap resamples (with 2,000 the Monte Carlo error of
            a 95 % interval's end is about 1.5 % of its width).
        seed: seed of the resampling.

    Returns:
        :class:`LDSInterval` ``(estimate, low, high)``.

    Example:
        >>> rng = np.random.default_rng(0)
        >>> scores = rng.normal(size=(20, 3))
        >>> masks = rng.random((40, 20)) < 0.5
        >>> outputs = masks @ scores + rng.normal(size=(40, 3))
        >>> est, low, high = linear_datamodeling_interval(scores, masks, outputs)
        >>> bool(low < est < high), round(est, 3) == round(
        ...     linear_datamodeling_score(scores, masks, outputs), 3)
        (True, True)
    """
    estimate = linear_datamodeling_score(scores, subset_masks, target_outputs)
    masks = _as_numpy(subset_masks, "subset_masks").astype(np.float64)
    outputs = _as_numpy(target_outputs, "target_outputs").astype(np.float64)
    predicted = [masks @ _as_numpy(scores, "scores").astype(np.float64)]
    if baseline_scores is not None:
        base = _as_numpy(baseline_scores, "baseline_scores").astype(np.float64)
        if base.shape != (masks.shape[1], outputs.shape[1]):
            raise ValueError(
                f"`baseline_scores` has shape {base.shape}; it must match `scores`, "
                f"[n_train, n_targets] = ({masks.shape[1]}, {outputs.shape[1]})."
            )
        estimate -= linear_datamodeling_score(base, masks, outputs)
        predicted.append(masks @ base)
    if not 0 < confidence_level < 1:
        raise ValueError(
            f"`confidence_level` must be in (0, 1), got {confidence_level!r}; 0.95 is usual."
        )
    check_int("n_resamples", n_resamples, low=100, fix="use 1,000 or more for a 95 % interval")
    if np.isnan(estimate):  # every target constant: no correlation to resample
        return LDSInterval(estimate, np.nan, np.nan)

    # SciPy resamples one-dimensional observations; a model's observation is
    # a row of every array, so the bootstrap resamples model indices.
    def statistic(models: np.ndarray, axis: int) -> np.ndarray:
        rows = np.moveaxis(models, axis, -1)  # [..., num_models] indices
        value = _lds_of_resamples(predicted[0][rows], outputs[rows])
        if len(predicted) == 2:
            value = value - _lds_of_resamples(predicted[1][rows], outputs[rows])
        return value

    with warnings.catch_warnings():
        # BCa divides by the spread of the jackknife values; where every
        # resample agrees (a perfect or identical predictor) SciPy warns and
        # returns NaN, and the percentile interval below is the answer.
        warnings.simplefilter("ignore")
        result = bootstrap(
            (np.arange(masks.shape[0]),),
            statistic,
            n_resamples=n_resamples,
            batch=max(1, 2**22 // outputs.size),
            vectorized=True,
            confidence_level=confidence_level,
            method="BCa",
            random_state=np.random.default_rng(seed),
        )
    low, high = result.confidence_interval
    if not (np.isfinite(low) and np.isfinite(high)):
        # Resamples whose every target is constant have no LDS; the rest decide.
        values = result.bootstrap_distribution[np.isfinite(result.bootstrap_distribution)]
        tail = (1 - confidence_level) / 2
        low, high = np.quantile(values, [tail, 1 - tail]) if values.size else (np.nan, np.nan)
    return LDSInterval(float(estimate), float(low), float(high))


def lds_ground_truth(
    train_fn: Callable[[np.ndarray, int], Any],
    eval_fn: Callable[[Any], Any],
    n_train: int,
    num_models: int,
    subset_fraction: float = 0.5,
    *,
    seed: int,
    progress: bool = True,
) -> LDSGroundTruth:
    """Retrain on random subsets and record the targets' outputs.

    Subset i has exactly ``round(subset_fraction * n_train)`` rows drawn
    without replacement from ``numpy.random.default_rng(seed)``; model i is
    ``train_fn(subset_indices, seed + 1 + i)``.

    Args:
        train_fn: ``(indices [s] int64, seed) -> model``.
        eval_fn: ``model -> [n_targets]`` outputs (e.g. margins of the targets).
        n_train: training set size.
        num_models: number of retrained models (30 or more recommended).
        subset_fraction: fraction of the training set in each subset, in (0, 1).
        seed: seed of the subsets and of the training runs.
        progress: show a tqdm bar.

    Returns:
        :class:`LDSGroundTruth` with the masks and outputs.

    Example:
        >>> def train(idx, seed):
        ...     return idx
        >>> def evaluate(idx):
        ...     return [len(idx), idx.sum()]
        >>> gt = lds_ground_truth(train, evaluate, 10, 4, seed=0, progress=False)
        >>> gt.subset_masks.shape, gt.target_outputs.shape
        ((4, 10), (4, 2))
    """
    check_int("n_train", n_train, low=2, fix="a subset needs at least two rows to choose from")
    positive_int("num_models", num_models)
    if not 0 < subset_fraction < 1:
        raise ValueError(
            f"`subset_fraction` must be in (0, 1), got {subset_fraction!r}; "
            "0.5 is the usual choice."
        )
    size = max(1, round(subset_fraction * n_train))
    rng = np.random.default_rng(seed)
    masks = np.zeros((num_models, n_train), dtype=bool)
    outputs = []
    for i in tqdm(range(num_models), desc="LDS retraining", disable=not progress):
        idx = np.sort(rng.choice(n_train, size=size, replace=False))
        masks[i, idx] = True
        model = train_fn(idx, seed + 1 + i)
        out = eval_fn(model)
        if isinstance(out, torch.Tensor):
            out = out.detach().cpu().numpy()
        outputs.append(np.asarray(out, dtype=np.float64).reshape(-1))
    return LDSGroundTruth(masks, np.stack(outputs))
