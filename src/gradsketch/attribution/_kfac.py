"""K-FAC and EK-FAC curvature of one layer, from its inputs and output gradients.

For a layer whose per-example weight gradient is ``G_n = sum_t g_t a_tᵀ``
(Linear, Conv2d on im2col patches, GPT-2's ``Conv1D``; ``a [T, d_in]`` the
inputs, ``g [T, d_out]`` the gradients at the outputs), the Fisher /
Gauss-Newton block ``F = (1/N) sum_n vec(G_n) vec(G_n)ᵀ`` is approximated
by a Kronecker product (Martens & Grosse, "Optimizing neural networks with
Kronecker-factored approximate curvature", 2015). With ``vec`` the row-major
flatten of ``[d_out, d_in]`` (so ``vec(g aᵀ) = g ⊗ a``):

    F ≈ S ⊗ A,  A = mean over all tokens of a aᵀ,  S = (1/N) sum_n sum_t g_t g_tᵀ

which is exact when activations and gradients are independent and tokens
are uncorrelated (and with one token per example and one example, exactly
``F = (g gᵀ) ⊗ (a aᵀ)``). With ``S = Q_S diag(s) Q_Sᵀ`` and
``A = Q_A diag(α) Q_Aᵀ``, the Kronecker eigenbasis rotates a gradient to
``G' = Q_Sᵀ G Q_A``; K-FAC's eigenvalue there is ``s_i α_j``, and EK-FAC
(George et al., 2018; Grosse et al., "Studying large language model
generalization with influence functions", 2023) replaces it by the diagonal
of ``F`` in that basis, ``Λ_ij = (1/N) sum_n G'_n[i, j]²``. Influence of a
training example on a query is then

    score = <G'_query / (Λ + λ), G'_train>,   i.e.  g_queryᵀ (F + λI)⁻¹ g_train

summed over layers, so rotated training gradients are the stored features
and only the query side is divided. Bias terms enter as an extra input
coordinate fixed at 1.

Example:
    >>> import torch
    >>> a, g = torch.randn(8, 3, 4), torch.randn(8, 3, 2)  # [N, T, d_in], [N, T, d_out]
    >>> f = KroneckerFactors.zeros(4, 2)
    >>> f.update(a, g)
    >>> eig = f.eigen()
    >>> feats = eig.rotate(a, g)  # [N, d_out * d_in]
    >>> lam = ekfac_eigenvalues(feats)  # EK-FAC's corrected eigenvalues, [d_out * d_in]
    >>> scores = influence(feats, feats, lam, damping=0.1)  # [N, N]
    >>> tuple(scores.shape)
    (8, 8)
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from gradsketch._threads import torch_threads
from gradsketch.attribution._linalg import _blas_threads

__all__ = [
    "LAYER_AUTO_DAMPING_FRACTION",
    "KroneckerEigen",
    "KroneckerEigenbasis",
    "KroneckerFactors",
    "add_bias_input",
    "check_damping_fraction",
    "eigh_float64",
    "eigh_low_rank",
    "ekfac_eigenvalues",
    "influence",
    "resolve_damping",
]

#: Per-layer ``"auto"`` damping: this fraction of each layer's mean eigenvalue.
#: Chosen by LDS over five protocols (benchmarks/RESULTS.md, "Influence
#: defaults"): 0.3 has the best mean and the smallest worst regret of the sweep.
LAYER_AUTO_DAMPING_FRACTION = 0.3

#: A factor summed from at most this share of its width in token rows is
#: eigendecomposed through its range (:func:`eigh_low_rank`) ...
LOW_RANK_SHARE = 0.75
#: ... from this width on (below it a full ``eigh`` takes a fraction of a second).
LOW_RANK_MIN_WIDTH = 512


def add_bias_input(a: Tensor) -> Tensor:
    """``[..., d_in] -> [..., d_in + 1]``: the bias is the weight of a constant-1 input."""
    return torch.cat([a, a.new_ones(*a.shape[:-1], 1)], dim=-1)


def _flat_tokens(x: Tensor, width: int, name: str) -> Tensor:
    if x.dim() != 3 or x.shape[-1] != width:
        raise ValueError(
            f"`{name}` must be [batch, tokens, {width}], got shape {tuple(x.shape)}; "
            "reshape a [batch, width] input to [batch, 1, width]."
        )
    return x.reshape(-1, width)


@dataclass
class KroneckerFactors:
    """Running sums of one layer's Kronecker factors (see the module docstring).

    Attributes:
        a_sum: ``[d_in, d_in]`` sum over every token of ``a aᵀ``.
        g_sum: ``[d_out, d_out]`` sum over every token of ``g gᵀ``.
        tokens: tokens summed into ``a_sum``.
        examples: examples summed into ``g_sum``.
        a_exact: every batch's ``aᵀa`` was formed in float64 (see :meth:`update`).
        g_exact: every batch's ``gᵀg`` was formed in float64.
    """

    a_sum: Tensor
    g_sum: Tensor
    tokens: int = 0
    examples: int = 0
    a_exact: bool = False
    g_exact: bool = False

    @classmethod
    def zeros(
        cls, d_in: int, d_out: int, *, dtype: torch.dtype = torch.float64, device: str = "cpu"
    ) -> KroneckerFactors:
        """Empty sums for a layer with ``d_in`` inputs and ``d_out`` outputs."""
        return cls(
            torch.zeros(d_in, d_in, dtype=dtype, device=device),
            torch.zeros(d_out, d_out, dtype=dtype, device=device),
        )

    def update(self, a: Tensor, g: Tensor) -> None:
        """Add a batch: ``a [B, T, d_in]`` inputs, ``g [B, T, d_out]`` output gradients.

        The batch's ``aᵀa`` and ``gᵀg`` are formed in the inputs' dtype (at least
        float32) and added to the sums in theirs (float64 by default). A factor
        that may still end up of rank below its width (width at least
        :data:`LOW_RANK_MIN_WIDTH`, at most :data:`LOW_RANK_SHARE` of it in
        tokens so far) forms its products in float64: float32 sums are not
        positive semidefinite below their rounding (GPT-2's ``S``: eigenvalues
        down to -1.6e-8 of the largest), which a pivoted Cholesky of the range
        (:func:`eigh_low_rank`) would amplify to 1e-5 (measured). The float64
        products stop once the tokens pass ``LOW_RANK_SHARE * d``, so they cost
        at most ``LOW_RANK_SHARE d³`` extra multiply-adds per factor, whatever
        the data's size (about 0.7 CPU-s per GPT-2 block on one Xeon core); a
        3,072-wide factor's :meth:`eigen` then takes about 4 CPU-s instead of 6.

        Padding tokens must carry ``g = 0`` (they then add nothing to ``S``) and
        should be dropped from ``a`` by the caller if they are not to count in
        ``A``'s mean.
        """
        # The batch's products in its own dtype (float32 GEMMs are several times
        # faster than float64 ones), summed across batches in the factors' dtype.
        work = torch.promote_types(torch.promote_types(a.dtype, g.dtype), torch.float32)
        af = _flat_tokens(a, self.a_sum.shape[0], "a").to(work)
        gf = _flat_tokens(g, self.g_sum.shape[0], "g").to(work)
        if a.shape[:2] != g.shape[:2]:
            raise ValueError(
                f"`a` and `g` must share [batch, tokens], got {tuple(a.shape)} and "
                f"{tuple(g.shape)}."
            )
        rows = self.tokens + af.shape[0]
        first = self.examples == 0
        for x, total, name in ((af, self.a_sum, "a"), (gf, self.g_sum, "g")):
            wide = x.dtype == torch.float64 or _may_be_low_rank(total.shape[0], rows)
            exact = wide and total.dtype == torch.float64
            x = x.double() if exact else x
            total += (x.T @ x).to(total.dtype)
            flag = f"{name}_exact"
            setattr(self, flag, exact if first else getattr(self, flag) and exact)
        self.tokens = rows
        self.examples += a.shape[0]

    def covariances(self) -> tuple[Tensor, Tensor]:
        """``(A, S)``: the mean over tokens of ``a aᵀ`` and over examples of ``sum_t g gᵀ``.

        A layer that saw no token in any batch (an expert no example was routed
        to) has ``A = 0``: its curvature is zero and only damping is left.
        """
        if self.examples == 0:
            raise ValueError("no batch was added: call `update` before `covariances`.")
        return self.a_sum / max(self.tokens, 1), self.g_sum / self.examples

    def eigen(self, *, low_rank_s: bool = True) -> KroneckerEigen:
        """The eigendecompositions of ``A`` and ``S`` (float64).

        A factor is a sum of ``tokens`` outer products, so its rank is at most
        ``tokens``; where that is at most :data:`LOW_RANK_SHARE` of a width of
        :data:`LOW_RANK_MIN_WIDTH` or more (GPT-2's 3,072-wide factors at 16
        documents of 128 tokens) only its range is decomposed
        (:func:`eigh_low_rank`), and the basis keeps ``r < d`` columns: the
        directions left out have eigenvalue 0 and carry no training gradient
        (see :class:`KroneckerEigenbasis`). ``low_rank_s=False`` keeps ``S``
        whole: needed where the stored training gradients are not the ones
        ``S`` is summed from (``curvature="sampled"``), which may then have
        parts in ``S``'s null space. Otherwise :func:`eigh_float64`.
        """
        a_cov, g_cov = self.covariances()
        with _one_cpu_thread(a_cov.device):
            low_a = self.a_exact and _may_be_low_rank(a_cov.shape[0], self.tokens)
            low_s = low_rank_s and self.g_exact and _may_be_low_rank(g_cov.shape[0], self.tokens)
            alpha, q_a = (eigh_low_rank if low_a else eigh_float64)(a_cov)
            s, q_s = (eigh_low_rank if low_s else eigh_float64)(g_cov)
        return KroneckerEigen(q_a=q_a, alpha=alpha, q_s=q_s, s=s)


def _may_be_low_rank(width: int, rows: int) -> bool:
    """Whether a factor of ``width`` summed from ``rows`` token rows is decomposed by its range."""
    return width >= LOW_RANK_MIN_WIDTH and rows <= LOW_RANK_SHARE * width


def eigh_float64(factor: Tensor) -> tuple[Tensor, Tensor]:
    """``(eigenvalues, eigenvectors)`` of a symmetric factor, in float64.

    On the CPU through SciPy's LAPACK divide and conquer (``syevd``), which took
    6.2 CPU-s at d = 3073 against 9.3 for ``torch.linalg.eigh`` (one Xeon thread;
    the two agree to float64 rounding): the 3072-wide factors of GPT-2's MLP
    are the largest cost of fitting exact EK-FAC there. float32 is not enough:
    at GPT-2's width a float32 ``eigh`` moved EK-FAC's scores by up to 6 % of the
    largest (Pearson 0.9990 against float64's): its eigenvectors of the small
    eigenvalues are off by angles up to ``u ‖A‖ / gap`` (``u = 2⁻²⁴``), and EK-FAC
    re-fits its eigenvalues in whatever basis it is given.
    """
    if factor.device.type == "cpu":
        import scipy.linalg

        # One thread, as torch's below (see _one_cpu_thread).
        with _blas_threads(1):
            values, vectors = scipy.linalg.eigh(
                factor.double().numpy(), driver="evd", check_finite=True
            )
        return torch.from_numpy(values), torch.from_numpy(vectors)
    return torch.linalg.eigh(factor.double())


def eigh_low_rank(factor: Tensor) -> tuple[Tensor, Tensor]:
    """``(eigenvalues [r], eigenvectors [d, r])`` of a positive semidefinite factor's range.

    For a factor ``A`` of rank ``r < d`` (a sum of fewer outer products than
    its width), in ascending order as :func:`eigh_float64`, float64, CPU:

    1. pivoted Cholesky (LAPACK ``dpstrf``, its tolerance
       ``τ = d u max(diag A)``, ``u = 2⁻⁵³``): ``A = F Fᵀ + E`` with
       ``F [d, r]`` and ``E`` the Schur complement left, whose diagonal is
       below ``τ``; for ``A`` positive semidefinite to its float64 rounding
       (a sum of float64 products: :meth:`KroneckerFactors.update`),
       ``‖E‖₂ <= trace(E) <= (d - r) τ``, the rounding level of ``A`` itself
       (not so for sums of float32 products, whose negative rounding
       eigenvalues the pivots amplify);
    2. ``FᵀF = V diag(w) Vᵀ`` (``[r, r]``: ``(r/d)³`` of the ``eigh`` of ``A``);
       ``FᵀF`` and ``F Fᵀ`` share their nonzero eigenvalues, so ``w`` are
       ``A``'s, with ``eigh``'s absolute error ``p(r) u ‖A‖``;
    3. ``U = F V diag(w)^(-1/2)``, the eigenvectors, orthonormal up to
       ``|U_iᵀU_j - δ_ij| <= p(r) u ‖A‖ / sqrt(w_i w_j)`` (the residual of
       step 2 divided by the two scales). Columns with ``w <= r u w_max``
       are rounding noise and are left out; those with ``w < 1e-6 w_max``
       (whose orthogonality that bound cannot promise to 1e-10) are made
       orthogonal to the others and among themselves (two Gram-Schmidt
       passes, a QR) and re-diagonalised in their span (Rayleigh-Ritz), so
       every returned pair has ``eigh``'s residual ``‖A u - w u‖ <= p(d) u ‖A‖``.

    On GPT-2's 3,072- and 3,073-wide factors at 16 documents of 128 tokens
    (``benchmarks/bench_influence_scale.py``, r = 2,032 and 2,048), one Xeon
    core: 3.7 and 4.0 CPU-s against 6.2 and 5.8 for :func:`eigh_float64`,
    residuals ``max ‖A u - w u‖ / ‖A‖`` 4.8e-14 and 1.2e-15, ``|UᵀU - I|``
    below 6e-13.

    Example:
        >>> x = torch.randn(5, 12, dtype=torch.float64)
        >>> w, u = eigh_low_rank(x.T @ x)
        >>> tuple(u.shape), torch.allclose(u @ torch.diag(w) @ u.T, x.T @ x)
        ((12, 5), True)
    """
    import numpy as np
    from scipy.linalg import eigh, lapack

    a = factor.detach().double().cpu()
    with _blas_threads(1):
        c, piv, rank, info = lapack.dpstrf(a.numpy(), lower=1)
    if info < 0:  # pragma: no cover - LAPACK's argument check
        raise ValueError(f"dpstrf refused its argument {-info}.")
    r = int(rank)
    if r == 0:
        # A zero factor (an expert no token was routed to): the full basis, all zeros.
        return eigh_float64(a)
    # P_ᵀ A P = L Lᵀ with P's column k the unit vector piv[k]: A = (P L)(P L)ᵀ.
    lower = torch.from_numpy(np.tril(c[:, :r]))
    f = torch.empty_like(lower)
    f[torch.from_numpy(piv.astype(np.int64) - 1)] = lower
    with _blas_threads(1):
        w_np, v_np = eigh((f.T @ f).numpy(), driver="evd", check_finite=True)
    w, v = torch.from_numpy(w_np), torch.from_numpy(v_np)
    w_max = float(w[-1])
    keep = w > r * torch.finfo(torch.float64).eps * w_max
    w, v = w[keep], v[:, keep]
    u = (f @ v) * w.rsqrt()
    small = int((w < 1e-6 * w_max).sum())  # ascending: the first `small` columns
    if small:
        s, big = u[:, :small], u[:, small:]
        for _ in range(2):  # Gram-Schmidt twice is enough (Giraud et al., 2005)
            s = s - big @ (big.T @ s)
        s = torch.linalg.qr(s).Q
        # Rayleigh-Ritz in the span: the pairs of A restricted to it.
        w_s, rot = torch.linalg.eigh(s.T @ (a @ s))
        u = torch.cat([s @ rot, big], dim=1)
        w = torch.cat([w_s.clamp_min(0), w[small:]])
    return w, u


@contextlib.contextmanager
def _one_cpu_thread(device: torch.device) -> Iterator[None]:
    """Torch on one intra-op thread while a CPU ``eigh`` runs.

    A layer factor's ``eigh`` gains nothing from threads at these sizes, and
    the threaded LAPACK spins when the cores are shared: d = 257 took 0.1-6 s
    on 2 threads of a loaded 2-core machine against 14 ms on one.
    """
    with torch_threads(1) if device.type == "cpu" else contextlib.nullcontext():
        yield


@dataclass
class KroneckerEigenbasis:
    """One layer's Kronecker eigenbasis and the curvature's eigenvalues in it: rotates and solves.

    The curvature is ``F = (Q_S ⊗ Q_A) diag(Λ) (Q_S ⊗ Q_A)ᵀ`` with ``Λ`` the
    ``eigenvalues`` (K-FAC's ``s_i α_j``, or EK-FAC's corrected ones), so every
    use is one of the maps here, as curvlinops' operators give ``F``'s products
    from their factors: :meth:`rotate` (factors ``a``, ``g`` to rotated
    per-example gradients), :meth:`rotate_rows` / :meth:`unrotate_rows`
    (stored ``vec(G)`` rows), :meth:`solve` (``(F + λI)⁻¹``) and
    :meth:`solve_rotated` (``Λ⁻¹`` in the basis, for rows kept rotated).

    It unpacks as ``q_a, q_s, eigenvalues`` (the arrays a store keeps).

    A factor of rank ``r < d`` may keep only its range, ``q_a [d_in, r_a]``
    (see :meth:`KroneckerFactors.eigen`): the rotated gradients are then
    ``[r_s * r_a]`` and the directions left out have eigenvalue 0 (K-FAC's
    ``s_i α_j`` and EK-FAC's mean square alike, since every training
    gradient ``sum_t g_t a_tᵀ`` lies in the factors' ranges), so
    ``(F + λI)⁻¹ = P diag(1 / (Λ + λ)) Pᵀ + (I - P Pᵀ) / λ`` with
    ``P = Q_S ⊗ Q_A``: :meth:`solve` adds the second term, and scores against
    training rows in the basis need only the first.

    Attributes:
        q_a: ``[d_in, r_a]`` eigenvectors of ``A`` (``r_a = d_in`` unless reduced).
        q_s: ``[d_out, r_s]`` eigenvectors of ``S``.
        eigenvalues: ``[r_s * r_a]`` the curvature's eigenvalues in ``rotate``'s order.
    """

    q_a: Tensor
    q_s: Tensor
    eigenvalues: Tensor

    def __iter__(self) -> Iterator[Tensor]:
        return iter((self.q_a, self.q_s, self.eigenvalues))

    def to(self, device: torch.device | str) -> KroneckerEigenbasis:
        """The same basis with its tensors on ``device``."""
        return KroneckerEigenbasis(
            self.q_a.to(device), self.q_s.to(device), self.eigenvalues.to(device)
        )

    @property
    def size(self) -> int:
        """``d_out * d_in``: the layer's gradient width (the curvature's order)."""
        return int(self.q_s.shape[0] * self.q_a.shape[0])

    @property
    def reduced(self) -> bool:
        """Whether a factor's basis keeps only its range (fewer columns than rows)."""
        return self.q_a.shape[1] < self.q_a.shape[0] or self.q_s.shape[1] < self.q_s.shape[0]

    def damping(self, damping: float | str, *, fraction: float | None = None) -> float:
        """λ, with ``"auto"`` at ``fraction`` of the mean over all ``size`` eigenvalues."""
        return resolve_damping(damping, self.eigenvalues, fraction=fraction, size=self.size)

    def rotate_factors(self, a: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
        """``(a Q_A, g Q_S)`` in the factors' dtypes; ``Q_Sᵀ G Q_A`` is their ``sum_t``."""
        return a @ self.q_a.to(a.dtype), g @ self.q_s.to(g.dtype)

    def rotate(self, a: Tensor, g: Tensor, *, dtype: torch.dtype | None = None) -> Tensor:
        """Per-example gradients in the eigenbasis, ``vec(Q_Sᵀ G_n Q_A)``, ``[B, r_s * r_a]``.

        Computed as ``(g Q_S)ᵀ (a Q_A)`` per example, so ``G_n`` itself is never
        formed in the original basis.
        """
        dtype = dtype or a.dtype
        ar, gr = self.rotate_factors(a.to(dtype), g.to(dtype))
        return torch.bmm(gr.transpose(1, 2), ar).reshape(a.shape[0], -1)

    def rotate_rows(self, rows: Tensor) -> Tensor:
        """Stored ``vec(G)`` rows ``[B, d_out * d_in]`` in the eigenbasis: ``[B, r_s * r_a]``.

        One GEMM over all rows for ``G Q_A``, then ``Q_Sᵀ`` broadcast over the
        rows (no transposed copy), in the rows' dtype.
        """
        b, (d_in, r_a), d_out = rows.shape[0], self.q_a.shape, self.q_s.shape[0]
        right = (rows.reshape(b * d_out, d_in) @ self.q_a.to(rows.dtype)).reshape(b, d_out, r_a)
        return torch.matmul(self.q_s.to(rows.dtype).T, right).reshape(b, -1)

    def unrotate_rows(self, rotated: Tensor) -> Tensor:
        """Inverse of :meth:`rotate_rows`: ``vec(Q_S G' Q_Aᵀ)``, ``[B, d_out * d_in]``.

        For a reduced basis, the map back from its range (``P`` of the class docstring).
        """
        r_a, r_s = self.q_a.shape[1], self.q_s.shape[1]
        q_a, q_s = self.q_a.to(rotated.dtype), self.q_s.to(rotated.dtype)
        out = q_s @ rotated.reshape(-1, r_s, r_a) @ q_a.T
        return out.reshape(*rotated.shape[:-1], self.size)

    def solve_rotated(self, rows: Tensor, damping: float | str) -> Tensor:
        """``(Λ + λ)⁻¹ vec(Q_Sᵀ G Q_A)`` of each row, in the rows' dtype (not rotated back)."""
        scale = damped_reciprocal(self.eigenvalues, self.damping(damping))
        return self.rotate_rows(rows) * scale.to(rows.dtype)

    def solve(
        self, rows: Tensor, damping: float | str, *, work: torch.dtype = torch.float64
    ) -> Tensor:
        """``(F + λI)⁻¹ vec(G)`` of each row (computed in ``work``, returned in the rows' dtype).

        A reduced basis adds ``(I - P Pᵀ) vec(G) / λ``, the part outside its
        range (0 for λ = 0: the pseudo-inverse).
        """
        lam = self.damping(damping)
        x = rows.to(work)
        rotated = self.rotate_rows(x)
        if not self.reduced or lam == 0:
            scale = damped_reciprocal(self.eigenvalues, lam).to(work)
            return self.unrotate_rows(rotated * scale).to(rows.dtype)
        # P D Pᵀ x + (x - P Pᵀ x) / λ = x / λ + P (D - 1/λ) Pᵀ x
        scale = (damped_reciprocal(self.eigenvalues, lam) - 1.0 / lam).to(work)
        return (x / lam + self.unrotate_rows(rotated * scale)).to(rows.dtype)

    def rank_one_squares(self, a: Tensor, g: Tensor) -> Tensor:
        """``sum_n (Q_Sᵀ g_n)² ⊗ (Q_Aᵀ a_n)²``, ``[r_s * r_a]`` float64, for ``G_n = g_n a_nᵀ``.

        The sum of :meth:`rotate`'s squares when each example has one position,
        as one GEMM: ``k_in + k_out`` numbers per example instead of ``k_out k_in``.

        Args:
            a: ``[N, d_in]`` inputs.
            g: ``[N, d_out]`` output gradients (weighted as the Fisher's rows are).
        """
        ar, gr = self.rotate_factors(a, g)
        return ((gr * gr).T @ (ar * ar)).reshape(-1).double()

    def rotated_squares(self, a: Tensor, g: Tensor) -> Tensor:
        """``sum_n vec(Q_Sᵀ G_n Q_A)²``, ``[r_s * r_a]`` float64, for ``a [N, T, d_in]``."""
        if a.shape[1] == 1:
            return self.rank_one_squares(a[:, 0], g[:, 0])
        rotated = self.rotate(a, g)
        return (rotated * rotated).sum(0, dtype=torch.float64)


@dataclass
class KroneckerEigen(KroneckerEigenbasis):
    """The eigendecompositions ``A = Q_A diag(α) Q_Aᵀ``, ``S = Q_S diag(s) Q_Sᵀ``.

    A :class:`KroneckerEigenbasis` whose eigenvalues are K-FAC's ``s_i α_j``.
    """

    eigenvalues: Tensor = field(init=False)
    alpha: Tensor = field(kw_only=True)
    s: Tensor = field(kw_only=True)

    def __post_init__(self) -> None:
        self.eigenvalues = self.kfac_eigenvalues()

    def kfac_eigenvalues(self) -> Tensor:
        """``[r_s * r_a]`` K-FAC eigenvalues ``s_i α_j`` in ``rotate``'s order."""
        return torch.outer(self.s, self.alpha).reshape(-1)

    def precondition(self, rows: Tensor, eigenvalues: Tensor, damping: float | str) -> Tensor:
        """``(F + λI)⁻¹ vec(G)`` of each row with the eigenvalues ``eigenvalues`` (float64)."""
        return KroneckerEigenbasis(self.q_a, self.q_s, eigenvalues).solve(rows, damping)


def ekfac_eigenvalues(rotated: Tensor) -> Tensor:
    """EK-FAC's corrected eigenvalues: the mean over examples of ``rotated ** 2``.

    Args:
        rotated: ``[N, d]`` per-example gradients in the Kronecker eigenbasis.

    Returns:
        ``[d]`` float64: the diagonal of ``F`` in that basis.
    """
    r = rotated.double()
    return (r * r).mean(0)


def check_damping_fraction(fraction: object) -> float:
    """``fraction`` as a float, or a ``ValueError`` naming ``damping_fraction``.

    Raises:
        ValueError: ``fraction`` is not a finite number > 0.
    """
    ok = isinstance(fraction, (int, float)) and not isinstance(fraction, bool)
    if not ok or not math.isfinite(float(fraction)) or float(fraction) <= 0:  # type: ignore[arg-type]
        raise ValueError(
            f"`damping_fraction` must be a finite number > 0 (the fraction of each layer's mean "
            f"eigenvalue that lambda_reg='auto' damps with), got {fraction!r}; pass e.g. "
            f"{LAYER_AUTO_DAMPING_FRACTION} (gradsketch's default) or 0.1 (Kronfluence's "
            "heuristic)."
        )
    return float(fraction)  # type: ignore[arg-type]


def resolve_damping(
    damping: float | str,
    eigenvalues: Tensor,
    *,
    fraction: float | None = None,
    size: int | None = None,
) -> float:
    """``"auto"`` is ``fraction`` times the layer's mean eigenvalue.

    ``fraction=None`` reads :data:`LAYER_AUTO_DAMPING_FRACTION` (0.3). ``size``:
    the number of eigenvalues the mean is over, where ``eigenvalues`` leaves out
    zeros (a reduced basis); ``None``: ``len(eigenvalues)``.
    """
    if isinstance(damping, str):
        if damping != "auto":
            raise ValueError(f"`damping` must be a number >= 0 or 'auto', got {damping!r}.")
        share = LAYER_AUTO_DAMPING_FRACTION if fraction is None else fraction
        if size is None:
            return share * float(eigenvalues.double().mean())
        return share * float(eigenvalues.double().sum()) / max(size, 1)
    if not damping >= 0:
        raise ValueError(f"`damping` must be a number >= 0 or 'auto', got {damping!r}.")
    return float(damping)


def damped_reciprocal(eigenvalues: Tensor, damping: float | str) -> Tensor:
    """``1 / (λ_i + damping)`` in float64, ``0`` where both are zero (a pseudo-inverse).

    A direction without curvature and without damping (an expert no training
    example was routed to, ``lambda_reg=0``) carries no training gradient;
    it adds nothing to scores, where ``1 / 0`` would make them NaN.
    """
    damped = eigenvalues.double() + resolve_damping(damping, eigenvalues)
    return torch.where(damped == 0, 0.0, 1.0 / damped)


def influence(
    train: Tensor, query: Tensor, eigenvalues: Tensor, *, damping: float | str = "auto"
) -> Tensor:
    """``g_queryᵀ (F + λI)⁻¹ g_train`` for every pair, in the Kronecker eigenbasis.

    Args:
        train: ``[N, d]`` rotated training gradients.
        query: ``[M, d]`` rotated query gradients.
        eigenvalues: ``[d]`` the curvature's eigenvalues (K-FAC's ``s_i α_j`` or
            EK-FAC's corrected ones).
        damping: λ, or ``"auto"``.

    Returns:
        ``[N, M]`` scores in ``train``'s dtype.
    """
    scale = damped_reciprocal(eigenvalues, damping)
    return train @ (query.double() * scale).to(train.dtype).T
