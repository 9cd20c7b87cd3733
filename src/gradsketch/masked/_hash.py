"""A counter-based 32-bit integer hash, the same on every device.

Random masks must not depend on a stateful generator (whose stream changes
with device, chunking and call order). Instead every entry's bits come from
hashing ``(seed, parameter name, flat index)`` with integer arithmetic that
gives identical results in Python and in torch int64 on any device.

The mixer (``lowbias32``, overflow-free in int64) is the ground-floor
:mod:`gradsketch._hash`, shared with the sketches.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from torch import Tensor

from gradsketch._hash import GOLDEN, MASK32, mix32, mix32_numpy_

__all__ = [
    "MASK32",
    "entry_hash",
    "entry_hash_py",
    "mix32",
    "name_key",
    "chunk_bits",
    "random_bits",
]

_GOLDEN = GOLDEN


def name_key(seed: int, name: str) -> int:
    """A 32-bit key for one parameter under one seed (``0 <= seed < 2**64``)."""
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    key = int.from_bytes(digest[:4], "little")
    key = mix32(key ^ mix32((seed & MASK32) ^ mix32((seed >> 32) ^ _GOLDEN)))
    return key


def entry_hash(key: int, index: Tensor) -> Tensor:
    """32-bit hash of flat indices ``[n]`` (int64, ``>= 0``) under ``key``.

    Args:
        key: From :func:`name_key`.
        index: ``[n]`` int64 flat indices.

    Returns:
        ``[n]`` int64 values in ``[0, 2**32)``.
    """
    low = index & MASK32
    high = index >> 32
    return mix32(mix32(low ^ key) ^ mix32((high + _GOLDEN) & MASK32) ^ (key >> 1))


def entry_hash_py(key: int, index: int) -> int:
    """Pure-Python twin of :func:`entry_hash` for one index (used by tests)."""
    low, high = index & MASK32, index >> 32
    return mix32(mix32(low ^ key) ^ mix32((high + _GOLDEN) & MASK32) ^ (key >> 1))


def chunk_bits(
    key: int, start: int, stop: int, threshold: int, device: torch.device, *, use_numpy: bool
) -> Tensor:
    """``entry_hash(key, i) < threshold`` for ``start <= i < stop`` (one chunk).

    The chunk must not cross a multiple of 2**32, so the high half of the
    index is one constant. With ``use_numpy`` the arithmetic runs in numpy
    uint32 on CPU (several times faster than int64 torch ops with split
    products); otherwise in torch int64 on ``device``. Both equal the
    Python-int definition bit for bit.
    """
    high = start >> 32
    if (stop - 1) >> 32 != high:
        raise ValueError(f"chunk [{start}, {stop}) crosses a multiple of 2**32")
    high_key = mix32((high + _GOLDEN) & MASK32) ^ (key >> 1)
    low_start = start & MASK32
    if use_numpy:
        x = np.arange(low_start, low_start + (stop - start), dtype=np.uint32)
        x ^= np.uint32(key)
        mix32_numpy_(x)
        x ^= np.uint32(high_key)
        mix32_numpy_(x)
        flags = x < threshold if threshold <= MASK32 else np.ones(x.shape, dtype=bool)
        return torch.from_numpy(flags).to(device)
    low = torch.arange(low_start, low_start + (stop - start), device=device)
    return mix32(mix32(low ^ key) ^ high_key) < threshold


def random_bits(key: int, numel: int, threshold: int, device: torch.device) -> Tensor:
    """Flat boolean ``[numel]``: ``entry_hash(key, i) < threshold`` for each ``i``.

    Computed in chunks of 2**20 indices (temporaries stay small); numpy on
    CPU, torch elsewhere (see :func:`chunk_bits`). The result does not depend
    on the device or the chunking.
    """
    out = torch.empty(numel, dtype=torch.bool, device=device)
    chunk = 1 << 20
    use_numpy = device.type == "cpu"
    for start in range(0, numel, chunk):
        stop = min(start + chunk, numel)
        out[start:stop] = chunk_bits(key, start, stop, threshold, device, use_numpy=use_numpy)
    return out
