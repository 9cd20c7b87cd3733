"""Hashing in gradsketch: the counter-based 32-bit hash and the fingerprints of tensors.

Sketch maps (:mod:`gradsketch.sketch`) and random parameter masks
(:mod:`gradsketch.masked`) draw their randomness from hashing integers
(seed, coordinate, ...) instead of from a stateful generator, so results do
not depend on device, chunking or call order. Both use the functions here:
:func:`derive_key` folds (seed, stream, ...) into a key, :func:`hash_indices`
(sketches) and :func:`entry_hash` (masks) hash coordinates under a key.

Digests are the other half: :class:`TensorDigest` (sha256 over text, tensor
bytes and mask bits, its first 16 hex digits) is the one scheme,
:data:`DIGEST_SCHEME`, by which models (:func:`architecture_digest`,
:func:`model_digest`), checkpoints (:func:`state_digest`), data
(:func:`tensors_digest`), settings and masks are fingerprinted. A store
whose digests came from another scheme is recognised by its record and
refused with the version that wrote it and the fix
(:func:`digest_scheme_refusal`).

The mixer is Chris Wellons' ``lowbias32`` (xor-shift / multiply rounds, a
bijection on 32-bit words with low avalanche bias). Values are held in
``int64`` tensors in ``[0, 2**32)``; products are formed from 16-bit halves of
the constant so no intermediate exceeds 2**49 and signed overflow never
happens. The same functions accept plain Python ints, which makes them their
own exact reference.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "DIGEST_KEY",
    "DIGEST_SCHEME",
    "GOLDEN",
    "MASK32",
    "MIX_C1",
    "MIX_C2",
    "TensorDigest",
    "architecture_digest",
    "chunk_bits",
    "derive_key",
    "digest_scheme_refusal",
    "entry_hash",
    "hash_indices",
    "mix32",
    "model_digest",
    "mix32_numpy_",
    "mul32",
    "name_key",
    "random_bits",
    "state_digest",
    "tensors_digest",
    "text_digest",
]

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9
MIX_C1 = 0x7FEB352D
MIX_C2 = 0x846CA68B

#: The one digest scheme (sha256, first 16 hex digits), named in the records that hold digests.
DIGEST_SCHEME = "sha256/16"
#: Record field naming the scheme of the record's digests (absent: the store's own legacy one).
DIGEST_KEY = "digest"
#: Tensors of more elements are digested from an even stride of 2**20 values and their sum.
SAMPLE_ABOVE = 1 << 20

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

    def value(self, value: Any) -> TensorDigest:
        """Add a tensor's bytes, or any other value's ``repr``."""
        return self.tensor(value) if isinstance(value, Tensor) else self.text(repr(value))


def _sampled(t: Tensor, above: int | None) -> Tensor:
    """``t`` flat, or for more than ``above`` elements an even stride of them and their sum."""
    flat = t.detach().reshape(-1)
    if above is None or flat.numel() <= above:
        return flat
    # Hashing every byte of a 7B-parameter model costs seconds; a stride of values and the
    # sum still changes with any training step.
    step = flat.numel() // above
    return torch.cat([flat[::step], flat.float().sum().reshape(1).to(flat.dtype)])


def tensors_digest(tensors: Iterable[Tensor], *, shapes: bool = False) -> str:
    """Digest of tensors' bytes, in order (data, a sampling order, a weight vector).

    Args:
        tensors: the tensors.
        shapes: digest each tensor's shape before its bytes (``[2, 3]`` and ``[3, 2]`` of the
            same values then differ).

    Example:
        >>> a = torch.arange(6)
        >>> tensors_digest([a]) == tensors_digest([a.view(2, 3)])
        True
        >>> tensors_digest([a], shapes=True) == tensors_digest([a.view(2, 3)], shapes=True)
        False
    """
    digest = TensorDigest()
    for t in tensors:
        if shapes:
            digest.text(repr(tuple(t.shape)))
        digest.tensor(t)
    return digest.hexdigest()


def text_digest(text: str) -> str:
    """Digest of a text (a settings record's JSON, a module's ``repr``)."""
    return TensorDigest().text(text).hexdigest()


def state_digest(state: Mapping[str, Any], *, sample_above: int | None = None) -> str:
    """Digest of a checkpoint: its names in sorted order, each with its tensor's bytes (or repr).

    Args:
        state: a ``state_dict``-like mapping.
        sample_above: digest tensors of more elements from a stride of ``2**20`` values and
            their sum (see :func:`model_digest`); ``None`` digests every byte.
    """
    digest = TensorDigest()
    for name in sorted(state):
        value = state[name]
        digest.text(name)
        digest.value(_sampled(value, sample_above) if isinstance(value, Tensor) else value)
    return digest.hexdigest()


def architecture_digest(model: torch.nn.Module) -> str:
    """Digest of a model's architecture: parameter and buffer names, shapes and dtypes."""
    digest = TensorDigest()
    for kind, items in (("p", model.named_parameters()), ("b", model.named_buffers())):
        for name, t in items:
            digest.text(f"{kind}:{name}:{tuple(t.shape)}:{t.dtype};")
    return digest.hexdigest()


def model_digest(model: torch.nn.Module, *, sample_above: int | None = SAMPLE_ABOVE) -> str:
    """Digest of a model's class, and its parameters' and buffers' names, shapes and values.

    Tensors of more than ``sample_above`` elements enter through an even stride of
    ``2**20`` of their values and their sum (``None``: every byte).

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> before = model_digest(model)
        >>> with torch.no_grad():
        ...     _ = model.bias.add_(1.0)
        >>> before != model_digest(model)
        True
    """
    digest = TensorDigest(type(model).__name__)
    for kind, items in (("p", model.named_parameters()), ("b", model.named_buffers())):
        for name, t in items:
            digest.text(f"{kind}:{name}:{tuple(t.shape)}:{t.dtype};")
            digest.tensor(_sampled(t, sample_above))
    return digest.hexdigest()


def digest_scheme_refusal(
    record: Mapping[str, Any], *, fields: Iterable[str], where: str, legacy: str, fix: str
) -> str | None:
    """Why a stored record's digests cannot be compared with this version's; None if they can.

    Records written before :data:`DIGEST_SCHEME` was the one scheme carry no
    :data:`DIGEST_KEY`; their digests were made by the store's ``legacy`` scheme.

    Args:
        record: the stored record.
        fields: the record's fields that hold digests (a record with none of them is fine).
        where: what holds it, for the message.
        legacy: the scheme by which the store wrote its records before they named one.
        fix: what to do instead.

    Example:
        >>> old = {"versions": {"gradsketch": "0.1.0"}, "model": "00ff"}
        >>> why = digest_scheme_refusal(
        ...     old, fields=["model"], where="`out`", legacy="blake2b/16", fix="Delete it."
        ... )
        >>> print(why)
        `out` was written by gradsketch 0.1.0, whose digests of models and data (blake2b/16) \
this version (sha256/16) cannot compare with its own. Delete it.
        >>> new = {DIGEST_KEY: DIGEST_SCHEME, "model": "00ff"}
        >>> digest_scheme_refusal(new, fields=["model"], where="", legacy="", fix="")
    """
    scheme = record.get(DIGEST_KEY, legacy)
    if scheme == DIGEST_SCHEME or not any(field in record for field in fields):
        return None
    versions = record.get("versions")
    version = versions.get("gradsketch") if isinstance(versions, Mapping) else None
    return (
        f"{where} was written by gradsketch {version or '(version not recorded)'}, whose "
        f"digests of models and data ({scheme}) this version ({DIGEST_SCHEME}) cannot compare "
        f"with its own. {fix}"
    )
