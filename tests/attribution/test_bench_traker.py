"""Side by side with traker (runs when the `bench` extra is installed).

traker 0.3.2's TRAKer and score computers import neither torchvision nor
fast_jl at module level, so nothing is stubbed.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from gradsketch.attribution import TRAKer
from gradsketch.sketch import NoOpProjector

trak = pytest.importorskip("trak")
trak_projectors = pytest.importorskip("trak.projectors")


def _mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))


def _run(cls, projector, save_dir, state, x, y, xt, yt, **extra):
    model = _mlp(0)
    traker = cls(
        model,
        "image_classification",
        len(x),
        save_dir=str(save_dir),
        device="cpu",
        projector=projector,
        use_half_precision=False,
        lambda_reg=1e-2,
        logging_level=logging.WARNING,
        **extra,
    )
    traker.load_checkpoint(state, model_id=0)
    for s in range(0, len(x), 16):
        traker.featurize((x[s : s + 16], y[s : s + 16]), num_samples=len(x[s : s + 16]))
    traker.finalize_features()
    traker.start_scoring_checkpoint("exp", state, model_id=0, num_targets=len(xt))
    traker.score((xt, yt), num_samples=len(xt))
    return np.asarray(traker.finalize_scores("exp"), dtype=np.float64)


@pytest.mark.bench
def test_scores_correlate_with_traker_per_target(tmp_path):
    """One checkpoint: traker's mean-abs rescaling of the inverse is a global
    factor then, so per-target correlations must be ~1 (>= 0.999)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 8, generator=g)
    y = torch.randint(0, 3, (96,), generator=g)
    xt, yt = x[:10] + 0.1, y[:10]
    state = _mlp(1).state_dict()
    ours = _run(TRAKer, NoOpProjector(), tmp_path / "ours", state, x, y, xt, yt, progress=False)
    theirs = _run(
        trak.TRAKer,
        trak_projectors.NoOpProjector(device="cpu"),
        tmp_path / "theirs",
        state,
        x,
        y,
        xt,
        yt,
    )
    for j in range(10):
        assert np.corrcoef(ours[:, j], theirs[:, j])[0, 1] >= 0.999
