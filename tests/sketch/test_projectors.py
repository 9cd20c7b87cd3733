"""TRAK-compatible projectors: every kind against its dense float64 matrix."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradsketch.sketch import (
    AbstractProjector,
    BasicProjector,
    BasicSingleBlockProjector,
    ChunkedCudaProjector,
    CountSketch,
    CountSketchProjector,
    CudaProjector,
    Fingerprint,
    FingerprintMismatchError,
    NoOpProjector,
    ProjectionType,
    SparseProjector,
)

# Each test runs with the native scatter kernels and with torch's scatter.
pytestmark = pytest.mark.usefixtures("scatter_backend")

KINDS = {
    "count": lambda d, k, seed, **kw: CountSketchProjector(d, k, seed, "cpu", **kw),
    "count-lazy": lambda d, k, seed, **kw: CountSketchProjector(
        d, k, seed, "cpu", materialize=False, chunk_size=7, **kw
    ),
    "sparse4": lambda d, k, seed, **kw: SparseProjector(d, k, seed, 4, "cpu", **kw),
    "normal": lambda d, k, seed, **kw: BasicProjector(d, k, seed, "normal", "cpu", **kw),
    "rademacher": lambda d, k, seed, **kw: BasicProjector(
        d, k, seed, ProjectionType.rademacher, "cpu", block_size=5, **kw
    ),
    "single-block": lambda d, k, seed, **kw: BasicSingleBlockProjector(
        d, k, seed, "normal", "cpu", **kw
    ),
}


def matrix_of(projector: AbstractProjector, d: int) -> torch.Tensor:
    """Slow reference: project each basis vector alone (float64), giving P^T [d, k]."""
    rows = [projector.project(torch.eye(d, dtype=torch.float64)[i : i + 1], None) for i in range(d)]
    return torch.cat(rows)


@pytest.mark.parametrize("kind", list(KINDS))
def test_project_equals_explicit_matrix_float64(kind):
    d, k = 37, 12
    p = KINDS[kind](d, k, 3)
    m = matrix_of(p, d)
    x = torch.randn(5, d, dtype=torch.float64)
    out = p.project(x, 0)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, x @ m)


@pytest.mark.parametrize("kind", ["count", "count-lazy", "sparse4"])
@pytest.mark.parametrize("rows", [1, 3])
def test_split_scatter_equals_explicit_matrix_float64(kind, rows, monkeypatch):
    """The hashed projectors with every scatter split into 3 column ranges (which
    only inputs of more than 16k columns get by default): still ``x @ matrix``."""
    from gradsketch.sketch import _countsketch

    d, k = 37, 12
    p = KINDS[kind](d, k, 3)
    m = matrix_of(p, d)
    monkeypatch.setattr(_countsketch, "split_parts", lambda r, n: 3)
    x = torch.randn(rows, d, dtype=torch.float64)
    torch.testing.assert_close(p.project(x, 0), x @ m)


@pytest.mark.parametrize("kind", list(KINDS))
def test_float32_path_matches_float64_reference(kind):
    d, k = 300, 32
    p = KINDS[kind](d, k, 1)
    x = torch.randn(4, d, dtype=torch.float64)
    ref = p.project(x, 0)
    out = p.project(x.float(), 0)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4 * math.sqrt(d))


@pytest.mark.parametrize("kind", list(KINDS))
@settings(max_examples=10, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=60), min_size=0, max_size=4))
def test_streaming_parts_and_dict_equal_flat(kind, cuts):
    """Promise 2: project_into_ at offsets, and dict input, equal the flat projection."""
    d, k = 60, 9
    p = KINDS[kind](d, k, 7)
    x = torch.randn(3, d, dtype=torch.float64)
    edges = sorted({0, d, *cuts})
    out = torch.zeros(3, k, dtype=torch.float64)
    for a, b in itertools.pairwise(edges):
        p.project_into_(out, x[:, a:b], a)
    flat = p.project(x, 0)
    torch.testing.assert_close(out, flat)
    as_dict = {
        f"p{i}": x[:, a:b].reshape(3, -1, 1) for i, (a, b) in enumerate(itertools.pairwise(edges))
    }
    torch.testing.assert_close(p.project(as_dict, 0), flat)


@pytest.mark.parametrize("kind", list(KINDS))
def test_same_fingerprint_same_map_and_model_id_reseeds(kind):
    d, k = 80, 16
    x = torch.randn(2, d, dtype=torch.float64)
    a, b = KINDS[kind](d, k, 5), KINDS[kind](d, k, 5)
    assert a.fingerprint == b.fingerprint
    torch.testing.assert_close(a.project(x, 0), b.project(x, 0))
    other = a.project(x, 1)
    assert a.fingerprint.model_id == 1
    assert not torch.allclose(other, b.project(x, 0))
    # Back to model 0: the same map again (deterministic re-seeding).
    torch.testing.assert_close(a.project(x, 0), b.project(x, 0))
    fresh = KINDS[kind](d, k, 5, model_id=1)
    torch.testing.assert_close(fresh.project(x, None), other)


@pytest.mark.parametrize("block_size", [1, 7, 100, 2048])
def test_basic_projector_block_size_invariance(block_size):
    """TRAK's BasicProjector changes its map with block_size; ours must not."""
    d, k = 500, 64
    x = torch.randn(4, d)
    ref = BasicSingleBlockProjector(d, k, 2, "normal", "cpu").project(x, 0)
    out = BasicProjector(d, k, 2, "normal", "cpu", block_size=block_size).project(x, 0)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)


def test_count_sketch_projector_is_scaled_count_sketch_and_sparse_nnz1():
    d, k = 1000, 64
    v = torch.randn(d)
    cs = CountSketch.create(d, k, seed=4)
    p = CountSketchProjector(d, k, 4, "cpu")
    torch.testing.assert_close(p.project(v[None], 0)[0], math.sqrt(k) * cs.sketch(v))
    s1 = SparseProjector(d, k, 4, 1, "cpu")
    assert s1.fingerprint == p.fingerprint
    torch.testing.assert_close(s1.project(v[None], 0), p.project(v[None], 0))


@pytest.mark.parametrize("nnz", [1, 3])
def test_column_tiles_for_many_rows_equal_one_pass(nnz, monkeypatch):
    """A batch of >= _TILE_MIN_ROWS rows is sketched in column tiles; same numbers."""
    from gradsketch.sketch import _projectors

    monkeypatch.setattr(_projectors, "_TILE_COLUMNS", 7)
    rows, d, k = _projectors._TILE_MIN_ROWS + 1, 60, 16
    grads = torch.randn(rows, d, dtype=torch.float64)
    p = SparseProjector(d, k, 3, nnz, "cpu")
    tiled = p.project(grads, 0)
    expected = grads @ matrix_of(p, d)
    torch.testing.assert_close(tiled, expected, rtol=1e-12, atol=1e-12)
    monkeypatch.setattr(_projectors, "_TILE_MIN_ROWS", rows + 1)
    torch.testing.assert_close(p.project(grads, 0), tiled, rtol=1e-12, atol=1e-12)


def test_sparse_projector_equals_loop_reference():
    """Reference: add sign_r(i) * sqrt(k / nnz) at bucket_r(i) for each row r, in float64."""
    d, k, nnz = 50, 32, 4
    p = SparseProjector(d, k, 0, nnz, "cpu")
    expected = torch.zeros(d, k, dtype=torch.float64)
    for r in range(nnz):
        folded = p._table(r, 0, d).tolist()
        for i, f in enumerate(folded):
            expected[i, f % k] += (-1.0 if f >= k else 1.0) * math.sqrt(k / nnz)
    torch.testing.assert_close(matrix_of(p, d), expected)
    # Rows are independent: the nnz rows of a coordinate are not all in one bucket.
    buckets = torch.stack([p._table(r, 0, d) % k for r in range(nnz)])
    assert (buckets != buckets[0]).any(dim=0).float().mean() > 0.5


def test_dense_entries_have_unit_moments():
    """Normal entries: mean 0, variance 1, fourth moment 3; adjacent columns uncorrelated.

    With n = 2**18 i.i.d. N(0,1) entries the sample mean has standard error
    1/sqrt(n), the sample second moment sqrt(2/n) (Var z^2 = 2) and the fourth
    moment sqrt(96/n) (Var z^4 = 105 - 9); the correlation of the cosine and
    sine columns of a Box-Muller pair has standard error 1/sqrt(n/2). We
    accept 5 standard errors each. Rademacher entries are exactly +-1 with
    mean 0 within 5/sqrt(n).
    """
    d, k = 1 << 12, 64
    m = BasicSingleBlockProjector(d, k, 0, "normal", "cpu", dtype=torch.float64).proj_matrix
    n = m.numel()
    assert abs(float(m.mean())) < 5 / math.sqrt(n)
    assert abs(float((m**2).mean()) - 1) < 5 * math.sqrt(2 / n)
    assert abs(float((m**4).mean()) - 3) < 5 * math.sqrt(96 / n)
    corr = float((m[:, 0::2] * m[:, 1::2]).mean())
    assert abs(corr) < 5 / math.sqrt(n / 2)
    r = BasicSingleBlockProjector(d, k, 0, "rademacher", "cpu").proj_matrix
    assert set(r.unique().tolist()) == {-1.0, 1.0}
    assert abs(float(r.mean())) < 5 / math.sqrt(n)


@pytest.mark.parametrize("kind", ["count", "sparse4", "normal", "rademacher"])
def test_inner_products_unbiased_with_trak_normalisation(kind):
    """E<Px, Py> = k <x, y> for every projector (TRAK's unit-variance convention).

    Over N = 400 seeds the mean of X = <Px, Py> / k has standard error
    s / sqrt(N), where s is the sample standard deviation (plug-in; the CLT
    makes the standardized mean approximately normal). We accept 5 standard
    errors, a false-alarm rate below 1e-6.
    """
    d, k, n_seeds = 40, 8, 400
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, d, generator=gen, dtype=torch.float64)
    y = 0.5 * x + torch.randn(1, d, generator=gen, dtype=torch.float64)
    exact = float(x @ y.T)
    samples = []
    for seed in range(n_seeds):
        p = KINDS[kind](d, k, seed)
        samples.append(float(p.project(x, 0) @ p.project(y, 0).T) / k)
    s = torch.tensor(samples, dtype=torch.float64)
    assert abs(float(s.mean()) - exact) < 5 * float(s.std()) / math.sqrt(n_seeds)


def test_noop_projector_passes_gradients_through():
    x = torch.randn(3, 10)
    assert torch.equal(NoOpProjector().project(x, 0), x)
    d = {"a": torch.randn(3, 2, 2), "b": torch.randn(3, 6)}
    flat = torch.cat([d["a"].reshape(3, -1), d["b"]], dim=1)
    torch.testing.assert_close(NoOpProjector(grad_dim=10, device="cpu").project(d, 0), flat)
    assert NoOpProjector(grad_dim=10).fingerprint.kind == "noop"


def test_chunked_cuda_projector_sums_chunks():
    grads = {"a": torch.randn(2, 30), "b": torch.randn(2, 50), "c": torch.randn(2, 20)}
    p1 = CountSketchProjector(80, 16, 0, "cpu")
    p2 = CountSketchProjector(20, 16, 0, "cpu")
    chunked = ChunkedCudaProjector([p1, p2], 80, [80, 20], 2, "cpu", torch.float32)
    expected = p1.project(torch.cat([grads["a"], grads["b"]], 1), 0) + p2.project(grads["c"], 0)
    torch.testing.assert_close(chunked.project(grads, 0), expected)
    with pytest.raises(ValueError, match="more than 1 chunks"):
        ChunkedCudaProjector([p1], 80, [80], 2, "cpu", torch.float32).project(grads, 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["count", "normal"])
def test_low_precision_inputs_accumulate_in_float32(dtype, kind):
    p = KINDS[kind](64, 8, 0)
    x = torch.randn(2, 64)
    out = p.project(x.to(dtype), 0)
    assert out.dtype == torch.float32
    ref = p.project(x.to(dtype).double(), 0)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)


def test_nan_and_inf_propagate():
    """Documented: non-finite inputs propagate (count sketch: to their bucket only)."""
    x = torch.randn(1, 100)
    x[0, 3] = float("inf")
    out = CountSketchProjector(100, 16, 0, "cpu").project(x, 0)
    assert (~torch.isfinite(out)).sum() == 1
    x[0, 3] = float("nan")
    assert torch.isnan(BasicProjector(100, 16, 0, "normal", "cpu").project(x, 0)).all()


def test_fingerprint_round_trip_and_mismatch_message():
    fp = SparseProjector(100, 16, 3, 2, "cpu", model_id=4).fingerprint
    assert fp == Fingerprint.from_json(fp.to_json())
    assert fp.nnz == 2 and fp.model_id == 4 and fp.kind == "sparse"
    other = fp.with_model_id(5)
    with pytest.raises(FingerprintMismatchError, match=r"model_id: 4 != 5"):
        fp.require_same(other, "features")
    with pytest.raises(ValueError, match="unknown fingerprint fields"):
        Fingerprint.from_dict({**fp.to_dict(), "block_size": 3})
    dense = BasicProjector(10, 4, 0, "rademacher", "cpu").fingerprint
    assert dense.proj_type == "rademacher" and dense.kind == "dense"


ERRORS = [
    pytest.param(
        lambda: CountSketchProjector(10, 4, 0, "cpu").project(torch.randn(2, 11), 0),
        ValueError,
        "11 coordinates per example but the projector was built with grad_dim=10",
        id="wrong-grad-dim",
    ),
    pytest.param(
        lambda: CountSketchProjector(10, 4, 0, "cpu").project(torch.randn(10), 0),
        ValueError,
        r"must be 2-D \[batch, grad_dim\], got shape \(10,\)",
        id="not-2d",
    ),
    pytest.param(
        lambda: BasicProjector(10, 4, 0, "gaussian", "cpu"),
        ValueError,
        "`proj_type` must be one of 'normal', 'rademacher', got 'gaussian'",
        id="unknown-proj-type",
    ),
    pytest.param(
        lambda: CountSketchProjector(10, 0, 0, "cpu"),
        ValueError,
        "`proj_dim` must be a positive integer, got 0",
        id="proj-dim-zero",
    ),
    pytest.param(
        lambda: SparseProjector(10, 4, 0, 5, "cpu"),
        ValueError,
        "`nnz`=5 exceeds proj_dim=4",
        id="nnz-too-large",
    ),
    pytest.param(
        lambda: CudaProjector(10, 4, 0, "normal", "cpu", 32),
        ValueError,
        "CudaProjector needs a CUDA device.*CountSketchProjector",
        id="cuda-on-cpu",
    ),
    pytest.param(
        lambda: CountSketchProjector(10, 4, 0, "meta").project(torch.randn(2, 10), 0),
        ValueError,
        "`grads` is on cpu but the sketch lives on meta",
        id="device-mismatch",
    ),
    pytest.param(
        lambda: CountSketchProjector(10, 4, 0, "cpu").project_into_(
            torch.zeros(2, 4), torch.randn(2, 5), 8
        ),
        ValueError,
        r"runs past input_dim=10 \(offset=8, length=5\)",
        id="offset-overflow",
    ),
    pytest.param(
        lambda: CountSketchProjector(10, 4, 0, "cpu").project_into_(
            torch.zeros(3, 4), torch.randn(2, 5), 0
        ),
        ValueError,
        r"`out` must have shape \(2, 4\)",
        id="out-shape",
    ),
    pytest.param(
        lambda: CountSketchProjector(10, 4, 0, "cpu").project(
            torch.ones(2, 10, dtype=torch.int32), 0
        ),
        TypeError,
        "`grads` has dtype torch.int32",
        id="int-grads",
    ),
    pytest.param(
        lambda: CountSketchProjector(10, 4, 0, "cpu").project(
            {"a": torch.randn(2, 5), "b": torch.randn(3, 5)}, 0
        ),
        ValueError,
        r"`grads\['b'\]` has batch size 3",
        id="dict-batch-mismatch",
    ),
    pytest.param(
        lambda: CountSketchProjector(10, 4, 0, "cpu").project({}, 0),
        ValueError,
        "empty mapping",
        id="dict-empty",
    ),
]


@pytest.mark.parametrize(("make", "exc", "match"), ERRORS)
def test_errors(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["count", "sparse", "normal", "rademacher"])
def test_cuda_matches_cpu(kind):
    """The same map on both devices: results differ by float32 summation order only.

    Each output ``y_j = Σ_i x_i S_ij`` sums at most ``n`` nonzero terms (the
    most any column of ``S`` has); in any order its float32 error is at most
    ``γ_n Σ_i |x_i S_ij|`` with ``γ_n = n u / (1 - n u)``, ``u = 2⁻²⁴``
    (Higham, Accuracy and Stability, §4.2), so the two devices differ by at
    most twice that. ``S`` itself is read off the map: ``project(e_i)`` is its
    row ``i`` (one nonzero term, exact up to the scale's rounding, covered by
    the 2). A wrong hash, sign or scale moves outputs by O(|y|), far above it.
    """
    d, k = 5000, 128
    x = torch.randn(8, d)

    def build(device):
        if kind == "count":
            return CountSketchProjector(d, k, 0, device)
        if kind == "sparse":
            return SparseProjector(d, k, 0, 3, device)
        return BasicProjector(d, k, 0, kind, device)

    proj = build("cpu")
    cpu = proj.project(x, 0)
    gpu = build("cuda").project(x.cuda(), 0).cpu()
    rows = proj.project(torch.eye(d), 0).double()
    n = int((rows != 0).sum(0).max())
    u = 2.0**-24
    bound = 2 * (n * u / (1 - n * u)) * (x.double().abs() @ rows.abs())
    assert ((gpu.double() - cpu.double()).abs() <= bound).all()
    assert bound.max() < 1e-2 * cpu.abs().max()  # the bound is tight enough to mean something
