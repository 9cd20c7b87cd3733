"""Low-rank factorization of a linear map from its inputs and outputs.

Composer-compatible ``LowRankSolution`` / ``factorize_matrix`` /
``factorize_conv2d``. The problem is reduced-rank regression (Izenman 1975):

    minimise ``||Y - (X @ Wa @ Wb + bias)||_F²`` over ``Wa [D, k]``, ``Wb [k, M]``, ``bias [M]``.

Everything is computed from the centred moments ``XᵀX`` and ``XᵀY`` in
float64, i.e. in the R-factor space of ``X`` (``XᵀX = RᵀR``), so each least
squares solve is ``D``-sized no matter how many rows ``X`` has.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from gradsketch._checks import nonnegative_int
from gradsketch.factorize._linalg import (
    SVD_METHODS,
    RFactor,
    SvdMethod,
    balance,
    small_solve,
    top_right_singular_vectors,
    truncated_svd,
)

__all__ = ["INITS", "LowRankSolution", "factorize_conv2d", "factorize_matrix"]

InitMethod = Literal["whitened", "weights"]
INITS: tuple[str, ...] = ("whitened", "weights")
_CONV_KWARGS = ("stride", "padding", "dilation", "groups", "padding_mode")


@dataclasses.dataclass
class LowRankSolution:
    """A low-rank pair ``(Wa, Wb)`` plus output bias approximating one linear map.

    The first factor maps inputs to a ``rank``-dimensional latent space, the
    second maps that space to the outputs: ``y ≈ x @ Wa @ Wb + bias``. For a
    convolution ``Wa`` is a ``[rank, in_channels, kh, kw]`` kernel and ``Wb`` a
    ``[out_channels, rank, 1, 1]`` kernel.

    Attributes:
        Wa: first factor, ``[D, rank]`` (matrix) or ``[rank, C, kh, kw]``
            (conv); the whole map ``[D, M]`` / ``[M, C, kh, kw]`` when
            ``rank == -1`` and ``Wb`` is ``None``.
        Wb: second factor ``[rank, M]`` / ``[M, rank, 1, 1]``, or ``None``.
        bias: ``[M]`` vector added to the output, or ``None``.
        rank: latent size; ``-1`` when factorizing would not have helped
            and the solution is a single matrix or the unchanged factors.
        nmse: normalised mean squared error of *this* solution on the data it
            was fitted to: ``mean((Y - Ŷ)²) / var(Y)``, with ``Ŷ`` including
            ``bias`` and ``var`` over all entries of ``Y`` (unbiased). 0 is
            exact, 1 is no better than predicting the mean. Unlike Composer,
            whose reported value subtracts a given bias from the target but
            adds it back to the prediction, this is the true error.

    Example:
        >>> import torch
        >>> sol = LowRankSolution(torch.ones(4, 2), torch.ones(2, 3), torch.zeros(3), rank=2)
        >>> (sol.Wa @ sol.Wb).shape
        torch.Size([4, 3])
    """

    Wa: Tensor | None = None
    Wb: Tensor | None = None
    bias: Tensor | None = None
    rank: int = -1
    nmse: float = 0.0


def _fmt_shape(t: Tensor | None) -> str:
    return "None" if t is None else str(list(t.shape))


def resolve_rank(rank: int | float, fraction_of: int, cap: int, *, name: str = "rank") -> int:
    """Turn an int or a fraction in ``(0, 1)`` into an integer latent size.

    A fraction is taken of ``fraction_of`` and capped at ``cap`` (as in
    Composer), with a minimum of 1.
    """
    if isinstance(rank, bool) or not isinstance(rank, numbers.Real):
        raise TypeError(
            f"`{name}` must be an int >= 1 or a float in (0, 1); got {rank!r} "
            f"of type {type(rank).__name__}."
        )
    if not math.isfinite(rank) or rank <= 0:
        raise ValueError(
            f"`{name}` must be an int >= 1 or a float in (0, 1); got {rank!r}. "
            "Pass a positive latent size or a fraction of the input size."
        )
    rank = float(rank) if not isinstance(rank, numbers.Integral) else int(rank)
    if rank < 1:
        return max(1, min(int(rank * fraction_of), cap))
    if rank != int(rank):
        raise ValueError(
            f"`{name}` must be an int >= 1 or a float in (0, 1); got {rank!r}. "
            f"Round it (e.g. {int(rank)}) or pass a fraction."
        )
    return int(rank)


def _check_choice(value: str, allowed: Sequence[str], name: str) -> None:
    if value not in allowed:
        raise ValueError(f"`{name}` must be one of {list(allowed)}; got {value!r}.")


def _work_dtype(x: Tensor) -> torch.dtype:
    return x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32


def _nmse(y: Tensor, y_hat: Tensor) -> float:
    mse = float((y - y_hat).square().mean())
    var = float(y.var()) if y.numel() > 1 else 0.0
    if var > 0.0:
        return mse / var
    return 0.0 if mse == 0.0 else math.inf


class _RSpace:
    """The weighted problem in the R-factor space of the centred inputs.

    With ``XcᵀXc = RᵀR`` and ``Z = R⁺ᵀ XcᵀYc`` (which equals ``QᵀYc`` for the
    thin QR ``Xc = QR``), ``||Yc - Xc W||² = ||Z - R W||² + const`` for every
    ``W``; all solves below are ``D``-sized. ``XcᵀXc`` and ``XcᵀYc`` are the
    only two ``N``-row products, accumulated in the working dtype and kept in
    float64.
    """

    def __init__(self, x: Tensor, y: Tensor, *, center: bool) -> None:
        if center:
            x = x - x.mean(dim=0)
            y = y - y.mean(dim=0)
        eps = torch.finfo(x.dtype).eps
        self.work = x.dtype
        self.n_in = x.shape[1]
        self.active: Tensor | None = None
        cross = (x.T @ y).double()
        if x.shape[0] < x.shape[1]:
            self.r = RFactor.from_rows(x, eps)
        else:
            gram = (x.T @ x).double()
            # Constant features (dead units, padding) carry nothing; dropping
            # them keeps the Gram matrix positive definite.
            diag = gram.diagonal()
            active = diag > diag.max() * eps * eps
            if not bool(active.all()):
                self.active = active
                gram, cross = gram[active][:, active], cross[active]
            self.r = RFactor(gram, eps)
        self.z = self.r.solve_transposed(cross)  # [rank(R), M]
        self._w_star: Tensor | None = None

    def _expand(self, w: Tensor) -> Tensor:
        """Rows of the active features -> all ``D`` rows (zeros for constant features)."""
        if self.active is None:
            return w
        full = w.new_zeros(self.n_in, w.shape[1])
        full[self.active] = w
        return full

    def _restrict(self, w: Tensor) -> Tensor:
        return w if self.active is None else w[self.active]

    @property
    def w_star(self) -> Tensor:
        """Unconstrained least-squares solution ``R⁺ Z`` (least-norm), ``[D, M]``."""
        if self._w_star is None:
            self._w_star = self._expand(self.r.solve(self.z))
        return self._w_star

    def whitened_start(self, k: int, *, method: str, seed: int) -> tuple[Tensor, Tensor, bool]:
        """Rank-``k`` start from the top right singular vectors of ``Z``.

        ``Wa Wb = R⁺ Z V_k V_kᵀ`` is the reduced-rank regression optimum; the
        flag says whether it is exact (full eigen-decomposition).
        """
        # Only the leading subspace is needed and the optimum is stationary in
        # it, so the decomposition runs in the working dtype (float32 halves
        # its cost); the solves around it stay in float64.
        vecs, exact = top_right_singular_vectors(self.z.to(self.work), k, method=method, seed=seed)
        vecs = vecs.double()
        return self._expand(self.r.solve(self.z @ vecs)), vecs.T.contiguous(), exact

    def update_wb(self, wa: Tensor) -> Tensor:
        """Exact minimiser over ``Wb`` for fixed ``Wa``: least squares of ``Z`` on ``R Wa``."""
        a = self.r.apply(self._restrict(wa))
        return small_solve(a.T @ a, a.T @ self.z)

    def update_wa(self, wb: Tensor) -> Tensor:
        """Exact minimiser over ``Wa`` for fixed ``Wb``: ``Wa = W* Wbᵀ (Wb Wbᵀ)⁻¹``.

        The weighting by ``R`` drops out of this half-step because the
        residual ``Z - R W*`` is orthogonal to the range of ``R``.
        """
        return small_solve(wb @ wb.T, wb @ self.w_star.T).T


def _check_matrix_args(
    X: Tensor, Y: Tensor, Wa: Tensor, Wb: Tensor | None, bias: Tensor | None, n_iters: int
) -> None:
    for name, t in (("X", X), ("Y", Y), ("Wa", Wa)):
        if not isinstance(t, Tensor) or t.ndim != 2:
            shape = _fmt_shape(t) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"`{name}` must be a 2-D tensor; got {shape}.")
    if X.shape[0] != Y.shape[0]:
        raise ValueError(
            f"`X` and `Y` must have the same number of rows; got X {_fmt_shape(X)} and "
            f"Y {_fmt_shape(Y)}. Y should be the layer's output on X."
        )
    if X.shape[0] < 2:
        raise ValueError(f"`X` needs at least 2 rows to measure an error; got {_fmt_shape(X)}.")
    if Wa.shape[0] != X.shape[1]:
        raise ValueError(
            f"`Wa` must have X.shape[1]={X.shape[1]} rows; got Wa {_fmt_shape(Wa)}. "
            "Pass the weight as [in_features, out_features] (i.e. linear.weight.T)."
        )
    out = Wa.shape[1] if Wb is None else Wb.shape[1]
    if Wb is not None and (Wb.ndim != 2 or Wb.shape[0] != Wa.shape[1]):
        raise ValueError(
            f"`Wb` must be [Wa.shape[1], M] = [{Wa.shape[1]}, M]; got {_fmt_shape(Wb)}."
        )
    if out != Y.shape[1]:
        raise ValueError(
            f"the weights map to {out} outputs but `Y` has {Y.shape[1]} columns "
            f"(Wa {_fmt_shape(Wa)}, Wb {_fmt_shape(Wb)}, Y {_fmt_shape(Y)})."
        )
    if bias is not None and tuple(bias.shape) != (Y.shape[1],):
        raise ValueError(f"`bias` must have shape [{Y.shape[1]}]; got {_fmt_shape(bias)}.")
    nonnegative_int("n_iters", n_iters, fix="pass 0 for the SVD start alone")


def _finish(
    x: Tensor,
    y: Tensor,
    wa: Tensor,
    wb: Tensor | None,
    *,
    fit_bias: bool,
    bias: Tensor | None,
    rank: int,
) -> LowRankSolution:
    """Refit the bias for the returned factors and measure their true nmse."""
    pred = x @ wa if wb is None else (x @ wa) @ wb
    if fit_bias:
        new_bias: Tensor | None = (y - pred).mean(dim=0)
    else:
        new_bias = bias
    if new_bias is not None:
        pred = pred + new_bias
    return LowRankSolution(Wa=wa, Wb=wb, bias=new_bias, rank=rank, nmse=_nmse(y, pred))


def factorize_matrix(
    X: Tensor,
    Y: Tensor,
    Wa: Tensor,
    Wb: Tensor | None = None,
    bias: Tensor | None = None,
    rank: int | float = 0.25,
    n_iters: int = 3,
    *,
    fit_bias: bool = True,
    init: InitMethod = "whitened",
    svd: SvdMethod = "auto",
    seed: int = 0,
) -> LowRankSolution:
    """Approximate a linear map by a rank-``rank`` pair fitted on its inputs.

    Chooses ``Wa [D, k]``, ``Wb [k, M]`` and ``bias [M]`` minimising
    ``||Y - (X @ Wa @ Wb + bias)||_F²`` where ``Y = X @ W + b`` are the
    original outputs. ``W`` is given either as one matrix ``Wa [D, M]`` or,
    to lower the rank of an already factorized map, as ``Wa [D, d] @ Wb [d, M]``.

    Starts from an SVD, then runs ``n_iters`` sweeps of alternating least
    squares (each half-step exact, so the error never increases). The default
    ``init="whitened"`` takes the SVD in the X-weighted (R-factor) space,
    which is already the reduced-rank regression optimum (Izenman 1975);
    ``init="weights"`` takes Composer's truncated SVD of ``W`` alone, and the
    sweeps then improve on it exactly as Composer's do. Randomized SVD is
    used when ``k`` is far below the dimensions (``svd="auto"``).

    Conventions from Composer: a fractional ``rank`` is a fraction of ``D``
    (capped at the current rank); a ``rank`` at or above ``D`` or ``M``
    returns the least-squares single matrix with ``rank=-1`` and ``Wb=None``;
    a ``rank`` at or above the current rank of a given pair returns the pair
    unchanged with ``rank=-1``.

    Args:
        X: inputs, ``[N, D]``.
        Y: outputs of the original map on ``X``, ``[N, M]`` (bias included).
        Wa: the map ``[D, M]``, or its first factor ``[D, d]`` if ``Wb`` is given.
        Wb: second factor ``[d, M]`` of an already factorized map, or ``None``.
        bias: the ``[M]`` bias contained in ``Y``. With ``fit_bias=True`` it
            is re-estimated jointly with the factors, so it only documents the
            input; with ``fit_bias=False`` it is held fixed and returned.
        rank: latent size ``k``: an int >= 1 or a fraction of ``D`` in (0, 1).
        n_iters: alternating least-squares sweeps, >= 0. An exact whitened
            start is already optimal, so sweeps only run after
            ``init="weights"`` or a randomized start.
        fit_bias: fit the output bias jointly (centred data). ``False`` keeps
            ``bias`` (possibly ``None``) fixed, for maps without a bias.
        init: ``"whitened"`` or ``"weights"`` (Composer's start).
        svd: ``"auto"``, ``"full"`` or ``"randomized"``.
        seed: seed of the randomized SVD's test matrix.

    Returns:
        A :class:`LowRankSolution` whose ``nmse`` is the true normalised error
        of the returned ``Wa``, ``Wb`` and ``bias`` on ``(X, Y)``. (Composer
        subtracts a given ``bias`` from the target but adds it back to the
        prediction, so its reported nmse is not the error of its solution.)

    Raises:
        ValueError: on inconsistent shapes, a bad ``rank``, ``n_iters``,
            ``init`` or ``svd``.
        TypeError: if ``rank`` is not a number.

    Example:
        >>> import torch
        >>> X = torch.randn(256, 16, dtype=torch.float64)
        >>> W = torch.randn(16, 4, dtype=torch.float64) @ torch.randn(4, 12, dtype=torch.float64)
        >>> sol = factorize_matrix(X, X @ W, W, rank=4)
        >>> sol.Wa.shape, sol.Wb.shape, sol.nmse < 1e-20
        (torch.Size([16, 4]), torch.Size([4, 12]), True)
    """
    _check_matrix_args(X, Y, Wa, Wb, bias, n_iters)
    _check_choice(init, INITS, "init")
    _check_choice(svd, SVD_METHODS, "svd")
    work = _work_dtype(X)
    x = X.detach().to(work)
    y = Y.detach().to(work)
    wa_in = Wa.detach().to(work)
    wb_in = None if Wb is None else Wb.detach().to(work)
    fixed_bias = None if bias is None else bias.detach().to(work)
    n_in, n_out = x.shape[1], y.shape[1]
    k = resolve_rank(rank, n_in, wa_in.shape[1])
    target = y if fit_bias or fixed_bias is None else y - fixed_bias

    if wb_in is not None and k >= wa_in.shape[1] and k < min(n_in, n_out):
        return _finish(x, y, wa_in, wb_in, fit_bias=fit_bias, bias=fixed_bias, rank=-1)

    space = _RSpace(x, target, center=fit_bias)
    if k >= n_in or k >= n_out:
        w = space.w_star.to(work)
        return _finish(x, y, w, None, fit_bias=fit_bias, bias=fixed_bias, rank=-1)

    if init == "whitened":
        wa, wb, exact = space.whitened_start(k, method=svd, seed=seed)
    else:
        w0 = wa_in.double() if wb_in is None else wa_in.double() @ wb_in.double()
        u, s, vh = truncated_svd(w0, k, method=svd, seed=seed)
        wa, wb, exact = u * s.sqrt(), s.sqrt()[:, None] * vh, False
    # An exact whitened start is the global optimum: sweeps cannot improve it.
    for _ in range(0 if exact else n_iters):
        wb = space.update_wb(wa)
        wa = space.update_wa(wb)
    wa, wb = balance(wa, wb)
    return _finish(x, y, wa.to(work), wb.to(work), fit_bias=fit_bias, bias=fixed_bias, rank=k)


def _pair(v: Any, name: str) -> tuple[int, int]:
    if isinstance(v, int) and not isinstance(v, bool):
        return (v, v)
    if isinstance(v, Sequence) and len(v) == 2 and all(isinstance(i, int) for i in v):
        return (int(v[0]), int(v[1]))
    raise ValueError(f"`{name}` must be an int or a pair of ints; got {v!r}.")


def conv_inputs_to_matrix(
    x: Tensor,
    kernel_size: Sequence[int],
    *,
    stride: Any = 1,
    padding: Any = 0,
    dilation: Any = 1,
    groups: int = 1,
    padding_mode: str = "zeros",
) -> Tensor:
    """Unfold conv inputs into the rows the convolution multiplies by its weight.

    Returns the ``[N * L, C * kh * kw]`` matrix of receptive fields at the
    ``L`` output positions the convolution actually computes (its own stride
    and dilation, so strided convolutions are fitted on exactly their outputs).
    """
    if groups != 1:
        raise NotImplementedError(
            f"`groups` must be 1 to factorize a convolution; got groups={groups}. "
            "Grouped convolutions are left unfactorized."
        )
    kh, kw = _pair(tuple(kernel_size), "kernel_size")
    sh, sw = _pair(stride, "stride")
    dh, dw = _pair(dilation, "dilation")
    if isinstance(padding, str):
        if padding == "valid":
            pads = (0, 0, 0, 0)
        elif padding == "same":
            th, tw = dh * (kh - 1), dw * (kw - 1)
            pads = (tw // 2, tw - tw // 2, th // 2, th - th // 2)
        else:
            raise ValueError(
                f"`padding` must be 'same', 'valid', an int or a pair; got {padding!r}."
            )
    else:
        ph, pw = _pair(padding, "padding")
        pads = (pw, pw, ph, ph)
    modes = ("zeros", "reflect", "replicate", "circular")
    if padding_mode not in modes:
        raise ValueError(f"`padding_mode` must be one of {list(modes)}; got {padding_mode!r}.")
    if x.ndim == 3:
        x = x.unsqueeze(0)
    if any(pads):
        mode = "constant" if padding_mode == "zeros" else padding_mode
        x = F.pad(x, pads, mode=mode)
    cols = F.unfold(x, (kh, kw), dilation=(dh, dw), stride=(sh, sw))
    return cols.transpose(1, 2).reshape(-1, cols.shape[1])


def _conv_weight_to_matrix(w: Tensor) -> Tensor:
    return w.reshape(w.shape[0], -1).T  # [fan_in, out_channels]


def _matrix_to_conv_weight(m: Tensor, kernel_size: Sequence[int]) -> Tensor:
    return m.T.reshape(m.shape[1], -1, *kernel_size).contiguous()


def factorize_conv2d(
    X: Tensor,
    Wa: Tensor,
    Wb: Tensor | None = None,
    rank: int | float = 0.25,
    biasA: Tensor | None = None,
    biasB: Tensor | None = None,
    n_iters: int = 3,
    *,
    fit_bias: bool = True,
    init: InitMethod = "whitened",
    svd: SvdMethod = "auto",
    seed: int = 0,
    **conv2d_kwargs: Any,
) -> LowRankSolution:
    """Approximate a ``kh x kw`` convolution by a narrower one followed by a ``1 x 1``.

    Returns ``Wa [k, C, kh, kw]`` (no bias, the original stride / padding /
    dilation), ``Wb [M, k, 1, 1]`` and ``bias [M]`` minimising the squared
    error of the outputs on ``X``: the convolution is unfolded into
    ``[N * L, C * kh * kw]`` receptive fields and passed to
    :func:`factorize_matrix`. Unlike Composer, strided (and dilated)
    convolutions are supported.

    Args:
        X: inputs ``[N, C, H, W]``.
        Wa: the kernel ``[M, C, kh, kw]``, or the first factor ``[d, C, kh, kw]``.
        Wb: second factor ``[M, d, 1, 1]`` of an already factorized conv, or ``None``.
        rank: latent channels: an int >= 1 or a fraction of ``C * kh * kw``.
        biasA: bias of the first conv (``[M]`` or ``[d]``), or ``None``.
        biasB: bias of the second conv (``[M]``); requires ``Wb``.
        n_iters: alternating least-squares sweeps, >= 0.
        fit_bias: fit the output bias (see :func:`factorize_matrix`).
        init: ``"whitened"`` or ``"weights"``.
        svd: ``"auto"``, ``"full"`` or ``"randomized"``.
        seed: seed of the randomized SVD.
        **conv2d_kwargs: the original conv's ``stride``, ``padding``,
            ``dilation``, ``groups`` (must be 1) and ``padding_mode``.

    Returns:
        A :class:`LowRankSolution` with conv-shaped factors and the true nmse.

    Raises:
        ValueError: on inconsistent shapes or unknown ``conv2d_kwargs``.
        RuntimeError: if ``biasB`` is given without ``Wb``.
        NotImplementedError: if ``groups != 1``.

    Example:
        >>> import torch
        >>> X = torch.randn(8, 6, 10, 10)
        >>> sol = factorize_conv2d(X, torch.randn(12, 6, 3, 3), rank=4, stride=2, padding=1)
        >>> sol.Wa.shape, sol.Wb.shape, sol.bias.shape
        (torch.Size([4, 6, 3, 3]), torch.Size([12, 4, 1, 1]), torch.Size([12]))
    """
    unknown = sorted(set(conv2d_kwargs) - set(_CONV_KWARGS))
    if unknown:
        raise ValueError(f"unknown `conv2d_kwargs` {unknown}; allowed: {list(_CONV_KWARGS)}.")
    if not isinstance(X, Tensor) or X.ndim not in (3, 4):
        raise ValueError(f"`X` must be a [N, C, H, W] tensor; got {_fmt_shape(X)}.")
    if not isinstance(Wa, Tensor) or Wa.ndim != 4:
        raise ValueError(f"`Wa` must be a [out, in, kh, kw] kernel; got {_fmt_shape(Wa)}.")
    channels = X.shape[-3]
    if Wa.shape[1] != channels:
        raise ValueError(
            f"`Wa` expects {Wa.shape[1]} input channels but `X` has {channels} "
            f"(X {_fmt_shape(X)}, Wa {_fmt_shape(Wa)})."
        )
    if Wb is None and biasB is not None:
        raise RuntimeError("got `biasB` but `Wb` is None; pass `Wb` or move the bias to `biasA`.")
    if Wb is not None and (Wb.ndim != 4 or tuple(Wb.shape[1:]) != (Wa.shape[0], 1, 1)):
        raise ValueError(f"`Wb` must be a [out, {Wa.shape[0]}, 1, 1] kernel; got {_fmt_shape(Wb)}.")
    kernel = tuple(Wa.shape[2:])
    work = _work_dtype(X)
    x_mat = conv_inputs_to_matrix(X.detach().to(work), kernel, **conv2d_kwargs)
    wa = _conv_weight_to_matrix(Wa.detach().to(work))
    y_mat = x_mat @ wa
    out_bias = None
    if biasA is not None:
        if tuple(biasA.shape) != (Wa.shape[0],):
            raise ValueError(f"`biasA` must have shape [{Wa.shape[0]}]; got {_fmt_shape(biasA)}.")
        out_bias = biasA.detach().to(work)
        y_mat = y_mat + out_bias
    wb = None
    if Wb is not None:
        wb = _conv_weight_to_matrix(Wb.detach().to(work))
        y_mat = y_mat @ wb
        out_bias = None if out_bias is None else out_bias @ wb
        if biasB is not None:
            if tuple(biasB.shape) != (Wb.shape[0],):
                raise ValueError(
                    f"`biasB` must have shape [{Wb.shape[0]}]; got {_fmt_shape(biasB)}."
                )
            b = biasB.detach().to(work)
            y_mat = y_mat + b
            out_bias = b if out_bias is None else out_bias + b
    sol = factorize_matrix(
        x_mat,
        y_mat,
        wa,
        wb,
        bias=out_bias,
        rank=rank,
        n_iters=n_iters,
        fit_bias=fit_bias,
        init=init,
        svd=svd,
        seed=seed,
    )
    assert sol.Wa is not None
    sol.Wa = _matrix_to_conv_weight(sol.Wa, kernel)
    if sol.Wb is not None:
        sol.Wb = _matrix_to_conv_weight(sol.Wb, (1, 1))
    return sol
