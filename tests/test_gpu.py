"""Each capability on a CUDA device against the same call on the CPU (skipped without CUDA).

The sketches, count sketch, masked optimizers and factorization have their own
``device``-parametrized tests; these cover the paths that move a user's model
and data themselves: the replay (its rows and queries go where the model is),
and ``TRAKer`` with a CUDA model (``slt.sample(device="cuda")``: tests/slt/test_sample.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from gradsketch.attribution import TRAKer
from gradsketch.sketch import NoOpProjector
from helpers.attribution import (
    REPLAY_N,
    REPLAY_OPTIMIZERS,
    logreg_checkpoints,
    logreg_data,
    replay_data,
    trained_replay,
)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("optimizer", "kw"), REPLAY_OPTIMIZERS)
def test_replay_on_cuda_equals_the_cpu_replay(optimizer, kw):
    """A CUDA model replays on CUDA with CPU rows and queries; metagradients equal the CPU's.

    Both runs are float64 and take the same steps; only the order of CUDA's
    reductions differs, which perturbs each of the 10 steps by a few ulps:
    relative error ~ T · 1e-15 amplified by the run's conditioning (under 1e3
    here), so 1e-10 of the largest score leaves a margin of 1e2.
    """
    cpu = trained_replay(optimizer, kw)
    gpu = trained_replay(optimizer, kw, device="cuda")
    x, y = replay_data(REPLAY_N)
    queries = (x[:3], y[:3])
    want = cpu.metagradients(queries)
    got = gpu.metagradients(queries)
    assert got.device.type == "cuda"
    scale = float(want.abs().max())
    assert scale > 1e-3
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=1e-10 * scale)
    torch.testing.assert_close(gpu.outputs(queries).cpu(), cpu.outputs(queries), rtol=1e-12, atol=0)
    scores = gpu.score(queries)
    assert scores.device.type == "cpu"


def _traker_scores(tmp_path: Path, device: str, method: str) -> np.ndarray:
    x, y = logreg_data(n=40)
    xt, yt = logreg_data(n=6, seed=9)
    model = torch.nn.Linear(5, 3).double().to(device)
    extra = (
        {"projector": NoOpProjector(device=device), "dtype": torch.float32}
        if method == "trak"
        else {"dtype": torch.float64}
    )
    traker = TRAKer(
        model,
        "image_classification",
        len(x),
        save_dir=tmp_path / device,
        device=device,
        method=method,
        lambda_reg=0.1,
        logging_level=logging.WARNING,
        progress=False,
        **extra,
    )
    ckpts = [{k: v.to(device) for k, v in c.items()} for c in logreg_checkpoints(count=2)]
    for mid, state in enumerate(ckpts):
        traker.load_checkpoint(state, model_id=mid)
        for s in range(0, len(x), 8):
            traker.featurize((x[s : s + 8], y[s : s + 8]), num_samples=len(x[s : s + 8]))
    traker.finalize_features()
    for mid, state in enumerate(ckpts):
        traker.start_scoring_checkpoint("exp", state, model_id=mid, num_targets=len(xt))
        traker.score((xt, yt), num_samples=len(xt))
    return np.asarray(traker.finalize_scores("exp"))


@pytest.mark.parametrize("method", ["trak", "identity", "kfac", "ekfac"])
def test_traker_on_cuda_equals_the_cpu_traker(tmp_path, method):
    """A float64 CUDA model featurizes and scores CPU batches; scores equal the CPU run's.

    The per-layer methods store float64 features: CUDA's reduction order moves
    each sum of 40 terms by a few ulps, and the 18 x 18 solves and
    eigendecompositions by ~κ · 1e-16 with κ ≈ 37 (the damped Gram matrix's
    condition number at ``lambda_reg=0.1``): 1e-9 of the largest score leaves
    a margin of 1e5. ``trak`` (unprojected) stores float32 features (its
    choices are float16 and float32): each rounds to u = 6e-8 relative on
    either device, so the scores differ by ~κ · 4u ≈ 1e-5 relative; 1e-4
    leaves a margin of 10.
    """
    want = _traker_scores(tmp_path, "cpu", method)
    got = _traker_scores(tmp_path, "cuda", method)
    assert got.shape == want.shape == (40, 6)
    tol = 1e-4 if method == "trak" else 1e-9
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.abs(want).max())
