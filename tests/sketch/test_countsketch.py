"""CountSketch and SketchBuffer: exact identities, references and statistics."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradsketch.sketch import SKETCH_QUANTITIES, CountSketch, Fingerprint, SketchBuffer

# Each test runs with the native scatter kernels and with torch's scatter.
pytestmark = pytest.mark.usefixtures("scatter_backend")


def explicit_matrix(cs: CountSketch) -> torch.Tensor:
    """Slow float64 reference: the k x d matrix with S[h(i), i] = s(i)."""
    matrix = torch.zeros(cs.output_dim, cs.input_dim, dtype=torch.float64)
    for i, (bucket, sign) in enumerate(zip(cs.hash_indices.tolist(), cs.hash_signs.tolist())):
        matrix[bucket, i] = sign
    return matrix


def test_sketch_equals_explicit_matrix_in_float64(device):
    cs = CountSketch.create(50, 7, seed=11).to(device)
    v = torch.randn(50, dtype=torch.float64, device=device)
    result = torch.zeros(7, dtype=torch.float64, device=device)
    cs.scatter_into_(result, v, 0)
    torch.testing.assert_close(result.cpu(), explicit_matrix(cs) @ v.cpu())


def test_signs_are_plus_minus_one_and_buckets_in_range():
    cs = CountSketch.create(1000, 13, seed=1)
    assert set(cs.hash_signs.unique().tolist()) == {-1.0, 1.0}
    assert 0 <= int(cs.hash_indices.min()) and int(cs.hash_indices.max()) < 13
    assert cs.hash_signs.dtype == torch.float32


@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=6),
    seed=st.integers(min_value=-(2**40), max_value=2**40),
)
def test_streaming_parts_equals_whole(sizes, seed):
    """Promise 2: scatter parts at their offsets == sketch of the concatenation."""
    total = max(sum(sizes), 1)
    cs = CountSketch.create(total, 5, seed=seed)
    parts = [torch.randn(n, dtype=torch.float64) for n in sizes]
    whole = torch.cat(parts) if sum(sizes) else torch.zeros(1, dtype=torch.float64)
    streamed = torch.zeros(5, dtype=torch.float64)
    offset = 0
    for p in parts:
        cs.scatter_into_(streamed, p, offset)
        offset += p.numel()
    direct = torch.zeros(5, dtype=torch.float64)
    cs.scatter_into_(direct, whole, 0)
    torch.testing.assert_close(streamed, direct)


@pytest.mark.parametrize("chunk", [1, 7, 1000, 1 << 18])
def test_tables_and_on_the_fly_are_identical(chunk):
    """Promise 7: hashing per block gives bit-identical sketches."""
    tables = CountSketch.create(3001, 64, seed=5)
    lazy = CountSketch(3001, 64, 5, materialize=False, chunk_size=chunk)
    v = torch.randn(3001)
    assert torch.equal(tables.hash_indices, lazy.hash_indices)
    assert torch.equal(tables.hash_signs, lazy.hash_signs)
    torch.testing.assert_close(tables.sketch(v), lazy.sketch(v), rtol=0, atol=1e-5)
    assert "on the fly" in repr(lazy) and "tables" in repr(tables)


def test_same_fingerprint_same_map_and_seed_changes_it():
    a, b = CountSketch.create(500, 32, seed=3), CountSketch.create(500, 32, seed=3)
    assert a.fingerprint == b.fingerprint
    assert torch.equal(a.hash_indices, b.hash_indices)
    c = CountSketch.create(500, 32, seed=4)
    assert a.fingerprint != c.fingerprint
    assert not torch.equal(a.hash_indices, c.hash_indices)
    # A longer sketch with the same seed extends the map (prefix property).
    longer = CountSketch.create(800, 32, seed=3)
    assert torch.equal(longer.hash_indices[:500], a.hash_indices)


def test_linearity():
    cs = CountSketch.create(200, 16, seed=0)
    v, w = torch.randn(200, dtype=torch.float64), torch.randn(200, dtype=torch.float64)

    def sk(x):
        out = torch.zeros(16, dtype=torch.float64)
        cs.scatter_into_(out, x, 0)
        return out

    torch.testing.assert_close(sk(2.5 * v - w), 2.5 * sk(v) - sk(w))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_input_dtypes_accumulate_in_float32(dtype):
    cs = CountSketch.create(100, 8, seed=0)
    v = torch.randn(100).to(dtype)
    out = cs.sketch(v)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), explicit_matrix(cs) @ v.double(), rtol=1e-5, atol=1e-4)


def test_nan_propagates_to_its_bucket_only():
    """Documented: a NaN coordinate poisons exactly one bucket, never silently vanishes."""
    cs = CountSketch.create(100, 8, seed=0)
    v = torch.randn(100)
    v[17] = float("nan")
    out = cs.sketch(v)
    bucket = int(cs.hash_indices[17])
    assert torch.isnan(out[bucket])
    assert torch.isfinite(out[torch.arange(8) != bucket]).all()


def test_multi_dim_input_is_flattened():
    cs = CountSketch.create(12, 4, seed=0)
    v = torch.randn(3, 4)
    torch.testing.assert_close(cs.sketch(v), cs.sketch(v.reshape(-1)))


def test_fingerprint_json_round_trip():
    fp = CountSketch.create(10, 4, seed=9).fingerprint
    assert Fingerprint.from_json(fp.to_json()) == fp
    assert fp.kind == "count_sketch" and fp.model_id is None


ERRORS = [
    pytest.param(lambda: CountSketch.create(0, 4), ValueError, "`input_dim`", id="input_dim-zero"),
    pytest.param(
        lambda: CountSketch.create(4, 0), ValueError, "`output_dim`", id="output_dim-zero"
    ),
    pytest.param(lambda: CountSketch.create(4, -2), ValueError, "got -2", id="output_dim-neg"),
    pytest.param(lambda: CountSketch.create(4, 2, seed=1.5), TypeError, "`seed`", id="seed-float"),
    pytest.param(
        lambda: CountSketch.create(10, 4).scatter_into_(torch.zeros(4), torch.ones(5), 6),
        ValueError,
        r"input_dim=10 \(offset=6, length=5\)",
        id="offset-overflow",
    ),
    pytest.param(
        lambda: CountSketch.create(10, 4).scatter_into_(torch.zeros(4), torch.ones(5), -1),
        ValueError,
        "`offset`",
        id="offset-negative",
    ),
    pytest.param(
        lambda: CountSketch.create(10, 4).scatter_into_(torch.zeros(5), torch.ones(5), 0),
        ValueError,
        r"`result` must have shape \(4,\)",
        id="result-shape",
    ),
    pytest.param(
        lambda: CountSketch.create(10, 4).sketch(torch.ones(5, dtype=torch.int64)),
        TypeError,
        "`v` has dtype torch.int64",
        id="int-input",
    ),
    pytest.param(
        lambda: CountSketch.create(10, 4).sketch([1.0, 2.0]),
        TypeError,
        "`v` must be a torch.Tensor",
        id="list-input",
    ),
    pytest.param(
        lambda: CountSketch.create(10, 4).to("meta").sketch(torch.ones(3)),
        ValueError,
        "`v` is on cpu but the sketch lives on meta",
        id="device-mismatch",
    ),
]


@pytest.mark.parametrize(("make", "exc", "match"), ERRORS)
def test_errors(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_sketch_buffer_lifecycle(device):
    buf = SketchBuffer.create(16, device=device)
    assert buf.QUANTITIES == SKETCH_QUANTITIES
    assert buf.device.type == device.type
    cs = CountSketch.create(20, 16, seed=0).to(device)
    cs.scatter_into_(buf.noise, torch.ones(20, device=device), 0)
    copy = buf.clone()
    buf.zero_()
    assert all(float(t.abs().sum()) == 0 for t in buf.as_dict().values())
    assert float(copy.noise.abs().sum()) > 0
    assert buf.to(device) is buf
    assert buf.to("cpu").device == torch.device("cpu")
    with pytest.raises(ValueError, match="`output_dim`"):
        SketchBuffer.create(0)


def test_sketch_buffer_inconsistent_devices_raise():
    buf = SketchBuffer.create(4)
    buf.noise = buf.noise.to("meta")
    with pytest.raises(RuntimeError, match="different devices"):
        _ = buf.device


def test_inner_products_unbiased_over_seeds():
    """E<Sv, Sw> = <v, w>, and the variance matches the count-sketch formula.

    For a single-row count sketch with independent uniform buckets and signs,
    Var<Sv, Sw> = (|v|^2 |w|^2 + <v,w>^2 - 2 sum_i v_i^2 w_i^2) / k.
    Over N = 3000 seeds the sample mean has standard error sigma / sqrt(N);
    we accept |mean - <v,w>| < 5 sigma / sqrt(N) (a false alarm has
    probability < 1e-6 under the CLT). The sample variance has standard error
    sqrt((m4 - s^4) / N), estimated from the sample's fourth central moment
    m4; we accept 5 such errors.
    """
    d, k, n_seeds = 64, 16, 3000
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(d, generator=gen, dtype=torch.float64)
    w = 0.6 * v + 0.8 * torch.randn(d, generator=gen, dtype=torch.float64)
    exact = float(v @ w)
    samples = []
    for seed in range(n_seeds):
        m = explicit_matrix(CountSketch.create(d, k, seed=seed))
        samples.append(float((m @ v) @ (m @ w)))
    x = torch.tensor(samples, dtype=torch.float64)
    theory_var = (float(v @ v) * float(w @ w) + exact**2 - 2 * float((v**2 * w**2).sum())) / k
    assert abs(float(x.mean()) - exact) < 5 * math.sqrt(theory_var / n_seeds)
    sample_var = float(x.var())
    m4 = float(((x - x.mean()) ** 4).mean())
    assert abs(sample_var - theory_var) < 5 * math.sqrt((m4 - sample_var**2) / n_seeds)


def test_folded_table_sketches_a_stack_of_vectors_at_once():
    """Stacked rows through one index_add_ equal separate scatter_into_ calls."""
    from gradsketch.sketch._countsketch import accumulate_folded

    cs = CountSketch.create(100, 8, seed=2)
    block = torch.randn(3, 40, dtype=torch.float64)
    out = torch.zeros(3, 8, dtype=torch.float64)
    accumulate_folded(out, block, cs.folded_table(30, 40), 8, 1.0)
    for row in range(3):
        ref = torch.zeros(8, dtype=torch.float64)
        cs.scatter_into_(ref, block[row], 30)
        torch.testing.assert_close(out[row], ref)
    with pytest.raises(ValueError, match="runs past input_dim=100"):
        cs.folded_table(90, 20)


@pytest.mark.parametrize("rows", [1, 3, 4])
@pytest.mark.parametrize("parts", [1, 2, 3, 5])
def test_split_scatter_equals_a_float64_scatter(rows, parts):
    """Column ranges scattered into partial rows and summed: the same sums, any split.

    n = 103 leaves a remainder for every ``parts`` > 1, so the tail call is
    covered too. float64 values, so only summation order differs: 1e-12 is
    a few hundred ulps of sums of ~100 unit-size terms.
    """
    from gradsketch.sketch._countsketch import scatter_folded_

    gen = torch.Generator().manual_seed(rows * 10 + parts)
    n, width = 103, 9
    folded = torch.randint(0, width, (n,), generator=gen)
    block = torch.randn(rows, n, generator=gen, dtype=torch.float64)
    want = torch.zeros(rows, width, dtype=torch.float64)
    for j in range(n):
        want[:, folded[j]] += block[:, j]
    got = torch.ones(rows, width, dtype=torch.float64)  # scatter_folded_ adds into it
    scatter_folded_(got, folded, block, parts=parts)
    torch.testing.assert_close(got - 1.0, want, rtol=1e-12, atol=1e-12)


def test_split_parts_balances_rows_over_threads(monkeypatch):
    """One range per thread below two rows per thread, unless the ranges get short."""
    from gradsketch.sketch import _countsketch

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(_countsketch, "SPLIT_MIN_COLUMNS", 10)
    assert _countsketch.split_parts(3, 1000) == 2
    assert _countsketch.split_parts(1, 1000) == 2
    assert _countsketch.split_parts(2, 1000) == 2
    assert _countsketch.split_parts(4, 1000) == 1  # two rows per thread
    assert _countsketch.split_parts(33, 1000) == 1
    assert _countsketch.split_parts(3, 15) == 1  # ranges of 7 < 10 columns
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert _countsketch.split_parts(3, 1000) == 1


def test_sketch_of_a_long_vector_is_split_and_unchanged(monkeypatch):
    """CountSketch.sketch through split scatters equals the unsplit sketch (float64 sums)."""
    from gradsketch.sketch import _countsketch

    cs = CountSketch.create(5000, 16, seed=4)
    v = torch.randn(5000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    whole = torch.zeros(16, dtype=torch.float64)
    monkeypatch.setattr(_countsketch, "split_parts", lambda rows, n: 1)
    cs.scatter_into_(whole, v, 0)
    split = torch.zeros(16, dtype=torch.float64)
    monkeypatch.setattr(_countsketch, "split_parts", lambda rows, n: 3)
    cs.scatter_into_(split, v, 0)
    torch.testing.assert_close(split, whole, rtol=1e-12, atol=1e-12)


def test_create_takes_the_constructor_options():
    """``create`` forwards every keyword option of ``__init__`` (the map depends only on the
    fingerprint, so a hashed-per-call sketch equals the tabled one exactly)."""
    v = torch.randn(50, dtype=torch.float64)
    made = CountSketch.create(50, 7, 2, materialize=False, chunk_size=8)
    assert not made.materialize and made.chunk_size == 8
    assert torch.equal(made.sketch(v), CountSketch(50, 7, 2).sketch(v))
    with pytest.raises(TypeError, match="unexpected keyword"):
        CountSketch.create(50, 7, 2, nnz=2)  # type: ignore[call-arg]
