"""Streamed top-k proponents / opponents against argsort of the full score matrix."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from _attr_helpers import logreg_checkpoints, logreg_data

from gradsketch.attribution import TRAKer, trak_scores, trak_topk
from gradsketch.attribution._topk import TopKCollector


def _expected(full, k):
    order_hi = np.argsort(-full, axis=0, kind="stable")[:k]
    order_lo = np.argsort(full, axis=0, kind="stable")[:k]
    return order_hi, order_lo


@pytest.mark.parametrize(
    ("n", "m", "budget"),
    [
        pytest.param(200, 7, None, id="one-tile"),
        # 24 k² fixed + 2000 bytes: row blocks of 20, every column at once.
        pytest.param(200, 7, 24 * 64 + 2000, id="row-tiles"),
        # 24 k² fixed + 4000 bytes: 62 columns and 3 rows per tile.
        pytest.param(200, 80, 24 * 64 + 4000, id="row-and-column-tiles"),
    ],
)
def test_topk_equals_argsort_of_full_scores(n, m, budget):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=gen)
    t = torch.randn(m, 8, generator=gen)
    q = torch.rand(n, generator=gen)
    full = trak_scores(x, t, q, lambda_reg=0.1)
    top = trak_topk(x, t, q, k=5, lambda_reg=0.1, memory_budget=budget)
    hi, lo = _expected(full, 5)
    np.testing.assert_array_equal(top.proponents.numpy(), hi)
    np.testing.assert_array_equal(top.opponents.numpy(), lo)
    np.testing.assert_allclose(
        top.proponent_scores.numpy(), np.take_along_axis(full, hi, 0), rtol=1e-6
    )
    np.testing.assert_allclose(
        top.opponent_scores.numpy(), np.take_along_axis(full, lo, 0), rtol=1e-6
    )


def test_traker_topk_equals_argsort_of_finalized_scores(tmp_path):
    x, y = logreg_data(n=40)
    x = x.float()
    model = torch.nn.Linear(5, 3)
    traker = TRAKer(
        model,
        "image_classification",
        40,
        save_dir=tmp_path,
        device="cpu",
        proj_dim=8,
        progress=False,
        logging_level=logging.WARNING,
        lambda_reg=0.01,
    )
    ckpts = [{k: v.float() for k, v in c.items()} for c in logreg_checkpoints(count=2)]
    for i, ckpt in enumerate(ckpts):
        traker.load_checkpoint(ckpt, model_id=i)
        traker.featurize((x, y), num_samples=40)
    traker.finalize_features()
    for i, ckpt in enumerate(ckpts):
        traker.start_scoring_checkpoint("t", ckpt, model_id=i, num_targets=6)
        traker.score((x[:6], y[:6]), num_samples=6)
    full = np.asarray(traker.finalize_scores("t"))
    top = traker.topk("t", k=4)
    hi, lo = _expected(full, 4)
    np.testing.assert_array_equal(top.proponents.numpy(), hi)
    np.testing.assert_array_equal(top.opponents.numpy(), lo)
    # k above n keeps every row, sorted.
    everything = traker.topk("t", k=100)
    assert everything.proponents.shape == (40, 6)
    np.testing.assert_array_equal(everything.opponents.numpy(), _expected(full, 40)[1])


@pytest.mark.parametrize("k", [0, -1, 2.0, True])
def test_k_must_be_a_positive_int(k):
    with pytest.raises(ValueError, match="`k` must be a positive int"):
        TopKCollector(10, 2, k)
