"""``slt.sample`` on a CUDA device (skipped without CUDA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _slt_helpers import reference_token_loss, tiny_gpt2, token_data

from gradsketch.slt import sample

pytestmark = pytest.mark.gpu


def test_slt_sample_on_cuda_sees_the_trained_model(tmp_path):
    """``sample(device="cuda")`` without noise and with lr 1e-12: every probe loss is the
    CPU model's, to float32 rounding (TF32 is off in torch by default; the losses
    of a 32-wide GPT-2 near 5.5 agree to ~1e-6 relative, 1e-5 leaves a margin)."""
    data, probe = token_data(32), token_data(12, seed=1)
    tree = sample(
        tiny_gpt2(),
        data,
        {"probe": (probe, 3)},
        output_path=tmp_path / "s.zarr",
        device="cuda",
        lr=1e-12,
        noise_level=0.0,
        n_beta=20.0,
        localization=100.0,
        num_chains=2,
        num_draws=3,
        batch_size=4,
        batches_per_draw=2,
        num_init_loss_batches=2,
    )
    ids = torch.as_tensor(tree.dataset["input_ids_probe"].values)
    ref = reference_token_loss(tiny_gpt2(), ids)
    for chain in range(2):
        for draw in range(3):
            np.testing.assert_allclose(
                tree.dataset["loss_probe"].values[chain, draw], ref, rtol=1e-5
            )
    assert np.isfinite(tree.dataset["sampling_loss"].values).all()
