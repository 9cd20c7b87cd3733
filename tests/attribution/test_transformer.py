"""The small transformer used by the hook tests and the featurization benchmark."""

from __future__ import annotations

import pytest
import torch

from gradsketch.attribution import TransformerBlock, TransformerClassifier


def test_block_attention_is_causal():
    """Changing the last position leaves every earlier position's output unchanged."""
    torch.manual_seed(0)
    block = TransformerBlock(width=8, heads=2, mlp_ratio=2).double()
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    y = x.clone()
    y[:, -1] += 1.0
    out_x, out_y = block(x), block(y)
    # Exact: same shapes and kernels; masked positions enter every sum as an exact 0.
    torch.testing.assert_close(out_x[:, :-1], out_y[:, :-1], rtol=0, atol=0)
    assert not torch.allclose(out_x[:, -1], out_y[:, -1])


def test_classifier_shapes_and_hookable_layers():
    model = TransformerClassifier(vocab=11, width=8, seq=5, layers=2, heads=2, classes=3)
    assert model(torch.randint(0, 11, (4, 5))).shape == (4, 3)
    kinds = {type(m) for m in model.modules() if not list(m.children())}
    assert kinds == {torch.nn.Embedding, torch.nn.Linear, torch.nn.LayerNorm}


@pytest.mark.parametrize(("width", "heads"), [(10, 4), (0, 2), (8, 0)])
def test_width_must_be_a_positive_multiple_of_heads(width, heads):
    with pytest.raises(ValueError, match=f"`width`={width} must be a positive multiple"):
        TransformerBlock(width, heads)
