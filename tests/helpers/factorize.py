"""Shared builders and float64 references for the factorize tests."""

from __future__ import annotations

import torch
from torch import Tensor


def low_rank(
    d: int, m: int, r: int, *, seed: int = 0, dtype: torch.dtype = torch.float64
) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(d, r, generator=gen, dtype=dtype)
    b = torch.randn(r, m, generator=gen, dtype=dtype)
    return a @ b / r**0.5


def decaying_inputs(n: int, d: int, *, seed: int = 0, dtype: torch.dtype = torch.float64) -> Tensor:
    """Rows with singular values ``1 / (1 + i/8)``, in a random basis, plus an offset."""
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    scale = 1.0 / (1.0 + torch.arange(d, dtype=torch.float64) / 8)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64) * scale @ q.T + 0.5
    return x.to(dtype)


def true_nmse(y: Tensor, y_hat: Tensor) -> float:
    return float((y - y_hat).square().mean() / y.var())


def predict(x: Tensor, wa: Tensor, wb: Tensor | None, bias: Tensor | None) -> Tensor:
    out = x @ wa if wb is None else x @ wa @ wb
    return out if bias is None else out + bias


def lstsq(a: Tensor, b: Tensor) -> Tensor:
    return torch.linalg.lstsq(a, b, driver="gelsd").solution


def reference_als(
    x: Tensor, y: Tensor, wa: Tensor, wb: Tensor, n_iters: int, *, fit_bias: bool = True
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Plain float64 alternating least squares on all N rows (Composer's scheme, centred)."""
    xc, yc = (x - x.mean(0), y - y.mean(0)) if fit_bias else (x, y)
    w_star = lstsq(xc, yc)
    for _ in range(n_iters):
        wb = lstsq(xc @ wa, yc)
        wa = lstsq(wb.T, w_star.T).T
    bias = (y - x @ wa @ wb).mean(0) if fit_bias else None
    return wa, wb, bias


def reference_rrr(x: Tensor, y: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Reduced-rank regression optimum with intercept: ``W* V_k V_kᵀ`` and its bias."""
    xc, yc = x - x.mean(0), y - y.mean(0)
    w_star = lstsq(xc, yc)
    _, _, vh = torch.linalg.svd(xc @ w_star, full_matrices=False)
    w = w_star @ vh[:k].T @ vh[:k]
    return w, (y - x @ w).mean(0)


def svd_start(w: Tensor, k: int) -> tuple[Tensor, Tensor]:
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    return u[:, :k] * s[:k].sqrt(), s[:k].sqrt()[:, None] * vh[:k]
