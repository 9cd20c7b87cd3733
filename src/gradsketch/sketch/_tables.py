"""The random tables of every sketch, drawn from counter-based hashing.

Every random entry of every sketch is a pure function of (seed, model_id,
stream, coordinate, output index), computed with 32-bit unsigned integer
arithmetic. Nothing depends on how the work is split into blocks, on the
device, or on a generator's internal state, which is what makes promise 1 of
the design ("same fingerprint, same map") hold.

The mixer, key derivation and coordinate hash live in :mod:`gradsketch._hash`
(shared with random parameter masks), so CPU, CUDA and Triton agree bit for
bit; this module turns them into count-sketch tables and dense JL blocks.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from gradsketch._hash import MASK32, derive_key, hash_indices, mix32, mix32_numpy_

#: Coordinates hashed at once when a whole table is built.
_TABLE_CHUNK = 1 << 18

#: Version of the hash scheme, recorded in every fingerprint. Bump it if the
#: functions below (or :func:`~gradsketch._hash.derive_key`) ever change, so
#: that old sketches are refused, not mixed.
HASH_VERSION = 1


_SPARSE_STREAM = 0x5A
_DENSE_STREAM = 0xDE

# Salts separating the dense generator's hashes; the Triton kernels import
# them, so the CPU and GPU maps cannot drift apart.
RADEMACHER_SALT = 0x5BD1E995
PAIR_SALT = 0x1B873593
AUX_SALT = 0xCC9E2D51


def sparse_key(seed: int, model_id: int, row: int) -> int:
    """Key of the ``row``-th non-zero of a sparse map.

    Row 0 at ``model_id=0`` is also :class:`CountSketch`'s key, so the count
    sketch and the count-sketch projector are the same map up to scale.
    """
    return derive_key(seed, model_id, _SPARSE_STREAM, row)


def dense_key(seed: int, model_id: int) -> int:
    """Key of a dense JL map."""
    return derive_key(seed, model_id, _DENSE_STREAM)


def coordinate_range(offset: int, length: int, device: torch.device) -> torch.Tensor:
    """The int64 coordinates ``offset, ..., offset + length - 1`` on ``device``."""
    return torch.arange(offset, offset + length, dtype=torch.int64, device=device)


def buckets_and_signs(
    key: int,
    offset: int,
    length: int,
    num_buckets: int,
    device: torch.device,
    *,
    fast: bool = True,
) -> torch.Tensor:
    """Folded count-sketch table for a coordinate range.

    One hash per coordinate: its lowest bit is the sign, its upper 31 bits pick
    the bucket by multiply-shift (no modulo bias worth naming for any
    ``num_buckets`` below 2**20). The result is ``bucket + num_buckets * neg``
    with ``neg`` in {0, 1}: a single int64 index into a ``2 * num_buckets``
    scratch row, so that sketching is one ``index_add_`` with no multiply.

    On CPU, for coordinates below 2**32, the hashes are computed in numpy's
    wrapping ``uint32`` arithmetic (:func:`~gradsketch._hash.mix32_numpy_`);
    ``fast=False`` keeps the int64 torch path, the reference twin (~35 ns a
    coordinate on one Xeon core). The sketches take their tables from
    :func:`gradsketch.sketch._backend.buckets_and_signs`, which uses the
    native kernel (~2 ns a coordinate) where it is loaded and this function
    elsewhere. All are integer arithmetic: the same bits on every CPU.

    Returns:
        int64 tensor ``[length]`` with values in ``[0, 2 * num_buckets)``.
    """
    if fast and device.type == "cpu" and offset + length <= MASK32 + 1:
        return torch.from_numpy(_buckets_and_signs_numpy(key, offset, length, num_buckets))
    if length > _TABLE_CHUNK:
        # Hash a chunk at a time into the result, so the int64 temporaries of
        # the mixer stay O(chunk) instead of several times the table.
        table = torch.empty(length, dtype=torch.int64, device=device)
        for start in range(0, length, _TABLE_CHUNK):
            stop = min(start + _TABLE_CHUNK, length)
            table[start:stop] = buckets_and_signs(
                key, offset + start, stop - start, num_buckets, device, fast=False
            )
        return table
    h = hash_indices(key, coordinate_range(offset, length, device))
    bucket = ((h >> 1) * num_buckets) >> 31
    return bucket + num_buckets * (h & 1)


def _buckets_and_signs_numpy(key: int, offset: int, length: int, num_buckets: int) -> np.ndarray:
    """:func:`buckets_and_signs` on CPU for coordinates below 2**32, a chunk at a time.

    ``hash_indices`` of such a coordinate is one ``mix32(index ^ key)``; the
    multiply-shift needs 51 bits, so it runs in ``uint64``.
    """
    table = np.empty(length, dtype=np.int64)
    h = np.empty(min(length, _TABLE_CHUNK), dtype=np.uint32)
    wide = np.empty(h.shape, dtype=np.uint64)
    for start in range(0, length, _TABLE_CHUNK):
        stop = min(start + _TABLE_CHUNK, length)
        part, big = h[: stop - start], wide[: stop - start]
        np.copyto(part, np.arange(offset + start, offset + stop, dtype=np.uint32))
        part ^= np.uint32(key & MASK32)
        mix32_numpy_(part)
        np.copyto(big, part)
        sign = (big & np.uint64(1)) * np.uint64(num_buckets)
        big >>= np.uint64(1)
        big *= np.uint64(num_buckets)
        big >>= np.uint64(31)
        big += sign
        table[start:stop] = big  # < 2 * num_buckets: fits int64
    return table


def dense_block(
    key: int,
    offset: int,
    length: int,
    col_start: int,
    col_stop: int,
    kind: str,
    dtype: torch.dtype,
    device: torch.device,
    *,
    fast: bool = True,
) -> torch.Tensor:
    """Rows ``offset:offset+length``, columns ``col_start:col_stop`` of a dense JL matrix.

    Entry ``(i, j)`` depends only on ``(key, i, j)``. Rademacher entries take
    bit ``j % 32`` of a hash of ``(i, j // 32)``. Normal entries use Box-Muller on two
    hashes of ``(i, j // 2)``: column ``2p`` takes the cosine and ``2p + 1``
    the sine of the same pair, so any column range gives identical values.
    Both kinds have mean 0 and variance 1.

    On CPU the entries are computed in numpy (:func:`_dense_block_numpy`);
    elsewhere, or with ``fast=False`` (:data:`dense_block_torch`, the
    reference twin), in int64 torch arithmetic.

    Returns:
        ``[length, col_stop - col_start]`` tensor of ``dtype``.
    """
    row_hashes = hash_indices(key, coordinate_range(offset, length, device))
    if fast and device.type == "cpu":
        return _dense_block_numpy(row_hashes, key, col_start, col_stop, kind, dtype)
    rows = row_hashes.unsqueeze(1)
    cols = torch.arange(col_start, col_stop, dtype=torch.int64, device=device)
    if kind == "rademacher":
        # One hash of (i, j // 32) gives the signs of 32 consecutive columns.
        first_word = col_start >> 5
        words = torch.arange(
            first_word, ((col_stop - 1) >> 5) + 1, dtype=torch.int64, device=device
        )
        word_keys = mix32(words ^ mix32(key ^ RADEMACHER_SALT)).unsqueeze(0)
        packed = mix32(rows ^ word_keys).index_select(1, (cols >> 5) - first_word)
        bits = (packed >> (cols & 31)) & 1
        return (1 - 2 * bits).to(dtype)
    pair_keys = mix32((cols >> 1) ^ mix32(key ^ PAIR_SALT)).unsqueeze(0)
    h1 = mix32(rows ^ pair_keys)
    h2 = mix32(h1 ^ mix32(key ^ AUX_SALT))
    work = torch.float64 if dtype == torch.float64 else torch.float32
    # 24 high bits give u1 in (0, 1]: log(u1) is finite, radius <= 5.8.
    u1 = ((h1 >> 8) + 1).to(work) * (1.0 / (1 << 24))
    u2 = (h2 >> 8).to(work) * (1.0 / (1 << 24))
    radius = torch.sqrt(-2.0 * torch.log(u1))
    angle = (2.0 * math.pi) * u2
    odd = (cols & 1).to(torch.bool).unsqueeze(0)
    return (radius * torch.where(odd, torch.sin(angle), torch.cos(angle))).to(dtype)


#: :func:`dense_block` in int64 torch arithmetic on any device: the reference twin.
dense_block_torch = functools.partial(dense_block, fast=False)


def _dense_block_numpy(
    row_hashes: torch.Tensor,
    key: int,
    col_start: int,
    col_stop: int,
    kind: str,
    dtype: torch.dtype,
) -> torch.Tensor:
    """CPU twin of :func:`dense_block`'s torch path in numpy ``uint32`` (wrapping products).

    Same entries (Rademacher bit for bit; normal up to the last ulp of the
    transcendental functions), several times faster: 4-byte words instead of
    int64 with split products, signs unpacked 32 at a time by
    ``np.unpackbits``, and each Box-Muller pair hashed once for its two
    columns.
    """
    rows_np = row_hashes.numpy().astype(np.uint32)[:, None]
    if kind == "rademacher":
        first_word = col_start >> 5
        words = torch.arange(first_word, ((col_stop - 1) >> 5) + 1, dtype=torch.int64)
        word_keys = mix32(words ^ mix32(key ^ RADEMACHER_SALT)).numpy().astype(np.uint32)
        packed = rows_np ^ word_keys[None, :]
        mix32_numpy_(packed)
        # Little-endian bytes, least significant bit first: column c of the
        # unpacked row is bit c % 32 of word c // 32, as in the torch twin.
        bits = np.unpackbits(
            packed.astype("<u4", copy=False).view(np.uint8), axis=1, bitorder="little"
        )
        lo = col_start - (first_word << 5)
        signs = torch.from_numpy(bits[:, lo : lo + (col_stop - col_start)]).to(dtype)
        return signs.mul_(-2).add_(1)
    first_pair = col_start >> 1
    pairs = torch.arange(first_pair, ((col_stop - 1) >> 1) + 1, dtype=torch.int64)
    pair_keys = mix32(pairs ^ mix32(key ^ PAIR_SALT)).numpy().astype(np.uint32)
    h1 = rows_np ^ pair_keys[None, :]
    mix32_numpy_(h1)
    h2 = h1 ^ np.uint32(mix32(key ^ AUX_SALT))
    mix32_numpy_(h2)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    u1 = torch.from_numpy((h1 >> np.uint32(8)).astype(np.int64) + 1).to(work) * (1.0 / (1 << 24))
    u2 = torch.from_numpy((h2 >> np.uint32(8)).astype(np.int64)).to(work) * (1.0 / (1 << 24))
    radius = torch.sqrt(-2.0 * torch.log(u1))
    angle = (2.0 * math.pi) * u2
    both = torch.stack((radius * torch.cos(angle), radius * torch.sin(angle)), dim=2)
    lo = col_start - (first_pair << 1)
    return both.reshape(len(rows_np), -1)[:, lo : lo + (col_stop - col_start)].to(dtype)
