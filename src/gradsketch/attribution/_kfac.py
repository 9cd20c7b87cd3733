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
    "ekfac_eigenvalues",
    "influence",
    "resolve_damping",
]

#: Per-layer ``"auto"`` damping: this fraction of each layer's mean eigenvalue.
#: Chosen by LDS over five protocols (benchmarks/RESULTS.md, "Influence
#: defaults"): 0.3 has the best mean and the smallest worst regret of the sweep.
LAYER_AUTO_DAMPING_FRACTION = 0.3


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
    """

    a_sum: Tensor
    g_sum: Tensor
    tokens: int = 0
    examples: int = 0

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
        float32) and added to the sums in theirs (float64 by default).

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
        self.a_sum += (af.T @ af).to(self.a_sum.dtype)
        self.g_sum += (gf.T @ gf).to(self.g_sum.dtype)
        self.tokens += af.shape[0]
        self.examples += a.shape[0]

    def covariances(self) -> tuple[Tensor, Tensor]:
        """``(A, S)``: the mean over tokens of ``a aᵀ`` and over examples of ``sum_t g gᵀ``.

        A layer that saw no token in any batch (an expert no example was routed
        to) has ``A = 0``: its curvature is zero and only damping is left.
        """
        if self.examples == 0:
            raise ValueError("no batch was added: call `update` before `covariances`.")
        return self.a_sum / max(self.tokens, 1), self.g_sum / self.examples

    def eigen(self) -> KroneckerEigen:
        """The eigendecompositions of ``A`` and ``S`` (float64, :func:`eigh_float64`)."""
        a_cov, g_cov = self.covariances()
        with _one_cpu_thread(a_cov.device):
            alpha, q_a = eigh_float64(a_cov)
            s, q_s = eigh_float64(g_cov)
        return KroneckerEigen(q_a=q_a, alpha=alpha, q_s=q_s, s=s)


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

    Attributes:
        q_a: ``[d_in, d_in]`` eigenvectors of ``A``.
        q_s: ``[d_out, d_out]`` eigenvectors of ``S``.
        eigenvalues: ``[d_out * d_in]`` the curvature's eigenvalues in ``rotate``'s order.
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

    def rotate_factors(self, a: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
        """``(a Q_A, g Q_S)`` in the factors' dtypes; ``Q_Sᵀ G Q_A`` is their ``sum_t``."""
        return a @ self.q_a.to(a.dtype), g @ self.q_s.to(g.dtype)

    def rotate(self, a: Tensor, g: Tensor, *, dtype: torch.dtype | None = None) -> Tensor:
        """Per-example gradients in the eigenbasis, ``vec(Q_Sᵀ G_n Q_A)``, ``[B, d_out * d_in]``.

        Computed as ``(g Q_S)ᵀ (a Q_A)`` per example, so ``G_n`` itself is never
        formed in the original basis.
        """
        dtype = dtype or a.dtype
        ar, gr = self.rotate_factors(a.to(dtype), g.to(dtype))
        return torch.bmm(gr.transpose(1, 2), ar).reshape(a.shape[0], -1)

    def rotate_rows(self, rows: Tensor) -> Tensor:
        """Stored ``vec(G)`` rows ``[B, d_out * d_in]`` in the eigenbasis, ``vec(Q_Sᵀ G Q_A)``.

        One GEMM over all rows for ``G Q_A``, then ``Q_Sᵀ`` broadcast over the
        rows (no transposed copy), in the rows' dtype.
        """
        b, d_in, d_out = rows.shape[0], self.q_a.shape[0], self.q_s.shape[0]
        right = (rows.reshape(b * d_out, d_in) @ self.q_a.to(rows.dtype)).reshape(b, d_out, d_in)
        return torch.matmul(self.q_s.to(rows.dtype).T, right).reshape(b, -1)

    def unrotate_rows(self, rotated: Tensor) -> Tensor:
        """Inverse of :meth:`rotate_rows`: ``vec(Q_S G' Q_Aᵀ)``."""
        d_in, d_out = self.q_a.shape[0], self.q_s.shape[0]
        q_a, q_s = self.q_a.to(rotated.dtype), self.q_s.to(rotated.dtype)
        return (q_s @ rotated.reshape(-1, d_out, d_in) @ q_a.T).reshape(rotated.shape)

    def solve_rotated(self, rows: Tensor, damping: float | str) -> Tensor:
        """``(Λ + λ)⁻¹ vec(Q_Sᵀ G Q_A)`` of each row, in the rows' dtype (not rotated back)."""
        return self.rotate_rows(rows) * damped_reciprocal(self.eigenvalues, damping).to(rows.dtype)

    def solve(self, rows: Tensor, damping: float | str) -> Tensor:
        """``(F + λI)⁻¹ vec(G)`` of each row (computed in float64, returned in the rows' dtype)."""
        return self.unrotate_rows(self.solve_rotated(rows.double(), damping)).to(rows.dtype)

    def rank_one_squares(self, a: Tensor, g: Tensor) -> Tensor:
        """``sum_n (Q_Sᵀ g_n)² ⊗ (Q_Aᵀ a_n)²``, ``[d_out * d_in]`` float64, for ``G_n = g_n a_nᵀ``.

        The sum of :meth:`rotate`'s squares when each example has one position,
        as one GEMM: ``k_in + k_out`` numbers per example instead of ``k_out k_in``.

        Args:
            a: ``[N, d_in]`` inputs.
            g: ``[N, d_out]`` output gradients (weighted as the Fisher's rows are).
        """
        ar, gr = self.rotate_factors(a, g)
        return ((gr * gr).T @ (ar * ar)).reshape(-1).double()

    def rotated_squares(self, a: Tensor, g: Tensor) -> Tensor:
        """``sum_n vec(Q_Sᵀ G_n Q_A)²``, ``[d_out * d_in]`` float64, for ``a [N, T, d_in]``."""
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
        """``[d_out * d_in]`` K-FAC eigenvalues ``s_i α_j`` in ``rotate``'s order."""
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
    damping: float | str, eigenvalues: Tensor, *, fraction: float | None = None
) -> float:
    """``"auto"`` is ``fraction`` times the layer's mean eigenvalue.

    ``fraction=None`` reads :data:`LAYER_AUTO_DAMPING_FRACTION` (0.3).
    """
    if isinstance(damping, str):
        if damping != "auto":
            raise ValueError(f"`damping` must be a number >= 0 or 'auto', got {damping!r}.")
        share = LAYER_AUTO_DAMPING_FRACTION if fraction is None else fraction
        return share * float(eigenvalues.double().mean())
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
