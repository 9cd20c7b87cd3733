"""Dense kernels behind the score computers: blocked XᵀX, damped inverse, fast GEMM.

The kernels read their operands through :mod:`._io`, which handles torch
tensors, numpy arrays and memmaps, and zarr arrays alike, so the same kernels
score features held in memory or on disk.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gradsketch.attribution._io import iter_row_blocks

logger = logging.getLogger(__name__)

#: ``lambda_reg="auto"`` damps with this fraction of the mean eigenvalue of XᵀX.
AUTO_DAMPING_FRACTION = 0.1

#: Column tile of the symmetric XᵀX product (only tiles on or above the
#: diagonal are multiplied).
SYRK_TILE = 512

#: Tile side of :func:`mirror_triangle`'s copies (a tile pair fits in L2).
MIRROR_TILE = 256

#: Allowed values of ``precision``.
PRECISIONS = ("float32", "bf16x3", "auto")


def xtx_blocked(
    x: Any,
    *,
    block_rows: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    tile: int = SYRK_TILE,
    prefetch: bool = True,
) -> Tensor:
    """``XᵀX`` streamed over row blocks, multiplying only tiles on or above the diagonal.

    ``XᵀX`` is symmetric, so only its upper triangle is computed and then
    mirrored: about half the flops of ``X.T @ X``. On CPU each block is one
    BLAS ``syrk`` call (SciPy's BLAS, :func:`blas_thread_count` threads); elsewhere,
    or without SciPy, of the ``t x t`` column-tile products only the
    ``t (t + 1) / 2`` upper ones are multiplied (torch exposes no syrk).

    Args:
        x: ``[n, k]`` rows (any supported array).
        block_rows: rows read at once (memory ``4 * block_rows * k`` bytes).
        device: where to multiply.
        dtype: accumulation dtype.
        tile: column tile size.
        prefetch: read the next block while multiplying this one (two blocks
            in memory); see :func:`iter_row_blocks`.

    Returns:
        ``[k, k]`` symmetric matrix.
    """
    n, k = int(x.shape[0]), int(x.shape[1])
    out = torch.zeros(k, k, dtype=dtype, device=device)
    edges = [*range(0, k, tile), k]
    syrk = _blas_syrk(out)
    if syrk is not None and _in_place_rows(x, device, dtype):
        # Rows already in memory as they are multiplied: one syrk over all of
        # them needs no extra memory, and BLAS blocks them better than we do.
        block_rows = max(block_rows, n)
    blocks = iter_row_blocks(x, block_rows, device=device, dtype=dtype, stop=n, prefetch=prefetch)
    for _, _, xb in blocks:
        if syrk is not None:
            syrk(xb)
            continue
        if len(edges) <= 3:
            # One or two tiles: the full product is as cheap and one call.
            out.addmm_(xb.T, xb)
            continue
        for i in range(len(edges) - 1):
            a = xb[:, edges[i] : edges[i + 1]]
            # The row of tiles right of (and including) the diagonal in one GEMM.
            out[edges[i] : edges[i + 1], edges[i] :].addmm_(a.T, xb[:, edges[i] :])
    if syrk is not None or len(edges) > 3:
        out = mirror_triangle(out, upper=True)
    return out


def _in_place_rows(x: Any, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``x`` is a C-contiguous tensor on ``device`` in ``dtype`` (its rows are views)."""
    return (
        isinstance(x, Tensor)
        and x.device == device
        and x.dtype == dtype
        and x.is_contiguous()
        and x.dim() == 2
    )


def mirror_triangle(a: Tensor, *, upper: bool, dtype: torch.dtype | None = None) -> Tensor:
    """The symmetric matrix whose upper (or lower) triangle is ``a``'s, in ``dtype``.

    A new tensor (``a`` is not changed); the other triangle of ``a`` is never
    read, so it may hold anything. Copied in ``MIRROR_TILE``-square tiles:
    a whole-matrix transposed read strides through memory and cost 3-4x
    more at k = 2,048 (0.055 s against 0.014 s on one Xeon core).

    Example:
        >>> mirror_triangle(torch.tensor([[1.0, 2.0], [9.0, 3.0]]), upper=True)
        tensor([[1., 2.],
                [2., 3.]])
    """
    out = a.to(dtype or a.dtype, copy=True)
    k = out.shape[0]
    step = MIRROR_TILE
    for i in range(0, k, step):
        diag = out[i : i + step, i : i + step]
        keep = torch.ones(diag.shape, dtype=torch.bool, device=out.device)
        keep = keep.triu_() if upper else keep.tril_()
        diag.copy_(torch.where(keep, diag, diag.T))
        for j in range(i + step, k, step):
            if upper:
                out[j : j + step, i : i + step] = out[i : i + step, j : j + step].T
            else:
                out[i : i + step, j : j + step] = out[j : j + step, i : i + step].T
    return out


def _blas_syrk(out: Tensor) -> Callable[[Tensor], None] | None:
    """``update(xb)``: ``out``'s upper triangle ``+= xbᵀ xb`` by BLAS ``?syrk``, or None.

    ``out`` is a C-ordered ``[k, k]`` tensor; seen by Fortran BLAS it is its
    own transpose, so the *lower* triangle BLAS writes is ``out``'s upper one,
    and ``xb`` (C-ordered ``[b, k]``) is BLAS's ``[k, b]`` matrix ``A`` of
    ``A Aᵀ``. None (nothing touched) off CPU, for dtypes BLAS lacks, or
    without SciPy.
    """
    if out.device.type != "cpu" or out.dtype not in (torch.float32, torch.float64):
        return None
    try:
        from scipy.linalg import blas
    except ImportError:  # pragma: no cover - scipy comes with the core dependencies
        return None
    routine = blas.ssyrk if out.dtype == torch.float32 else blas.dsyrk
    c = out.numpy().T

    def update(xb: Tensor) -> None:
        a = np.ascontiguousarray(xb.numpy()).T
        with _blas_threads(blas_thread_count()):
            result = routine(1.0, a, beta=1.0, c=c, trans=0, lower=1, overwrite_c=1)
        if not np.shares_memory(result, c):  # pragma: no cover - f2py copied c
            c[...] = result

    return update


def blas_thread_count() -> int:
    """Threads for SciPy's BLAS / LAPACK calls: torch's count, less one when that is every core.

    SciPy's OpenBLAS and torch's OpenMP are two thread pools whose idle
    workers busy-wait. With torch using every usable core, torch's idle
    worker still spins on a core when OpenBLAS starts its own workers there,
    and a BLAS call whose workers synchronise at every panel runs at the pace
    of the slowest one. Measured on a shared 2-core AMD EPYC (load 5-6),
    torch with 2 threads: ``trak_scores`` took 1.3x (n, k, m = 20,000,
    2,048, 256) to 2.8x (4,000, 512, 64) longer with two OpenBLAS threads
    than with one.

    Example:
        >>> 1 <= blas_thread_count() <= max(1, torch.get_num_threads())
        True
    """
    threads = torch.get_num_threads()
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS and Windows
        cores = os.cpu_count() or threads
    return max(1, threads - 1) if threads >= cores else threads


@contextlib.contextmanager
def _blas_threads(n: int) -> Iterator[None]:
    """SciPy's BLAS limited to ``n`` threads (:func:`blas_thread_count`) for the call."""
    global _THREADPOOLS
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:  # pragma: no cover - threadpoolctl comes with scikit-learn
        yield
        return
    if _THREADPOOLS is None:
        _THREADPOOLS = ThreadpoolController()
    with _THREADPOOLS.limit(limits=n, user_api="blas"):
        yield


_THREADPOOLS: Any = None


def resolve_lambda(lambda_reg: float | str, xtx: Tensor) -> float:
    """The damping actually used: a float, or ``"auto"``.

    ``"auto"`` is ``AUTO_DAMPING_FRACTION * trace(XᵀX) / k``: a tenth of the
    mean eigenvalue of XᵀX (the damping heuristic of kronfluence; Grosse et
    al., 2023). It costs O(k), is invariant to rescaling the gradients
    (scores scale like with λ=0), and bounds the condition number of
    ``XᵀX + λI`` by ``1 + 10 k``.
    """
    if isinstance(lambda_reg, str):
        k = xtx.shape[0]
        return AUTO_DAMPING_FRACTION * float(torch.diagonal(xtx).double().sum()) / max(k, 1)
    return float(lambda_reg)


def damped_inverse(xtx: Tensor, lam: float) -> Tensor:
    """``(XᵀX + λI)⁻¹`` through a float64 Cholesky factorisation.

    Float64 only here (an O(k³) step, cheap next to the O(n k²) products) so
    that λ = 0 with a badly conditioned XᵀX still gives an accurate inverse.
    If the matrix is singular up to the rounding of its dtype (fewer rows
    than columns with λ = 0, or gradients with an exact null space, such as
    margins whose gradients sum to zero over classes), falls back to the
    eigendecomposition pseudo-inverse and logs it. That is decided from the
    spectrum, not from whether Cholesky happened to succeed: a null space
    summed in another order on another CPU may come out as tiny positive
    eigenvalues instead of negative ones (see :func:`_clear_of_rounding`).
    The matrix is factorised and inverted once; the inverse's norm certifies
    the spectrum in O(k²) (:func:`_inverse_certifies`), and only when it
    cannot does the exact gate run its own factorisation.

    Coordinates whose column of X is identically zero (a count-sketch bucket
    that no gradient coordinate hashes to, when ``grad_dim`` is not much
    larger than ``proj_dim``) have zero rows and columns in XᵀX; with λ = 0
    the pseudo-inverse is the inverse of the remaining block padded with
    zeros, so that block is factorised directly (no eigendecomposition).

    Returns:
        ``[k, k]`` inverse in ``xtx``'s dtype.
    """
    k = xtx.shape[0]
    if not (math.isfinite(lam) and _all_finite(xtx)):
        raise ValueError(
            f"XᵀX (or λ={lam!r}) holds NaN or inf: some training features are not finite (a NaN "
            "or inf in an input row, a weight, or a damaged stored chunk); damping cannot fix "
            "that. Find the rows with `~np.isfinite(features).all(1)` and fix or drop them."
        )
    if lam == 0:
        live = torch.diagonal(xtx) != 0
        if 0 < int(live.sum()) < k:
            idx = torch.nonzero(live).reshape(-1)
            inner = damped_inverse(xtx.index_select(0, idx).index_select(1, idx), lam)
            out = torch.zeros_like(xtx)
            out[idx.reshape(-1, 1), idx.reshape(1, -1)] = inner
            return out
    a = xtx.to(torch.float64, copy=True)
    a.diagonal().add_(lam)
    # XᵀX carries the rounding of its own dtype: eigenvalues below this are noise.
    eps = torch.finfo(xtx.dtype).eps
    # Factor and invert first, then certify: the inverse's norm usually proves
    # the spectrum clear at O(k²) cost (:func:`_inverse_certifies`); only when
    # it cannot does the exact gate pay its own O(k³/3) shifted factorisation.
    chol, info = _cholesky(a)
    if info == 0:
        inv = _cholesky_inverse(chol, xtx.dtype)
        if _inverse_certifies(a, inv, eps) or _clear_of_rounding(a, eps):
            return inv
    evals, evecs = torch.linalg.eigh(a)
    cutoff = evals.abs().max() * k * eps
    live = evals.abs() > cutoff
    if not bool(live.all()):
        logger.warning(
            "XᵀX + λI (λ=%g) is singular up to rounding (rank-deficient gradients?); using its "
            "pseudo-inverse. Pass lambda_reg > 0 or lambda_reg='auto' to damp it.",
            lam,
        )
    inv_evals = torch.where(live, 1.0 / evals, torch.zeros_like(evals))
    inv = (evecs * inv_evals) @ evecs.T
    return inv.to(xtx.dtype)


def damped_solver(xtx: Tensor, lam: float) -> Callable[[Tensor], Tensor]:
    """``t -> t (XᵀX + λI)⁻¹`` for ``[m, k]`` rows ``t``, without forming the inverse.

    The scores of ``t @ damped_inverse(xtx, lam)`` for less work. On CPU,
    :func:`damped_inverse` factorises ``A = XᵀX + λI = L Lᵀ`` (``k³/3``
    flops, float64), inverts it (``potri``, ``2k³/3``), certifies the
    spectrum from the inverse's norm and multiplies the targets by it
    (``2 k² m``). Here the exact gate (:func:`_clear_of_rounding`, a float64
    Cholesky of ``A - cI``, ``k³/3``) certifies the spectrum instead, and
    the targets are solved against ``L`` by two triangular solves in their
    own dtype (``2 k² m``, the GEMM's flops): ``k³/3`` fewer flops, all of
    them float64 ones, and no inverse norms or mirror. At k = 2,048,
    m = 2,000 on one Xeon core: 0.45 s against 0.55 s for the inverse and
    GEMM (CPU seconds, medians of 5 interleaved calls).

    Precision: ``L`` is computed in float64 and rounded to ``t``'s dtype,
    a backward error ``|ΔA| <= 2u |L| |Lᵀ|`` (``u = 2⁻²⁴`` for float32);
    the two solves add ``|ΔL| <= γ_k |L|`` each (Higham, *Accuracy and
    Stability of Numerical Algorithms*, Thm 8.5), so the solved rows carry a
    backward error ``(2u + 2γ_k) ‖ |L| |Lᵀ| ‖₂ <= (2u + 2γ_k) trace(A)``.
    A float32 XᵀX already carries ``γ_n ‖ |X|ᵀ |X| ‖₂ <= γ_n trace(XᵀX)``
    from its own sums, so with ``n >= k`` training rows the solves at most
    about triple the worst-case perturbation of ``A`` that float32 features
    impose anyway (both then scale with ``κ(A)`` in the scores); in
    practice both errors grow like ``√k u`` and ``√n u``.

    Zero columns of XᵀX with λ = 0 (empty count-sketch buckets) are handled
    as :func:`damped_inverse` handles them: the live block is solved, the
    other columns of the result are 0. Anything else (not CPU, no SciPy, a
    spectrum not clear of rounding) goes through :func:`damped_inverse`
    (its pseudo-inverse for singular matrices) and one GEMM.

    Args:
        xtx: ``[k, k]`` symmetric XᵀX.
        lam: damping λ >= 0.

    Returns:
        A function of ``[m, k]`` rows giving ``[m, k]`` rows in their dtype.

    Example:
        >>> x = torch.randn(40, 5, generator=torch.Generator().manual_seed(0))
        >>> solve = damped_solver(x.T @ x, 0.0)
        >>> torch.allclose(solve(x[:3]), x[:3] @ torch.linalg.inv(x.T @ x), atol=1e-5)
        True
    """
    k = xtx.shape[0]
    usable = xtx.device.type == "cpu" and _scipy_lapack() is not None and math.isfinite(lam)
    if usable and lam == 0 and _all_finite(xtx):
        live = torch.nonzero(torch.diagonal(xtx) != 0).reshape(-1)
        if 0 < len(live) < k:
            # Zero columns: as damped_inverse, the live block's inverse padded with zeros.
            inner = damped_solver(xtx.index_select(0, live).index_select(1, live), lam)
            return functools.partial(_solve_live, inner, live)
    a = xtx.to(torch.float64, copy=True) if usable else xtx
    if usable and not math.isfinite(float(a.sum())):
        usable = False  # damped_inverse raises its error
    if usable:
        a.diagonal().add_(lam)
        if _clear_of_rounding(a, torch.finfo(xtx.dtype).eps):
            chol, info = _cholesky(a)
            if info == 0:
                return functools.partial(_solve_triangles, chol)
    inv = damped_inverse(xtx, lam)
    return lambda t: t @ inv.to(t.dtype)


def _solve_live(inner: Callable[[Tensor], Tensor], live: Tensor, t: Tensor) -> Tensor:
    """``t``'s ``live`` columns solved by ``inner``; the other columns 0."""
    out = torch.zeros_like(t)
    out[:, live] = inner(t.index_select(1, live.to(t.device)))
    return out


def _solve_triangles(chol: Tensor, t: Tensor) -> Tensor:
    """``t L⁻ᵀ L⁻¹ = t (L Lᵀ)⁻¹`` by two triangular solves in ``t``'s dtype (``chol`` is ``L``)."""
    low = chol.to(device=t.device, dtype=t.dtype)
    half = torch.linalg.solve_triangular(low.T, t, upper=True, left=False)  # Y Lᵀ = t
    return torch.linalg.solve_triangular(low, half, upper=False, left=False)  # Z L = Y


def _clear_of_rounding(a: Tensor, eps: float) -> bool:
    """Whether every eigenvalue of the symmetric float64 ``a`` exceeds ``λ_max k eps``.

    That is the eigendecomposition path's cutoff, so when this holds its
    pseudo-inverse is the plain inverse, and a Cholesky inverse gives it for
    a fraction of the cost. Certified by Sylvester's law of inertia:
    ``a - cI`` is positive definite iff ``λ_min > c``, with
    ``c = ub k eps`` and ``ub = min(‖a‖_∞, ‖a‖_F) >= λ_max``. A float64
    Cholesky of ``a - cI`` that completes is the exact factor of
    ``a - cI + E`` with ``‖E‖₂ <= (k+1) k u ‖a‖₂`` (Higham, *Accuracy and
    Stability of Numerical Algorithms*, Thm 10.3, with ``‖ |Rᵀ| |R| ‖₂ <=
    trace(a)``), so the shift also covers that: success proves
    ``λ_min > c``. One extra O(k³/3) factorisation; the earlier gate,
    ``λ_min >= 1/trace(a⁻¹)``, lost up to a factor ``k`` and sent
    well-conditioned matrices of a few thousand columns to ``eigh``.
    """
    shifted = a.clone()
    shifted.diagonal().sub_(_rounding_shift(a, eps))
    _, info = _cholesky(shifted)
    return info == 0


def _all_finite(a: Tensor) -> bool:
    """No NaN or inf in ``a``: one float64 sum for narrower floats (NaN and inf survive it).

    A float64 sum of float32 values cannot overflow, so it is finite exactly
    when every entry is, without ``isfinite``'s boolean copy of the matrix.
    """
    if a.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return math.isfinite(float(a.sum(dtype=torch.float64)))
    return bool(torch.isfinite(a).all())


def _scipy_lapack() -> Any:
    """``scipy.linalg.lapack``, or None without SciPy."""
    try:
        from scipy.linalg import lapack
    except ImportError:  # tested by hiding scipy.linalg
        return None
    return lapack


def _cholesky(a: Tensor) -> tuple[Tensor, int]:
    """The lower Cholesky factor ``L`` of the symmetric float64 ``a`` and LAPACK's ``info``.

    ``info`` is 0 on success, else the order of the first minor found not
    positive definite. On CPU through SciPy's ``dpotrf`` (at k = 2,048 on one
    Xeon core 0.10 s, torch's ``cholesky_ex`` 0.13 s), elsewhere torch's.
    """
    lapack = _scipy_lapack() if a.device.type == "cpu" else None
    if lapack is None:
        chol, info = torch.linalg.cholesky_ex(a)
        return chol, int(info)
    # C-ordered ``a`` is, to Fortran, aᵀ = a; its upper factor U (UᵀU = a)
    # read back in C order is L = Uᵀ. ``clean`` zeroes the other triangle.
    with _blas_threads(blas_thread_count()):
        upper, info = lapack.dpotrf(a.numpy().T, lower=0, clean=1, overwrite_a=0)
    return torch.from_numpy(upper.T), int(info)


@functools.cache
def _mkl_inverse_faster() -> bool:
    """Whether torch's MKL ``cholesky_inverse`` beats SciPy's OpenBLAS ``dpotri`` here.

    Measured at k = 2,048 on one core: on an Intel Xeon (Sapphire Rapids)
    MKL 0.14 s against ``dpotri`` plus mirroring 0.18 s; on an AMD EPYC MKL
    0.23 s against 0.14 s (MKL's LAPACK takes slower paths on AMD CPUs). So:
    MKL on Intel CPUs, OpenBLAS elsewhere.
    """
    if not torch.backends.mkl.is_available():
        return False
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return "GenuineIntel" in line
    except OSError:
        pass
    return False


def _rounding_shift(a: Tensor, eps: float) -> float:
    """``c = ub (k eps + (k+1) k u64)`` of :func:`_clear_of_rounding`, ``ub >= λ_max(a)``."""
    k = a.shape[0]
    ub = min(
        float(torch.linalg.matrix_norm(a, ord=float("inf"))),
        float(torch.linalg.vector_norm(a)),
    )
    u64 = torch.finfo(torch.float64).eps / 2
    return ub * (k * eps + (k + 1) * k * u64)


def _inverse_certifies(a: Tensor, inv: Tensor, eps: float) -> bool:
    """Whether the computed inverse ``inv`` of ``a`` shows every eigenvalue above the cutoff.

    ``λ_min(a) = 1 / ‖a⁻¹‖₂ >= 1 / min(‖a⁻¹‖_∞, ‖a⁻¹‖_F)`` (``a⁻¹`` is
    symmetric), so ``min(‖inv‖_∞, ‖inv‖_F) <= 1 / (2c)``, with
    :func:`_clear_of_rounding`'s shift ``c``, gives ``λ_min > c`` as long
    as ``inv`` is within a factor 2 of ``a⁻¹`` in norm. A Cholesky inverse
    errs by about ``k u64 κ(a)`` relative, under 1e-6 for any ``κ`` this
    test can pass; to pass wrongly, a matrix with ``λ_min <= c`` (so
    ``‖a⁻¹‖ >= 1/c``) would need an inverse computed with a relative error
    above 1/2. O(k²), no factorisation. Each norm overstates ``‖a⁻¹‖₂``
    somewhere (``‖·‖_F`` by ``√k`` on a flat spectrum, ``‖·‖_∞`` by up to
    ``√k`` on a localised null direction), so the test is not exact; a
    refusal falls back to the exact gate, not to ``eigh``.
    """
    norm = min(
        float(torch.linalg.matrix_norm(inv, ord=float("inf"), dtype=torch.float64)),
        float(torch.linalg.vector_norm(inv, dtype=torch.float64)),
    )
    return math.isfinite(norm) and 2 * norm * _rounding_shift(a, eps) <= 1


def _cholesky_inverse(chol: Tensor, dtype: torch.dtype = torch.float64) -> Tensor:
    """``(L Lᵀ)⁻¹`` from the lower Cholesky factor ``L`` (float64), returned in ``dtype``.

    On CPU, LAPACK's ``potri`` (triangular inverse, then ``L⁻ᵀ L⁻¹`` on one
    triangle: ``2k³/3`` flops): torch's MKL build on Intel CPUs, SciPy's
    OpenBLAS ``dpotri`` (:func:`blas_thread_count` threads) elsewhere (see
    :func:`_mkl_inverse_faster`); without SciPy or off CPU ``L⁻¹`` by a
    triangular solve and one product. At k = 2,048 on one thread of an AMD
    EPYC, SciPy's OpenBLAS ``dpotri`` took 0.14 s, the solve and product
    through torch's MKL 0.64 s, ``torch.cholesky_inverse`` 0.23 s.
    """
    if chol.device.type == "cpu":
        lapack = _scipy_lapack()
        if lapack is not None and _mkl_inverse_faster():
            # LAPACK's potri through MKL; torch fills in the other triangle.
            return torch.cholesky_inverse(chol).to(dtype)
        if lapack is not None:
            # C-ordered L is, to Fortran, the upper factor U = Lᵀ with UᵀU = L Lᵀ.
            upper = chol.numpy().T
            with _blas_threads(blas_thread_count()):
                # In place: the factor is not needed afterwards.
                inv, info = lapack.dpotri(upper, lower=0, overwrite_c=1)
            if info == 0:
                # Fortran's upper triangle is the C-ordered transpose's lower one.
                return mirror_triangle(torch.from_numpy(inv.T), upper=False, dtype=dtype)
    eye = torch.eye(chol.shape[0], dtype=chol.dtype, device=chol.device)
    chol_inv = torch.linalg.solve_triangular(chol, eye, upper=False)
    return (chol_inv.T @ chol_inv).to(dtype)


def resolve_precision(precision: str, device: torch.device) -> str:
    """The GEMM precision actually used: ``"auto"`` is ``"float32"``.

    ``"auto"`` is meant to pick the fastest float32-accurate product. The
    split-bfloat16 scheme only pays where bfloat16 GEMMs with float32
    accumulation run several times faster than float32 ones *and* take the
    split operands without conversion. CPU torch has no bfloat16 GEMM with a
    float32 result, so bf16x3 goes through oneDNN's bf16 math mode, which
    converts the float32 operands on every call: on an AMX CPU (Sapphire
    Rapids, 2 cores) it measured slower than float32 (``trak_scores`` at
    n=50k, k=2048, m=5k: 8.4 s against 5.5 s). So ``"auto"`` keeps float32;
    pass ``"bf16x3"`` to try the scheme on other hardware.

    Example:
        >>> resolve_precision("auto", torch.device("cpu"))
        'float32'
    """
    if precision not in PRECISIONS:
        raise ValueError(
            f"`precision` must be one of {list(PRECISIONS)}, got {precision!r}; "
            "'float32' is exact IEEE float32, 'bf16x3' is float32-accurate bfloat16 "
            "arithmetic (through oneDNN's bf16 math mode on CPU), 'auto' picks the faster "
            "measured choice (float32)."
        )
    if precision == "auto":
        return "float32"
    return precision


@contextlib.contextmanager
def _bf16_fpmath() -> Iterator[None]:
    """float32 matmuls computed by oneDNN in bfloat16 with float32 accumulation."""
    backend = getattr(torch.backends.mkldnn, "matmul", None)
    if backend is None or not hasattr(backend, "fp32_precision"):
        yield
        return
    previous = backend.fp32_precision
    backend.fp32_precision = "bf16"
    try:
        yield
    finally:
        backend.fp32_precision = previous


def split_bf16(a: Tensor) -> tuple[Tensor, Tensor]:
    """``a = hi + lo + r`` with ``hi``, ``lo`` exactly representable in bfloat16.

    ``|r| <= 2^-16 |a|``: the two pieces carry 16 of float32's 24 bits.
    Both are returned as float32 tensors.
    """
    hi = a.to(torch.bfloat16).float()
    lo = (a - hi).to(torch.bfloat16).float()
    return hi, lo


def matmul_nt(
    a: Tensor, b: Tensor, precision: str, *, out: Tensor | None = None, accumulate: bool = False
) -> Tensor:
    """``a @ b.T`` in float32, optionally with the split-bfloat16 ("bf16x3") scheme.

    bf16x3 computes ``a_hi b_hiᵀ + a_hi b_loᵀ + a_lo b_hiᵀ`` as one GEMM of
    three times the inner dimension, in bfloat16 with float32 accumulation
    (Henry, Tang & Heinecke, "Leveraging the bfloat16 artificial intelligence
    datatype for higher-precision computations", ARITH 2019). The dropped
    terms are below ``3 * 2^-16 (|a| |b|ᵀ)`` entrywise, float32 accumulation
    adds ``k * 2^-24 (|a| |b|ᵀ)``. On CPU it runs in oneDNN's bf16 math mode,
    which converts the operands on the fly: slower than float32 on the AMX
    CPU it was measured on (see :func:`resolve_precision`).

    Args:
        a: ``[p, k]`` float32.
        b: ``[q, k]`` float32.
        precision: ``"float32"`` or ``"bf16x3"``.
        out: optional ``[p, q]`` float32 destination (written in place).
        accumulate: add into ``out`` instead of overwriting it.

    Returns:
        ``[p, q]`` float32 (``out`` when given).
    """
    if precision == "bf16x3" and a.device.type == "cpu":
        a_hi, a_lo = split_bf16(a)
        b_hi, b_lo = split_bf16(b)
        a = torch.cat([a_hi, a_hi, a_lo], dim=1)
        b = torch.cat([b_hi, b_lo, b_hi], dim=1)
        context: contextlib.AbstractContextManager[None] = _bf16_fpmath()
    else:
        context = contextlib.nullcontext()
    with context:
        if out is None:
            return a @ b.T
        if accumulate:
            return out.addmm_(a, b.T)
        return torch.mm(a, b.T, out=out)


def bf16x3_error_bound(a: Tensor, b: Tensor) -> Tensor:
    """Entrywise bound on ``|matmul_nt(a, b, "bf16x3") - a @ b.T|`` (see :func:`matmul_nt`)."""
    k = a.shape[1]
    scale = 3 * 2.0**-16 + 2 * k * 2.0**-24
    return scale * (a.double().abs() @ b.double().abs().T)
