"""Retrains side by side (``ReplayRun.retrain_many``) against one :meth:`retrain` per row."""

from __future__ import annotations

import pytest
import torch

from helpers.attribution import REPLAY_N, REPLAY_OPTIMIZERS, trained_replay


def _weights(first_batch: torch.Tensor) -> torch.Tensor:
    """``[4, n]`` rows: ones, a 0/1 half, the first batch left out (an empty step), noise."""
    gen = torch.Generator().manual_seed(3)
    half = (torch.arange(REPLAY_N) % 2).double()
    first_batch_out = torch.ones(REPLAY_N, dtype=torch.float64)
    first_batch_out[first_batch] = 0.0
    noisy = torch.rand(REPLAY_N, generator=gen, dtype=torch.float64) * 2
    return torch.stack([torch.ones(REPLAY_N, dtype=torch.float64), half, first_batch_out, noisy])


@pytest.mark.parametrize("subset_loss", ["kept_mean", "full_batch"])
@pytest.mark.parametrize(("optimizer", "kw"), REPLAY_OPTIMIZERS)
def test_retrain_many_equals_one_retrain_per_row(optimizer, kw, subset_loss):
    """Each row of the side-by-side run equals :meth:`retrain` at that row, in float64.

    Both apply the same elementwise optimizer formulas to the same batches;
    only the reductions of the vmapped gradient may be ordered differently
    (a few float64 ulps, ~1e-16 relative per step), so 10 steps of the
    4-5-3 MLP stay far below 1e-12. Row 0 (all ones) is also the trained
    run itself, and the rows must differ from each other (the check sees the
    weights).
    """
    r = trained_replay(optimizer, kw, subset_loss=subset_loss)
    weights = _weights(r.order[0])
    many = r.run.retrain_many(weights)
    assert many.shape == (len(weights), r.run.layout.size)
    for k, w in enumerate(weights):
        one = r.run.layout.flat(r.retrain(w))
        torch.testing.assert_close(many[k], one, rtol=0, atol=1e-12)
    torch.testing.assert_close(many[0], r.run.layout.flat(r._require_trained()), rtol=0, atol=1e-12)
    assert (many[1] - many[0]).abs().max() > 1e-3


def test_retrain_many_refuses_weights_of_the_wrong_shape():
    r = trained_replay("sgd", {"lr": 0.3})
    with pytest.raises(ValueError, match=r"`weights` has shape \(12,\); give \[K, n_train\]"):
        r.run.retrain_many(torch.ones(REPLAY_N))
    with pytest.raises(ValueError, match=r"`weights` has shape \(2, 5\)"):
        r.run.retrain_many(torch.ones(2, 5))
