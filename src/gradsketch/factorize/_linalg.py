"""Small dense linear-algebra kernels behind the factorization.

The factorization of an ``[N, D]`` input and an ``[N, M]`` target only ever
needs the centred Gram matrix ``XᵀX`` (``[D, D]``) and cross moment ``XᵀY``
(``[D, M]``): with ``XᵀX = RᵀR`` every least-squares solve of the alternating
scheme becomes a ``D``-sized one in the R-factor space, so the ``N`` rows are
touched twice (two matrix products), not once per iteration.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

SvdMethod = Literal["auto", "full", "randomized"]
SVD_METHODS: tuple[str, ...] = ("auto", "full", "randomized")

# Randomized range finding pays off once the target rank (plus oversampling)
# is a small fraction of the smaller dimension; above that a full
# decomposition is both faster and exact.
_RANDOMIZED_FRACTION = 4
_POWER_ITERS = 2


def _oversampling(k: int) -> int:
    return max(10, k // 10)


def use_randomized(k: int, n: int, method: str) -> bool:
    """Whether a rank-``k`` decomposition of an ``n``-sized problem goes randomized."""
    if method == "full":
        return False
    if method == "randomized":
        return k + _oversampling(k) < n
    return (k + _oversampling(k)) * _RANDOMIZED_FRACTION <= n


def gaussian_like(ref: Tensor, rows: int, cols: int, seed: int) -> Tensor:
    """A seeded ``[rows, cols]`` Gaussian, the same on every device."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    return out.to(device=ref.device, dtype=ref.dtype)


def top_right_singular_vectors(
    mat: Tensor, k: int, *, method: str = "auto", seed: int = 0
) -> tuple[Tensor, bool]:
    """Leading ``k`` right singular vectors of ``mat`` (``[r, m]``), as ``[m, k]``.

    Full method: an eigen-decomposition of the smaller Gram matrix
    (``mat matᵀ`` when ``r < m``, else ``matᵀ mat``). Eigen-solvers slow down
    badly on large clusters of zero eigenvalues, so the smaller side (which is
    generically full rank) is the one decomposed. Randomized method: subspace
    iteration (Halko, Martinsson & Tropp 2011) on ``matᵀ mat``.

    Returns:
        ``(vectors [m, k], exact)``; ``exact`` is ``False`` for the randomized method.
    """
    r, m = mat.shape
    if use_randomized(k, min(r, m), method):
        omega = gaussian_like(mat, m, k + _oversampling(k), seed)
        basis, _ = torch.linalg.qr(mat.T @ (mat @ omega))
        for _ in range(_POWER_ITERS):
            basis, _ = torch.linalg.qr(mat.T @ (mat @ basis))
        proj = mat @ basis
        small = proj.T @ proj
        _, vecs = torch.linalg.eigh((small + small.T) / 2)
        return basis @ vecs.flip(1)[:, :k], False
    if r < m:
        # Rank <= r < k is possible: the missing directions get zero vectors
        # (the matching latent units are then unused, which is optimal).
        vals, u = torch.linalg.eigh(mat @ mat.T)
        vals, u = vals.flip(0)[:k], u.flip(1)[:, :k]
        sing = vals.clamp_min(0.0).sqrt()
        top = sing.max() if sing.numel() else sing.new_zeros(())
        ok = sing > top.clamp_min(torch.finfo(sing.dtype).tiny) * m * torch.finfo(sing.dtype).eps
        v = torch.where(ok, (mat.T @ u) / torch.where(ok, sing, 1.0), 0.0)
        if v.shape[1] < k:
            v = torch.cat([v, v.new_zeros(m, k - v.shape[1])], dim=1)
        return v, True
    _, vecs = torch.linalg.eigh(mat.T @ mat)
    return vecs.flip(1)[:, :k], True


def truncated_svd(
    mat: Tensor, k: int, *, method: str = "auto", seed: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    """Leading ``k`` singular triplets of ``mat`` (``[m, n]``).

    Randomized (Halko et al. 2011, with power iterations) when ``k`` is far
    below ``min(m, n)`` or when asked, a full SVD otherwise.

    Returns:
        ``(U [m, k], S [k], Vh [k, n])``.
    """
    m, n = mat.shape
    if use_randomized(k, min(m, n), method):
        omega = gaussian_like(mat, n, k + _oversampling(k), seed)
        basis, _ = torch.linalg.qr(mat @ omega)
        for _ in range(_POWER_ITERS):
            basis, _ = torch.linalg.qr(mat.T @ basis)
            basis, _ = torch.linalg.qr(mat @ basis)
        u, s, vh = torch.linalg.svd(basis.T @ mat, full_matrices=False)
        u = basis @ u
    else:
        u, s, vh = torch.linalg.svd(mat, full_matrices=False)
    return u[:, :k], s[:k], vh[:k]


class RFactor:
    """Square-root factor ``R`` of a symmetric PSD Gram matrix ``G = RᵀR`` (float64).

    ``R`` is the (transposed) Cholesky factor, i.e. the R of a QR
    decomposition of the data, when ``G`` is comfortably positive definite; a
    ridge of ``eps * mean eigenvalue`` (far below the rounding noise of a Gram
    matrix accumulated in the working dtype) guards the factorization.
    Otherwise (fewer samples than dimensions, collinear or constant features)
    ``R = Λ^½ Vᵀ`` from the eigen-decomposition, dropping directions at the
    noise floor so they cannot blow up the factors.

    Args:
        gram: ``[D, D]`` symmetric PSD matrix, float64.
        eps: machine epsilon of the dtype ``gram`` was accumulated in.
    """

    def __init__(self, gram: Tensor, eps: float) -> None:
        d = gram.shape[0]
        self._chol: Tensor | None = None
        self._vecs: Tensor | None = None
        self._root: Tensor | None = None
        scale = float(gram.diagonal().sum()) / max(d, 1)
        if scale > 0.0 and math.isfinite(scale):
            eye = torch.eye(d, dtype=gram.dtype, device=gram.device)
            chol, info = torch.linalg.cholesky_ex(gram + (eps * scale) * eye)
            diag = chol.diagonal()
            if int(info) == 0 and float(diag.min()) ** 2 > d * eps * float(diag.max()) ** 2:
                self._chol = chol
                return
        if d == 0:
            self._keep(gram.new_zeros(0), gram.new_zeros(0, 0), 0.0)
            return
        vals, vecs = torch.linalg.eigh(gram)
        self._keep(vals.clamp_min(0.0).sqrt(), vecs, math.sqrt(max(d, 1) * eps))

    @classmethod
    def from_rows(cls, x: Tensor, eps: float) -> RFactor:
        """Factor of ``xᵀx`` from the rows themselves; cheap when ``N < D``.

        The thin SVD ``x = U Σ Vᵀ`` gives ``R = Σ Vᵀ`` at ``O(N² D)`` cost, never
        forming the ``[D, D]`` Gram matrix.
        """
        self = cls.__new__(cls)
        self._chol = None
        _, s, vh = torch.linalg.svd(x.double(), full_matrices=False)
        self._keep(s, vh.T, max(x.shape) * eps)
        return self

    def _keep(self, sing: Tensor, vecs: Tensor, tol: float) -> None:
        # Directions whose singular value is at the rounding floor (numpy's
        # matrix_rank rule) carry no signal; dropping them keeps factors bounded.
        top = sing.max().clamp_min(0.0) if sing.numel() else sing.new_zeros(())
        keep = sing > top * tol
        self._vecs = vecs[:, keep]
        self._root = sing[keep]

    @property
    def is_cholesky(self) -> bool:
        """Whether ``R`` is the triangular Cholesky factor (full column rank data)."""
        return self._chol is not None

    def apply(self, b: Tensor) -> Tensor:
        """``R @ b``."""
        if self._chol is not None:
            return self._chol.T @ b
        assert self._vecs is not None and self._root is not None
        return self._root[:, None] * (self._vecs.T @ b)

    def solve(self, b: Tensor) -> Tensor:
        """``R⁺ @ b`` (least-norm)."""
        if self._chol is not None:
            return torch.linalg.solve_triangular(self._chol.T, b, upper=True)
        assert self._vecs is not None and self._root is not None
        return self._vecs @ (b / self._root[:, None])

    def solve_transposed(self, b: Tensor) -> Tensor:
        """``R⁺ᵀ @ b``; maps the cross moment ``XᵀY`` to ``QᵀY``."""
        if self._chol is not None:
            return torch.linalg.solve_triangular(self._chol, b, upper=False)
        assert self._vecs is not None and self._root is not None
        return (self._vecs.T @ b) / self._root[:, None]


def small_solve(lhs: Tensor, rhs: Tensor) -> Tensor:
    """Solve ``lhs @ x = rhs`` for a small symmetric PSD ``lhs``, least norm if singular."""
    chol, info = torch.linalg.cholesky_ex(lhs)
    if int(info) == 0:
        return torch.cholesky_solve(rhs, chol)
    return torch.linalg.pinv(lhs, hermitian=True) @ rhs


def balance(wa: Tensor, wb: Tensor) -> tuple[Tensor, Tensor]:
    """Rescale column ``j`` of ``wa`` and row ``j`` of ``wb`` to equal norms.

    The product is unchanged; equal norms keep both factors on one scale,
    which is kinder to later training in low precision.
    """
    na = wa.norm(dim=0)
    nb = wb.norm(dim=1)
    ok = (na > 0) & (nb > 0)
    c = torch.where(ok, torch.sqrt(nb / torch.where(ok, na, 1.0)), 1.0)
    return wa * c, wb / c[:, None]
