"""Hashing in gradsketch: the counter-based 32-bit hash and the fingerprints of tensors.

Sketch maps (:mod:`gradsketch.sketch`) and random parameter masks
(:mod:`gradsketch.masked`) draw their randomness from hashing integers
(seed, coordinate, ...) instead of from a stateful generator, so results do
not depend on device, chunking or call order. Both use the functions here:
:func:`derive_key` folds (seed, stream, ...) into a key, :func:`hash_indices`
(sketches) and :func:`entry_hash` (masks) hash coordinates under a key.
:class:`TensorDigest` is the one way weights, checkpoints and masks are
fingerprinted (sha256, 16 hex digits).

The mixer is Chris Wellons' ``lowbias32`` (xor-shift / multiply rounds, a
bijection on 32-bit words with low avalanche bias). Values are held in
``int64`` tensors in ``[0, 2**32)``; products are formed from 16-bit halves of
the constant so no intermediate exceeds 2**49 and signed overflow never
happens. The same functions accept plain Python ints, which makes them their
own exact reference.
"""

from __future__ import annotations

import hashlib
from typing import TypeVar

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "GOLDEN",
    "MASK32",
    "MIX_C1",
    "MIX_C2",
    "TensorDigest",
    "chunk_bits",
    "derive_key",
    "entry_hash",
    "hash_indices",
    "mix32",
    "mix32_numpy_",
    "mul32",
    "name_key",
    "random_bits",
]

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9
MIX_C1 = 0x7FEB352D
MIX_C2 = 0x846CA68B

T = TypeVar("T", int, Tensor)


def mul32(x: T, c: int) -> T:
    """``(x * c) mod 2**32`` for ``0 <= x < 2**32``, never leaving 2**49."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def mix32(x: T) -> T:
    """``lowbias32`` of a 32-bit word (a Python int or an int64 tensor, elementwise).

    Example:
        >>> import torch
        >>> mix32(12345) == int(mix32(torch.tensor(12345)))
        True
    """
    x = x ^ (x >> 16)
    x = mul32(x, MIX_C1)
    x = x ^ (x >> 15)
    x = mul32(x, MIX_C2)
    return x ^ (x >> 16)


def mix32_numpy_(x: np.ndarray) -> None:
    """:func:`mix32` in place on a ``uint32`` array (numpy wraps uint32 products).

    Several times faster than the int64 torch path on CPU, bit for bit equal.

    Example:
        >>> a = np.arange(4, dtype=np.uint32)
        >>> mix32_numpy_(a)
        >>> a.tolist() == [mix32(i) for i in range(4)]
        True
    """
    x ^= x >> np.uint32(16)
    x *= np.uint32(MIX_C1)
    x ^= x >> np.uint32(15)
    x *= np.uint32(MIX_C2)
    x ^= x >> np.uint32(16)


def derive_key(*parts: int) -> int:
    """Fold integers (seed, model_id, stream, ...) into one 32-bit key.

    Each part is taken modulo 2**64 (so negative seeds work) and consumed as
    two 32-bit words.

    >>> derive_key(0, 1) != derive_key(1, 0)
    True
    """
    h = 0x243F6A88
    for part in parts:
        value = part % (1 << 64)
        for word in (value & MASK32, value >> 32):
            h = mix32(((h ^ word) + GOLDEN) & MASK32)
    return h


def hash_indices(key: int, index: Tensor) -> Tensor:
    """Hash coordinates ``index`` (int64, >= 0) under ``key`` to 32-bit words (sketches).

    Indices below 2**32 use one mixing round; wider indices fold their high
    word in with a second round, so the map is a fixed function of the index
    whatever block it arrives in.

    Args:
        key: a key from :func:`derive_key`.
        index: int64 tensor of non-negative coordinates, any shape.

    Returns:
        int64 tensor of the same shape, values in ``[0, 2**32)``.
    """
    h = mix32((index & MASK32) ^ key)
    if index.numel() and int(index.max()) > MASK32:
        high = index >> 32
        h = torch.where(high > 0, mix32(h ^ mix32(high ^ mix32((key + 1) & MASK32))), h)
    return h


# Stream of the per-parameter keys of random masks (see derive_key).
_MASK_STREAM = 0x3A5C


def name_key(seed: int, name: str) -> int:
    """A 32-bit key for one parameter's mask under one seed (``0 <= seed < 2**64``).

    The name enters through the first four bytes of its sha256, so keys do
    not depend on Python's per-process string hashing.
    """
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return derive_key(seed, _MASK_STREAM, int.from_bytes(digest[:4], "little"))


def entry_hash(key: int, index: T) -> T:
    """32-bit hash of flat indices (int64 tensor or Python int, ``>= 0``) under ``key`` (masks).

    Every index, below or above 2**32, takes the same three rounds, so a
    chunk of indices can be hashed with its high word folded in once (see
    :func:`chunk_bits`). A Python int gives the exact reference value.

    Example:
        >>> key = name_key(7, "w")
        >>> int(entry_hash(key, torch.tensor([2**33 + 5]))[0]) == entry_hash(key, 2**33 + 5)
        True
    """
    low = index & MASK32
    high = index >> 32
    return mix32(mix32(low ^ key) ^ mix32((high + GOLDEN) & MASK32) ^ (key >> 1))


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
    high_key = mix32((high + GOLDEN) & MASK32) ^ (key >> 1)
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


class TensorDigest:
    """sha256 over text, tensor bytes and mask bits: the one fingerprint of weights and masks.

    Tensors are hashed by their raw bytes on CPU (so a fingerprint does not
    depend on the device), masks by their packed bits. :meth:`hexdigest`
    gives the 16 hex digits every fingerprint in gradsketch uses.

    Example:
        >>> def digest(t):
        ...     return TensorDigest().text("w").tensor(t).hexdigest()
        >>> a = digest(torch.ones(2, 3))
        >>> a == digest(torch.ones(3, 2).t()), len(a), a != digest(torch.zeros(2, 3))
        (True, 16, True)
    """

    def __init__(self, header: str = "") -> None:
        self._sha = hashlib.sha256(header.encode("utf-8"))

    def text(self, value: str) -> TensorDigest:
        """Add ``value`` as UTF-8."""
        self._sha.update(value.encode("utf-8"))
        return self

    def tensor(self, value: Tensor) -> TensorDigest:
        """Add the raw bytes of ``value`` (dtype layout, row-major, on CPU)."""
        data = value.detach().cpu().contiguous().reshape(-1)
        self._sha.update(data.view(torch.uint8).numpy().tobytes())
        return self

    def bits(self, mask: Tensor) -> TensorDigest:
        """Add a boolean mask as packed bits (eight entries a byte)."""
        self._sha.update(np.packbits(mask.detach().cpu().reshape(-1).numpy()).tobytes())
        return self

    def hexdigest(self) -> str:
        """The first 16 hex digits of the sha256."""
        return self._sha.hexdigest()[:16]
