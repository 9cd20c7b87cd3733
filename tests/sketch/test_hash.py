"""The counter-based hash: exact integer arithmetic and uniformity."""

from __future__ import annotations

import math
import random

import pytest
import torch

from gradsketch._hash import MASK32, derive_key, hash_indices, mix32
from gradsketch.sketch._tables import buckets_and_signs, dense_block, dense_block_torch


def naive_lowbias32(h: int) -> int:
    """Reference with unbounded Python ints and a plain modular multiply."""
    h ^= h >> 16
    h = (h * 0x7FEB352D) % (1 << 32)
    h ^= h >> 15
    h = (h * 0x846CA68B) % (1 << 32)
    return h ^ (h >> 16)


def test_mix32_matches_python_integer_reference():
    """The int64 split-multiply twin equals plain unbounded-int arithmetic."""
    rng = random.Random(0)
    values = [0, 1, MASK32, 0x80000000, *(rng.getrandbits(32) for _ in range(5000))]
    got = mix32(torch.tensor(values, dtype=torch.int64)).tolist()
    assert got == [naive_lowbias32(v) for v in values]


def test_mix32_is_a_bijection_on_a_sample():
    x = torch.arange(1 << 16, dtype=torch.int64) * 65537
    assert mix32(x).unique().numel() == x.numel()


def test_derive_key_distinguishes_parts_and_order():
    keys = {derive_key(a, b) for a in range(20) for b in range(20)}
    assert len(keys) == 400
    assert derive_key(-1) == derive_key((1 << 64) - 1)
    assert derive_key(1, 2) != derive_key(2, 1)


def test_wide_indices_differ_from_their_low_word():
    """Coordinates beyond 2**32 fold their high word in (no aliasing with i - 2**32)."""
    low = torch.arange(100, dtype=torch.int64)
    high = low + (1 << 32)
    h_low = hash_indices(7, low)
    h_high = hash_indices(7, high)
    assert not torch.equal(h_low, h_high)
    # Same coordinate, computed alone or inside a block straddling 2**32: same hash.
    straddle = torch.arange((1 << 32) - 3, (1 << 32) + 3, dtype=torch.int64)
    assert torch.equal(hash_indices(7, straddle)[4:], hash_indices(7, straddle[4:]))
    assert torch.equal(hash_indices(7, straddle)[:3], hash_indices(7, straddle[:3]))


def test_buckets_are_uniform_and_signs_balanced():
    """Chi-square and binomial checks on d = 2**16 coordinates into k = 64 buckets.

    Under uniform independent buckets the chi-square statistic has mean k - 1
    and variance 2 (k - 1); we accept |chi2 - (k - 1)| < 5 sqrt(2 (k - 1)).
    The number of negative signs is Binomial(d, 1/2): mean d/2, standard
    deviation sqrt(d) / 2; we accept 5 standard deviations.
    """
    d, k = 1 << 16, 64
    folded = buckets_and_signs(derive_key(3), 0, d, k, torch.device("cpu"))
    buckets = folded % k
    counts = torch.bincount(buckets, minlength=k).double()
    expected = d / k
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert abs(chi2 - (k - 1)) < 5 * math.sqrt(2 * (k - 1))
    negatives = int((folded >= k).sum())
    assert abs(negatives - d / 2) < 5 * math.sqrt(d) / 2


@pytest.mark.parametrize("kind", ["rademacher", "normal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    ("offset", "length", "col_start", "col_stop"),
    [(0, 37, 0, 12), (5, 300, 3, 70), (1000, 64, 31, 33), (7, 9, 1, 2), ((1 << 32) - 3, 6, 0, 40)],
)
def test_numpy_dense_generator_equals_torch_twin(kind, dtype, offset, length, col_start, col_stop):
    """The CPU numpy-uint32 path and the int64 torch path give the same matrix.

    Rademacher entries are bit-identical; normal entries agree to float
    rounding of log/sqrt/cos/sin (1e-6).
    """
    cpu = torch.device("cpu")
    fast = dense_block(11, offset, length, col_start, col_stop, kind, dtype, cpu)
    ref = dense_block_torch(11, offset, length, col_start, col_stop, kind, dtype, cpu)
    assert fast.dtype == ref.dtype == dtype
    if kind == "rademacher":
        assert torch.equal(fast, ref)
    else:
        torch.testing.assert_close(fast, ref, rtol=1e-6, atol=1e-6)


def test_chunked_table_equals_one_pass():
    """Tables longer than the hashing chunk are built in pieces with the same values."""
    from gradsketch.sketch import _tables as _hash

    cpu = torch.device("cpu")
    n = _hash._TABLE_CHUNK * 2 + 17
    whole = buckets_and_signs(5, 3, n, 100, cpu)
    pieces = torch.cat(
        [
            buckets_and_signs(5, 3 + s, min(_hash._TABLE_CHUNK, n - s), 100, cpu)
            for s in range(0, n, _hash._TABLE_CHUNK)
        ]
    )
    assert torch.equal(whole, pieces)
    h = hash_indices(5, torch.arange(3, 3 + n, dtype=torch.int64))
    assert torch.equal(whole, ((h >> 1) * 100 >> 31) + 100 * (h & 1))


@pytest.mark.parametrize(
    ("key", "offset", "length", "buckets"),
    [
        (0x12345678, 0, 1_000, 2_048),
        (MASK32, 2**32 - 700, 700, 4_096),  # the last coordinates below 2**32
        (77, 123_456, 3 * 2**18 + 11, 2_048),  # several hashing chunks, a ragged last one
        (5, 0, 4_096, 1),
        (9, 10, 5_000, 2**20 - 1),  # the widest multiply-shift the docstring allows
    ],
)
def test_cpu_table_equals_torch_twin(key, offset, length, buckets, scatter_backend):
    """The sketches' CPU table (the native kernel's, or numpy's uint32 one where the kernels
    are off) and numpy's are the int64 torch table bit for bit: integer arithmetic."""
    from gradsketch.sketch import _backend

    cpu = torch.device("cpu")
    ref = buckets_and_signs(key, offset, length, buckets, cpu, fast=False)
    for fast in (
        _backend.buckets_and_signs(key, offset, length, buckets, cpu),
        buckets_and_signs(key, offset, length, buckets, cpu),
    ):
        assert fast.dtype == ref.dtype == torch.int64 and fast.shape == (length,)
        assert torch.equal(fast, ref)


def test_table_reaching_past_2_32_keeps_the_wide_hash():
    """A range that crosses 2**32 takes the torch path (high words folded in) on CPU too."""
    from gradsketch.sketch import _backend

    cpu = torch.device("cpu")
    table = _backend.buckets_and_signs(3, 2**32 - 5, 10, 512, cpu)
    h = hash_indices(3, torch.arange(2**32 - 5, 2**32 + 5, dtype=torch.int64))
    assert torch.equal(table, ((h >> 1) * 512 >> 31) + 512 * (h & 1))
