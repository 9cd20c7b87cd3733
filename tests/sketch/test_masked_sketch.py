"""Sketches restricted to a ParamMask: selected coordinates only, mask in the fingerprint."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gradsketch.masked import ParamMask
from gradsketch.sketch import (
    CountSketch,
    CountSketchProjector,
    FingerprintMismatchError,
    SparseProjector,
)

# Each test runs with the native scatter kernels and with torch's scatter.
pytestmark = pytest.mark.usefixtures("scatter_backend")


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def per_example(model: nn.Module, batch: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {
        name: torch.randn(batch, *p.shape, generator=gen, dtype=torch.float64)
        for name, p in model.named_parameters()
    }


def test_masked_projector_equals_projection_of_selected_columns():
    """Reference: select the masked coordinates by hand (float64), then project."""
    model = small_model()
    mask = ParamMask.random(model, 0.4, seed=3)
    grads = per_example(model, 4)
    flat = torch.cat([g.reshape(4, -1) for g in grads.values()], dim=1)
    keep = torch.cat([mask[name].reshape(-1) for name, _ in model.named_parameters()])
    plain = CountSketchProjector(mask.numel, 16, 0, "cpu")
    masked = CountSketchProjector(mask.numel, 16, 0, "cpu", mask=mask)
    torch.testing.assert_close(masked.project(grads, 0), plain.project(flat[:, keep], 0))


def test_masked_count_sketch_matches_select_then_sketch():
    model = small_model()
    mask = ParamMask.from_patterns(model, include=["0.*"])
    grads = {n: g[0] for n, g in per_example(model, 1).items()}
    cs = CountSketch.create(mask.numel, 8, seed=2, mask=mask)
    torch.testing.assert_close(cs.sketch_named(grads), cs.sketch(mask.select(grads)))
    assert mask.numel == 6 * 5 + 5


def test_different_masks_give_incompatible_fingerprints():
    model = small_model()
    a = ParamMask.random(model, 0.5, seed=0)
    b = ParamMask.random(model, 0.5, seed=1)
    fa = SparseProjector(a.numel, 16, 0, 2, "cpu", mask=a).fingerprint
    fb = SparseProjector(b.numel, 16, 0, 2, "cpu", mask=b).fingerprint
    assert fa.mask == a.fingerprint
    with pytest.raises(FingerprintMismatchError, match="mask:"):
        fa.require_same(fb, "features")
    same = SparseProjector(a.numel, 16, 0, 2, "cpu", mask=ParamMask.random(model, 0.5, seed=0))
    assert same.fingerprint == fa
    assert CountSketch.create(a.numel, 4, mask=a).fingerprint.mask == a.fingerprint


def test_random_mask_then_sketch_preserves_inner_products_of_selection():
    """Random-mask-then-sketch: E<Px, Py> over sketch seeds = k <x_S, y_S> for the selection S.

    Over N = 300 seeds the mean of <Px, Py>/k has standard error s/sqrt(N)
    (plug-in, CLT); we accept 5 of them.
    """
    model = small_model()
    mask = ParamMask.random(model, 0.5, seed=7)
    grads = per_example(model, 2)
    selected = mask.select_batched(grads)
    exact = float(selected[0] @ selected[1])
    samples = []
    for seed in range(300):
        out = CountSketchProjector(mask.numel, 8, seed, "cpu", mask=mask).project(grads, 0)
        samples.append(float(out[0] @ out[1]) / 8)
    s = torch.tensor(samples, dtype=torch.float64)
    assert abs(float(s.mean()) - exact) < 5 * float(s.std()) / math.sqrt(len(samples))


@pytest.mark.parametrize(
    ("make", "match"),
    [
        pytest.param(
            lambda m: CountSketchProjector(m.numel + 1, 8, 0, "cpu", mask=m),
            r"`grad_dim`=\d+ but the mask selects \d+ entries",
            id="projector-dim",
        ),
        pytest.param(
            lambda m: CountSketch.create(m.numel + 1, 8, mask=m),
            r"`input_dim`=\d+ but the mask selects \d+ entries",
            id="countsketch-dim",
        ),
        pytest.param(
            lambda m: CountSketch.create(5, 2).sketch_named({}),
            "needs a CountSketch created with `mask=",
            id="sketch-named-without-mask",
        ),
    ],
)
def test_mask_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make(ParamMask.random(small_model(), 0.5, seed=0))
