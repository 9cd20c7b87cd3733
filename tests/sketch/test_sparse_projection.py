"""``project_sparse_into_``: every projector kind against its dense float64 matrix.

A per-example sparse gradient (values scatter-added at coordinates, repeats
summing) projected in place must equal the projection of the densified
gradient, ``M^T dense_b``, with ``M`` read column by column from the
projector itself. In float64 each output is a sum of at most ``n = 24``
products, so reordering it moves it by at most ``n * eps * sum|terms|``
(``eps = 1.1e-16``): ``rtol = 1e-12`` with ``atol = 1e-12 * max|ref|`` holds
with room.
"""

from __future__ import annotations

import pytest
import torch

from gradsketch.masked import ParamMask
from gradsketch.sketch import (
    AbstractProjector,
    BasicProjector,
    BasicSingleBlockProjector,
    CountSketchProjector,
    NoOpProjector,
    SparseProjector,
    _projectors,
)

F64 = torch.float64
D, K = 53, 12

KINDS = {
    "count": lambda: CountSketchProjector(D, K, 3, "cpu"),
    "count-lazy": lambda: CountSketchProjector(D, K, 3, "cpu", materialize=False, chunk_size=7),
    "sparse4": lambda: SparseProjector(D, K, 3, 4, "cpu"),
    "normal": lambda: BasicProjector(D, K, 3, "normal", "cpu", dtype=F64),
    "single-block": lambda: BasicSingleBlockProjector(D, K, 3, "rademacher", "cpu", dtype=F64),
    "noop": lambda: NoOpProjector(D, device="cpu"),
}


def _sparse(batch: int = 3, n: int = 8, low: int = 4, high: int = 41):
    gen = torch.Generator().manual_seed(0)
    coords = torch.randint(low, high, (batch, n), generator=gen)
    coords[:, 1] = coords[:, 0]  # a repeated coordinate adds up
    values = torch.randn(batch, n, generator=gen, dtype=F64)
    dense = torch.zeros(batch, D, dtype=F64).scatter_add_(1, coords, values)
    return coords, values, dense


@pytest.mark.parametrize("span", [1 << 24, 5])
@pytest.mark.parametrize("kind", list(KINDS))
def test_sparse_equals_projection_of_dense(kind, span, monkeypatch):
    """Also in spans of 5 coordinates (the generic path densifies span by span, skipping empty)."""
    monkeypatch.setattr(_projectors, "_SPARSE_SPAN_ENTRIES", span)
    p = KINDS[kind]()
    assert p.streams_by_coordinates
    coords, values, dense = _sparse()
    ref = dense @ torch.cat([p.project(torch.eye(D, dtype=F64)[i : i + 1], 0) for i in range(D)])
    out = p.new_output(3, F64)
    assert out.dtype == F64 and out.shape == (3, p.proj_dim) and not out.any()
    got = p.project_sparse_into_(out, coords, values, model_id=0)
    assert got is out
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12 * float(ref.abs().max()))


def test_sparse_accumulates_and_follows_model_id():
    p = CountSketchProjector(D, K, 3, "cpu")
    coords, values, dense = _sparse()
    out = p.project(dense, model_id=1)
    p.project_sparse_into_(out, coords, values, model_id=1)
    torch.testing.assert_close(out, 2 * p.project(dense, model_id=1))
    assert not torch.allclose(p.project(dense, model_id=0), out / 2)


def test_masked_and_unknown_width_projectors_do_not_stream():
    mask = ParamMask({"w": torch.arange(D) % 2 == 0})
    assert not CountSketchProjector(mask.numel, K, 0, "cpu", mask=mask).streams_by_coordinates
    assert not NoOpProjector(device="cpu").streams_by_coordinates


def _call(p: AbstractProjector, coords, values, out=None):
    out = torch.zeros(coords.shape[0], p.proj_dim, dtype=F64) if out is None else out
    return p.project_sparse_into_(out, coords, values)


ERRORS = [
    pytest.param(
        lambda p: _call(p, torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, 3, dtype=F64)),
        r"`coords` must be int64 \[batch, n\]",
        id="int32-coords",
    ),
    pytest.param(
        lambda p: _call(p, torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4, dtype=F64)),
        r"with the shape of `values` \(2, 4\)",
        id="shape-mismatch",
    ),
    pytest.param(
        lambda p: _call(p, torch.full((2, 3), D, dtype=torch.long), torch.zeros(2, 3, dtype=F64)),
        rf"`coords` run from {D} to {D}, outside \[0, grad_dim={D}\)",
        id="out-of-range",
    ),
    pytest.param(
        lambda p: _call(
            p,
            torch.zeros(2, 3, dtype=torch.long),
            torch.zeros(2, 3, dtype=F64),
            torch.zeros(3, K, dtype=F64),
        ),
        rf"`out` must have shape \(2, {K}\)",
        id="out-shape",
    ),
    pytest.param(
        lambda p: _call(
            p, torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long)
        ),
        r"values",
        id="integer-values",
    ),
]


@pytest.mark.parametrize(("call", "match"), ERRORS)
def test_sparse_errors(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call(CountSketchProjector(D, K, 0, "cpu"))


def test_empty_sparse_gradient_adds_nothing():
    p = CountSketchProjector(D, K, 0, "cpu")
    out = _call(p, torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 0, dtype=F64))
    assert not out.any()
