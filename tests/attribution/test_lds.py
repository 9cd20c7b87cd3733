"""Linear datamodeling score and its ground-truth helper."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import spearmanr

from gradsketch.attribution import lds_ground_truth, linear_datamodeling_score


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
