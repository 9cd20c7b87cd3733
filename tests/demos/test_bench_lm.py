"""Helpers of the LM benchmarks that decide what the reference packages see."""

from __future__ import annotations

import torch

from gradsketch.demos.lm import LMDemoSettings, build_lm
from gradsketch.demos.protocols.influence import conv1d_to_linear, token_loss


def test_conv1d_to_linear_keeps_the_function() -> None:
    """GPT-2 with its Conv1D layers as nn.Linear computes the same logits (float64)."""
    from transformers.pytorch_utils import Conv1D

    model = build_lm(LMDemoSettings(), seed=0).double().eval()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        converted = conv1d_to_linear(model)
        after = converted(input_ids=ids).logits
    assert not any(isinstance(m, Conv1D) for m in converted.modules())
    assert sum(isinstance(m, torch.nn.Linear) for m in converted.modules()) == 4 * 2 + 1
    torch.testing.assert_close(after, before, rtol=1e-12, atol=1e-12)


def test_token_loss_is_the_summed_cross_entropy() -> None:
    logits = torch.randn(3, 5, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, 7, (3, 5), generator=torch.Generator().manual_seed(2))
    ref = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, 7), ids[:, 1:].reshape(-1), reduction="none"
    ).reshape(3, 4)
    torch.testing.assert_close(token_loss(logits, ids).double(), ref.sum(1))
