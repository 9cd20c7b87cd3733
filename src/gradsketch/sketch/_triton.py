"""Triton kernels for the count sketch and the on-the-fly dense JL map.

These are the GPU twins of the torch path in :mod:`gradsketch.sketch._tables`:
the same counter-based hash (``lowbias32`` on 32-bit words), written with
``uint32`` arithmetic, which wraps natively on the GPU, where the torch path
emulates it with split multiplies in ``int64``. The *map* is therefore bit for
bit the one the CPU computes for the same fingerprint; only the order in which
floating-point contributions are summed differs (the count sketch scatters
with atomic adds), so outputs agree exactly whenever the sums are exact (for
example small integers) and to float32 rounding otherwise.

* :func:`triton_count_sketch`: ``out += scale * S block`` with the bucket and
  sign of every coordinate hashed in registers: no table is read, so the
  kernel streams the gradients once (Charikar, Chen & Farach-Colton, 2002).
* :func:`triton_dense_project`: ``out += block @ M[offset:offset+n, :k]`` for
  the dense Rademacher or Gaussian JL matrix ``M``, generated tile by tile in
  registers and fed to ``tl.dot``; no matrix is ever held in memory (the idea
  of TRAK's ``fast_jl`` kernel, Park et al., ICML 2023, but keyed by
  coordinate, so the map does not depend on the GPU's SM count).

Kernels run when :func:`available` is true: ``triton`` importable and either
CUDA present or ``TRITON_INTERPRET=1`` (Triton's CPU interpreter, which runs
the same kernels with numpy and is how the tests check them without a GPU).
The interpreter mode is read when this module is imported, as Triton decides
it when kernels are defined. Projectors call the kernels through
:func:`use_triton`, which the ``GRADSKETCH_TRITON`` environment variable
steers: ``auto`` (default: CUDA tensors only), ``1`` (wherever available,
also CPU tensors under the interpreter) or ``0`` (never).
"""

import logging
import os
from typing import Any

import torch

from gradsketch._checks import check_int, nonnegative_int, positive_int
from gradsketch._hash import MASK32, mix32
from gradsketch.errors import TritonUnavailableError
from gradsketch.sketch._tables import AUX_SALT, PAIR_SALT, RADEMACHER_SALT
from gradsketch.sketch._validate import check_block, check_float_tensor

try:  # optional: the `gpu` extra
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

logger = logging.getLogger(__name__)

#: Entry distributions of the dense kernel (the values of ``ProjectionType``).
DENSE_KINDS: tuple[str, ...] = ("rademacher", "normal")

#: Accepted values of the ``GRADSKETCH_TRITON`` environment variable.
ENV_VAR = "GRADSKETCH_TRITON"
ENV_VALUES: dict[str, str] = {
    "auto": "auto",
    "": "auto",
    "1": "on",
    "on": "on",
    "0": "off",
    "off": "off",
}

# Salts of the dense map's column and second hashes. They must equal the
# literals in `_hash.dense_block`; the identity-projection tests compare the
# generated matrices entry by entry, so a mismatch cannot go unnoticed.
_RADEMACHER_SALT = RADEMACHER_SALT
_PAIR_SALT = PAIR_SALT
_AUX_SALT = AUX_SALT

# Count-sketch tile: coordinates per program and batch rows sharing a hash.
_CS_BLOCK_N = 1024
_CS_BLOCK_B = 4
# Dense tile: rows of M per step, output columns, batch rows (tl.dot needs >= 16).
_DENSE_BLOCK_N = 32
_DENSE_BLOCK_K = 64
_DENSE_MAX_BLOCK_B = 64
# Split the coordinates over more programs until about this many run at once,
# but never below this many coordinates per program. Both depend on shapes
# only, never on the GPU, so the summation order is the same on every device.
_DENSE_TARGET_PROGRAMS = 1024
_DENSE_MIN_CHUNK = 4096

_INTERPRET = triton is not None and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Devices for which the choice of kernels has been logged (once each).
_ANNOUNCED: set[str] = set()


def interpret_mode() -> bool:
    """Whether the kernels were defined for Triton's CPU interpreter."""
    return _INTERPRET


def available() -> bool:
    """Whether the kernels can run: triton importable and (CUDA or the interpreter).

    Example:
        >>> isinstance(available(), bool)
        True
    """
    if triton is None:
        return False
    return _INTERPRET or torch.cuda.is_available()


def _env_mode() -> str:
    raw = os.environ.get(ENV_VAR, "auto").strip().lower()
    if raw not in ENV_VALUES:
        allowed = ", ".join(repr(v) for v in ENV_VALUES if v)
        raise ValueError(
            f"`{ENV_VAR}` is {raw!r}; allowed values are {allowed}. Unset it (or set 'auto') "
            "to use the Triton kernels on CUDA devices only."
        )
    return ENV_VALUES[raw]


def use_triton(device: torch.device) -> bool:
    """Whether projectors on ``device`` should call the Triton kernels.

    ``GRADSKETCH_TRITON=auto`` (the default) uses them for CUDA devices when
    :func:`available`; ``1`` whenever available (also for CPU tensors under
    ``TRITON_INTERPRET=1``, for testing); ``0`` never.

    Example:
        >>> use_triton(torch.device("cpu")) in (True, False)
        True
    """
    mode = _env_mode()
    if mode == "off" or not available():
        return False
    chosen = mode == "on" or device.type == "cuda"
    if chosen and device.type not in _ANNOUNCED:
        _ANNOUNCED.add(device.type)
        logger.info(
            "gradsketch: projecting with the Triton kernels (%s)",
            "CPU interpreter" if _INTERPRET else "compiled",
        )
    return chosen


def _require_available(block: torch.Tensor) -> None:
    if triton is None:
        raise TritonUnavailableError(
            "the Triton kernels need the `triton` package, which is not installed; install "
            "it with `pip install 'gradsketch[gpu]'`, or use the torch path (the projectors "
            "fall back to it automatically)."
        )
    if not _INTERPRET and block.device.type != "cuda":
        raise TritonUnavailableError(
            f"the Triton kernels run on CUDA tensors, got a tensor on {block.device}; move it "
            "with `.cuda()`, or set TRITON_INTERPRET=1 before importing gradsketch to run "
            "them with Triton's CPU interpreter (slow: for testing)."
        )


_KEY_FIX = "a key is 32 bits: derive it with sparse_key(seed, model_id, row) or dense_key(...)"


def _check_key(name: str, key: object) -> int:
    return check_int(name, key, low=0, high=MASK32 + 1, fix=_KEY_FIX)


def _check_operands(block: torch.Tensor, out: torch.Tensor, offset: object, proj_dim: int) -> None:
    check_block(block)
    check_float_tensor("out", out)
    if out.dtype not in (torch.float32, torch.float64):
        raise TypeError(
            f"`out` must be float32 or float64 (the accumulator), got {out.dtype}; allocate "
            "it with torch.zeros(batch, proj_dim)."
        )
    if out.shape != (block.shape[0], proj_dim):
        raise ValueError(
            f"`out` must have shape ({block.shape[0]}, {proj_dim}) for this block and "
            f"proj_dim, got {tuple(out.shape)}."
        )
    if out.stride(1) != 1:
        raise ValueError(
            f"`out` must be contiguous along its last dimension, got strides {out.stride()}; "
            "pass out.contiguous() and copy back."
        )
    if block.device != out.device:
        raise ValueError(
            f"`block` is on {block.device} but `out` is on {out.device}; put both on one device."
        )
    nonnegative_int("offset", offset, fix="pass the index of the block's first coordinate")


def _device_guard(tensor: torch.Tensor) -> Any:
    """Launch on the tensor's GPU (Triton launches on the current device)."""
    if tensor.device.type == "cuda":
        return torch.cuda.device(tensor.device)
    return _NullContext()


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


if triton is not None:

    @triton.jit
    def _mix32(h):
        # lowbias32, as `_hash.mix32`; uint32 products wrap modulo 2**32.
        tl.static_assert(h.dtype == tl.uint32)
        h = h ^ (h >> 16)
        h = h * 0x7FEB352D
        h = h ^ (h >> 15)
        h = h * 0x846CA68B
        h = h ^ (h >> 16)
        tl.static_assert(h.dtype == tl.uint32)
        return h

    @triton.jit
    def _hash_index(index, key, high_key, WIDE: tl.constexpr):
        # `_hash.hash_indices`: one round on the low word; coordinates at or
        # above 2**32 fold their high word in with a second round.
        index = index.to(tl.int64)
        low = (index & 0xFFFFFFFF).to(tl.uint32)
        h = _mix32((low ^ key).to(tl.uint32))
        if WIDE:
            high = (index >> 32).to(tl.uint32)
            folded = _mix32((h ^ _mix32((high ^ high_key).to(tl.uint32))).to(tl.uint32))
            h = tl.where(high > 0, folded, h)
        return h

    @triton.jit(do_not_specialize=["key", "high_key", "offset"])
    def _count_sketch_kernel(
        x_ptr,
        out_ptr,
        batch,
        n,
        stride_xb,
        stride_xn,
        stride_ob,
        key,
        high_key,
        offset,
        num_buckets,
        WIDE: tl.constexpr,
        BLOCK_B: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        # One program: BLOCK_N coordinates hashed once, BLOCK_B batch rows
        # scattered with atomics into their buckets.
        cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.program_id(1).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
        h = _hash_index(cols + offset, key, high_key, WIDE)
        # Multiply-shift on the upper 31 bits, in int64 as `buckets_and_signs`.
        bucket = ((h >> 1).to(tl.int64) * num_buckets) >> 31
        negative = (h & 1) == 1
        mask = (rows < batch)[:, None] & (cols < n)[None, :]
        x = tl.load(
            x_ptr + rows[:, None] * stride_xb + cols[None, :] * stride_xn, mask=mask, other=0.0
        )
        x = x.to(out_ptr.dtype.element_ty)
        x = tl.where(negative[None, :], -x, x)
        tl.atomic_add(
            out_ptr + rows[:, None] * stride_ob + bucket[None, :], x, mask=mask, sem="relaxed"
        )

    @triton.jit(do_not_specialize=["key", "high_key", "col_key", "aux_key", "offset"])
    def _dense_kernel(
        x_ptr,
        part_ptr,
        batch,
        n,
        proj_dim,
        chunk,
        stride_xb,
        stride_xn,
        stride_ps,
        stride_pb,
        key,
        high_key,
        col_key,
        aux_key,
        offset,
        NORMAL: tl.constexpr,
        WIDE: tl.constexpr,
        BLOCK_B: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # One program: a [BLOCK_B, BLOCK_K] output tile over one chunk of
        # coordinates, writing its partial sum to its own slice of `part`.
        pid_b = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_s = tl.program_id(2)
        rows = pid_b.to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
        ks = pid_k.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
        # Column keys as `dense_block`. Gaussian: one Box-Muller draw per pair
        # of columns gives the cosine (even column) and the sine (odd column).
        # Rademacher: one hash per word of 32 columns gives 32 signs. Hashing
        # per pair or per word, then interleaving, saves 2x or 32x the hashes.
        if NORMAL:
            HALF: tl.constexpr = BLOCK_K // 2
            pairs = pid_k.to(tl.int64) * HALF + tl.arange(0, HALF)
            ck = _mix32((pairs ^ col_key).to(tl.uint32))
        else:
            WORDS: tl.constexpr = BLOCK_K // 32
            words = pid_k.to(tl.int64) * WORDS + tl.arange(0, WORDS)
            ck = _mix32((words ^ col_key).to(tl.uint32))
            shifts = tl.arange(0, 32).to(tl.uint32)
        row_mask = rows < batch
        lo = pid_s.to(tl.int64) * chunk
        hi = tl.minimum(lo + chunk, n)
        acc = tl.zeros((BLOCK_B, BLOCK_K), dtype=tl.float32)
        for start in range(lo, hi, BLOCK_N):
            coords = start + tl.arange(0, BLOCK_N)
            rh = _hash_index(coords + offset, key, high_key, WIDE)
            h1 = _mix32(rh[:, None] ^ ck[None, :])
            if NORMAL:
                h2 = _mix32((h1 ^ aux_key).to(tl.uint32))
                # 24 high bits; u1 in (0, 1] keeps log finite (as the torch path).
                u1 = ((h1 >> 8) + 1).to(tl.float32) * (1.0 / 16777216.0)
                u2 = (h2 >> 8).to(tl.float32) * (1.0 / 16777216.0)
                radius = tl.sqrt_rn(-2.0 * tl.log(u1))  # correctly rounded, as torch.sqrt
                angle = 6.283185307179586 * u2  # 2 * pi, as dense_block
                pair = tl.join(radius * tl.cos(angle), radius * tl.sin(angle))
                m = tl.reshape(pair, (BLOCK_N, BLOCK_K))
            else:
                signs = (h1[:, :, None] >> shifts[None, None, :]) & 1
                m = tl.reshape(tl.where(signs == 1, -1.0, 1.0), (BLOCK_N, BLOCK_K))
            x = tl.load(
                x_ptr + rows[:, None] * stride_xb + coords[None, :] * stride_xn,
                mask=row_mask[:, None] & (coords < hi)[None, :],
                other=0.0,
            ).to(tl.float32)
            # ieee: no TF32, so float32 products match the torch path's matmul.
            acc += tl.dot(x, m.to(tl.float32), input_precision="ieee")
        tl.store(
            part_ptr + pid_s.to(tl.int64) * stride_ps + rows[:, None] * stride_pb + ks[None, :],
            acc,
            mask=row_mask[:, None] & (ks < proj_dim)[None, :],
        )


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def triton_count_sketch(
    block: torch.Tensor, key: int, offset: int, proj_dim: int, scale: float, out: torch.Tensor
) -> torch.Tensor:
    """``out += scale * S[:, offset:offset+n] block`` for the count sketch under ``key``.

    ``S`` has one non-zero per coordinate: ``S[h(i), i] = s(i)`` with bucket
    ``h`` and sign ``s`` from the hash of ``(key, i)``, exactly as
    :func:`gradsketch.sketch._tables.buckets_and_signs` (Charikar, Chen &
    Farach-Colton, ICALP 2002). Contributions are summed in ``out.dtype`` into
    a zeroed scratch row by atomic adds, then added with ``alpha=scale``, the
    same two steps as :func:`gradsketch.sketch._countsketch.accumulate_folded`.

    Args:
        block: ``[batch, n]`` float16/bfloat16/float32/float64 values of
            coordinates ``offset, ..., offset + n - 1`` (any strides).
        key: 32-bit key, e.g. ``sparse_key(seed, model_id, row)``.
        offset: index of the block's first coordinate.
        proj_dim: number of buckets k.
        scale: factor on the contribution (``sqrt(k / nnz)`` for projectors,
            1 for :class:`CountSketch`).
        out: float32/float64 ``[batch, proj_dim]`` accumulator, modified in place.

    Returns:
        ``out``.

    Raises:
        TritonUnavailableError: without triton, or on a CPU tensor outside
            the interpreter.

    Example:
        >>> from gradsketch.sketch._tables import sparse_key
        >>> out = torch.zeros(2, 8)
        >>> if use_triton(out.device):  # CUDA, or CPU under TRITON_INTERPRET=1
        ...     _ = triton_count_sketch(torch.ones(2, 5), sparse_key(0, 0, 0), 0, 8, 1.0, out)
        >>> out.shape
        torch.Size([2, 8])
    """
    _check_operands(block, out, offset, positive_int("proj_dim", proj_dim))
    key = _check_key("key", key)
    _require_available(block)
    batch, n = block.shape
    if batch == 0 or n == 0:
        return out
    scratch = torch.zeros(out.shape, dtype=out.dtype, device=out.device)
    grid = (_cdiv(n, _CS_BLOCK_N), _cdiv(batch, _CS_BLOCK_B))
    with _device_guard(block):
        _count_sketch_kernel[grid](
            block,
            scratch,
            batch,
            n,
            block.stride(0),
            block.stride(1),
            scratch.stride(0),
            key,
            mix32((key + 1) & MASK32),
            offset,
            proj_dim,
            WIDE=offset + n > MASK32,
            BLOCK_B=_CS_BLOCK_B,
            BLOCK_N=_CS_BLOCK_N,
            enable_fp_fusion=False,
        )
    out.add_(scratch, alpha=scale)
    return out


def triton_dense_project(
    block: torch.Tensor,
    key: int,
    offset: int,
    proj_dim: int,
    proj_type: str,
    out: torch.Tensor,
    *,
    splits: int | None = None,
) -> torch.Tensor:
    """``out += block @ M[offset:offset+n, :proj_dim]`` with ``M`` generated on the fly.

    ``M`` is the dense JL matrix of :func:`gradsketch.sketch._tables.dense_block`
    under ``key``: i.i.d. ±1 (``rademacher``) or N(0, 1) (``normal``, by
    Box-Muller) entries, ``E<Mᵀx, Mᵀy> = proj_dim * <x, y>`` (Johnson &
    Lindenstrauss, 1984; Achlioptas, 2003 for the ±1 entries). Tiles of ``M``
    live in registers only. Entries and products are float32 (the torch
    path's precision for float32 projectors); each program sums one chunk of
    coordinates and the chunks are added in a fixed order, so the result is
    deterministic.

    Args:
        block: ``[batch, n]`` values of coordinates ``offset, ..., offset + n - 1``.
        key: 32-bit key from ``dense_key(seed, model_id)``.
        offset: index of the block's first coordinate (row of ``M``).
        proj_dim: k, the number of columns of ``M``.
        proj_type: ``"rademacher"`` or ``"normal"``.
        out: the accumulator, as for :func:`triton_count_sketch`.
        splits: number of coordinate chunks summed separately (default: from
            the shapes only); changes rounding, never the map.

    Returns:
        ``out``.

    Raises:
        TritonUnavailableError: as :func:`triton_count_sketch`.

    Example:
        >>> from gradsketch.sketch._tables import dense_block, dense_key
        >>> x, out, key = torch.ones(2, 6), torch.zeros(2, 4), dense_key(0, 0)
        >>> if use_triton(out.device):  # the product with the matrix dense_block makes
        ...     _ = triton_dense_project(x, key, 0, 4, "rademacher", out)
        ...     m = dense_block(key, 0, 6, 0, 4, "rademacher", torch.float32, out.device)
        ...     assert torch.equal(out, x @ m)  # ±1 entries: exact integer sums
    """
    _check_operands(block, out, offset, positive_int("proj_dim", proj_dim))
    key = _check_key("key", key)
    if proj_type not in DENSE_KINDS:
        allowed = ", ".join(repr(k) for k in DENSE_KINDS)
        raise ValueError(
            f"`proj_type` must be one of {allowed}, got {proj_type!r}; pass e.g. "
            "proj_type='rademacher'."
        )
    if splits is not None:
        positive_int("splits", splits)
    _require_available(block)
    batch, n = block.shape
    if batch == 0 or n == 0:
        return out
    block_b = min(_DENSE_MAX_BLOCK_B, max(16, _next_pow2(batch)))
    grid_b, grid_k = _cdiv(batch, block_b), _cdiv(proj_dim, _DENSE_BLOCK_K)
    steps = _cdiv(n, _DENSE_BLOCK_N)
    if splits is None:
        wanted = max(1, _DENSE_TARGET_PROGRAMS // (grid_b * grid_k))
        splits = min(wanted, max(1, n // _DENSE_MIN_CHUNK))
    splits = min(splits, steps)
    chunk = _cdiv(steps, splits) * _DENSE_BLOCK_N
    splits = _cdiv(n, chunk)
    normal = proj_type == "normal"
    col_salt = _PAIR_SALT if normal else _RADEMACHER_SALT
    part = torch.empty(splits, batch, proj_dim, dtype=torch.float32, device=out.device)
    with _device_guard(block):
        _dense_kernel[(grid_b, grid_k, splits)](
            block,
            part,
            batch,
            n,
            proj_dim,
            chunk,
            block.stride(0),
            block.stride(1),
            part.stride(0),
            part.stride(1),
            key,
            mix32((key + 1) & MASK32),
            mix32(key ^ col_salt),
            mix32(key ^ _AUX_SALT),
            offset,
            NORMAL=normal,
            WIDE=offset + n > MASK32,
            BLOCK_B=block_b,
            BLOCK_N=_DENSE_BLOCK_N,
            BLOCK_K=_DENSE_BLOCK_K,
            # No fused multiply-adds outside tl.dot: the entries round as in torch.
            enable_fp_fusion=False,
        )
    total = part[0] if splits == 1 else part.sum(0)
    out += total.to(out.dtype)
    return out


__all__ = [
    "DENSE_KINDS",
    "ENV_VAR",
    "TritonUnavailableError",
    "available",
    "interpret_mode",
    "triton_count_sketch",
    "triton_dense_project",
    "use_triton",
]
