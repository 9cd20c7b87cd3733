"""Linear datamodeling score and its ground-truth helper."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import spearmanr

from gradsketch.attribution import (
    lds_ground_truth,
    linear_datamodeling_interval,
    linear_datamodeling_score,
)
from gradsketch.attribution._lds import _lds_of_resamples


def test_lds_matches_scipy_spearman_per_target():
    rng = np.random.default_rng(0)
    scores = rng.normal(size=(30, 4))
    masks = rng.random((12, 30)) < 0.5
    outputs = rng.normal(size=(12, 4))
    lds, per = linear_datamodeling_score(scores, masks, outputs, return_per_target=True)
    ref = [spearmanr(masks @ scores[:, j], outputs[:, j]).statistic for j in range(4)]
    np.testing.assert_allclose(per, ref, rtol=1e-12)
    assert lds == pytest.approx(np.mean(ref))


def test_lds_perfect_and_reversed():
    rng = np.random.default_rng(1)
    scores = rng.normal(size=(20, 3))
    masks = rng.random((10, 20)) < 0.5
    assert linear_datamodeling_score(scores, masks, masks @ scores) == pytest.approx(1.0)
    assert linear_datamodeling_score(-scores, masks, masks @ scores) == pytest.approx(-1.0)


@pytest.mark.parametrize(
    ("shapes", "match"),
    [
        pytest.param(((20, 3), (10, 21), (10, 3)), "`subset_masks` has 21 columns", id="masks"),
        pytest.param(((20, 3), (10, 20), (10, 4)), "`target_outputs` has shape", id="outputs"),
        pytest.param(((20, 3), (2, 20), (2, 3)), "at least 3", id="few"),
        pytest.param(((20,), (2, 20), (2, 3)), "`scores` must be 2-D", id="1d"),
    ],
)
def test_lds_errors(shapes, match):
    s, m, o = (np.zeros(shape) for shape in shapes)
    with pytest.raises(ValueError, match=match):
        linear_datamodeling_score(s, m, o)


def test_ground_truth_subsets_are_seeded_halves():
    calls = []

    def train(idx, seed):
        calls.append(seed)
        return idx

    def evaluate(idx):
        return np.array([idx.size, idx.sum()])

    a = lds_ground_truth(train, evaluate, 11, 5, seed=3, progress=False)
    b = lds_ground_truth(train, evaluate, 11, 5, seed=3, progress=False)
    np.testing.assert_array_equal(a.subset_masks, b.subset_masks)
    assert (a.subset_masks.sum(1) == 6).all()  # round(0.5 * 11)
    np.testing.assert_array_equal(a.target_outputs[:, 1], (a.subset_masks * np.arange(11)).sum(1))
    assert calls[:5] == [4, 5, 6, 7, 8]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"n_train": 1}, "`n_train` must be an integer >= 2", id="n"),
        pytest.param({"num_models": 0}, "`num_models` must be a positive integer", id="models"),
        pytest.param({"subset_fraction": 1.0}, r"`subset_fraction` must be in \(0, 1\)", id="frac"),
    ],
)
def test_ground_truth_errors(kwargs, match):
    args = {"n_train": 10, "num_models": 3, "subset_fraction": 0.5, **kwargs}
    with pytest.raises(ValueError, match=match):
        lds_ground_truth(lambda i, s: i, lambda m: [0], seed=0, progress=False, **args)


# -- the bootstrap interval ------------------------------------------------------------------
def _noisy_lds_problem(seed: int, num_models: int = 40, noise: float = 4.0):
    rng = np.random.default_rng(seed)
    scores = rng.normal(size=(30, 4))
    masks = rng.random((num_models, 30)) < 0.5
    return scores, masks, masks @ scores + noise * rng.normal(size=(num_models, 4))


def test_interval_resample_statistic_matches_the_score_on_each_resample():
    """The vectorized statistic equals ``linear_datamodeling_score`` on explicit resamples.

    Resamples repeat models, so this also checks the ties' average ranks.
    """
    scores, masks, outputs = _noisy_lds_problem(0)
    rng = np.random.default_rng(1)
    idx = rng.integers(0, masks.shape[0], size=(6, masks.shape[0]))
    fast = _lds_of_resamples((masks @ scores)[idx], outputs[idx])  # [resample, model, target]
    slow = [linear_datamodeling_score(scores, masks[i], outputs[i]) for i in idx]
    np.testing.assert_allclose(fast, slow, rtol=1e-12)


def test_interval_identities():
    scores, masks, outputs = _noisy_lds_problem(2)
    est, low, high = linear_datamodeling_interval(scores, masks, outputs)
    assert est == linear_datamodeling_score(scores, masks, outputs)
    assert low < est < high
    assert linear_datamodeling_interval(scores, masks, outputs) == (est, low, high)  # seeded
    assert linear_datamodeling_interval(scores, masks, masks @ scores) == (1.0, 1.0, 1.0)
    same = linear_datamodeling_interval(scores, masks, outputs, baseline_scores=scores)
    assert same == (0.0, 0.0, 0.0)
    other = np.random.default_rng(3).normal(size=scores.shape)
    diff = linear_datamodeling_interval(scores, masks, outputs, baseline_scores=other)
    assert diff.estimate == pytest.approx(
        est - linear_datamodeling_score(other, masks, outputs), abs=1e-12
    )
    assert diff.low < diff.estimate < diff.high
    wider = linear_datamodeling_interval(scores, masks, outputs, confidence_level=0.99)
    assert wider.low <= low and wider.high >= high


def test_interval_of_constant_outputs_is_undefined_without_warnings():
    scores, masks, _ = _noisy_lds_problem(7)
    result = linear_datamodeling_interval(scores, masks, np.ones((masks.shape[0], 4)))
    assert np.isnan(result).all()
    # Three models: some resamples repeat one model and have no LDS; the others decide.
    est, low, high = linear_datamodeling_interval(scores, masks[:3], masks[:3] @ scores)
    assert est == 1.0 and low <= high <= 1.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"confidence_level": 1.0}, "`confidence_level` must be in", id="level"),
        pytest.param({"n_resamples": 10}, "`n_resamples`", id="resamples"),
        pytest.param({"baseline_scores": np.zeros((29, 4))}, "`baseline_scores` has", id="base"),
    ],
)
def test_interval_errors(kwargs, match):
    scores, masks, outputs = _noisy_lds_problem(4)
    with pytest.raises(ValueError, match=match):
        linear_datamodeling_interval(scores, masks, outputs, **kwargs)


@pytest.mark.slow
def test_interval_covers_the_population_lds():
    """The 95 % interval covers the population LDS in about 95 % of experiments.

    The population is fixed scores, random halves and Gaussian output noise;
    its LDS is measured once on 100,000 models (standard error about
    ``(1 − ρ²)/√n`` < 0.004, negligible). Each of K = 200 experiments draws 60
    models and asks whether the interval holds it. The count of covers is
    binomial: at 95 % its standard deviation is ``√(0.95 · 0.05 / 200)`` =
    0.0154; a bootstrap over 60 models may under-cover by O(1/60). We accept
    [0.90, 0.99], 3.2 standard deviations under and 2.6 over the nominal rate.
    """
    scores, _, _ = _noisy_lds_problem(5)
    rng = np.random.default_rng(6)
    big = rng.random((100_000, 30)) < 0.5
    truth = linear_datamodeling_score(
        scores, big, big @ scores + 4.0 * rng.normal(size=(100_000, 4))
    )
    covers = 0
    for _ in range(200):
        masks = rng.random((60, 30)) < 0.5
        outputs = masks @ scores + 4.0 * rng.normal(size=(60, 4))
        _, low, high = linear_datamodeling_interval(scores, masks, outputs, n_resamples=999)
        covers += low <= truth <= high
    assert 0.90 <= covers / 200 <= 0.99
