"""The per-token cross-entropy of :func:`~gradsketch.slt.per_token_loss`: one pass on CPU."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

from gradsketch.slt._fast import _native

__all__ = ["token_cross_entropy"]


def _xent_kernel(
    logits: torch.Tensor, targets: torch.Tensor, kernels: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, log-sum-exp)`` per row of ``[rows, vocab]`` logits."""
    rows, vocab = logits.shape
    loss = torch.empty(rows, dtype=logits.dtype)
    lse = torch.empty(rows, dtype=logits.dtype)
    kernels["xent"](
        logits.data_ptr(), targets.data_ptr(), loss.data_ptr(), lse.data_ptr(), rows, vocab
    )
    return loss, lse


class _NativeTokenCrossEntropy(torch.autograd.Function):
    """``gs_token_xent_f32``: per-row cross-entropy in one pass over the logits."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, kernels: Any) -> Any:
        loss, lse = _xent_kernel(logits, targets, kernels)
        _native.keep(ctx, kernels, logits, targets, lse)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        grad, (logits, targets, lse), kernels = _native.kept(ctx, grad)
        out = torch.empty_like(logits)
        kernels["xent_backward"](
            grad.data_ptr(), logits.data_ptr(), targets.data_ptr(), lse.data_ptr(),
            out.data_ptr(), *logits.shape,
        )  # fmt: skip
        return out, None, None


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``F.cross_entropy(logits, targets, reduction="none")`` with ``ignore_index=-100``.

    ``[rows, vocab]`` logits and int64 ``[rows]`` targets; one native pass on
    contiguous CPU float32 logits (log-sum-exp and the target's logit), torch's
    ``cross_entropy`` otherwise.

    Example:
        >>> logits = torch.randn(3, 5)
        >>> targets = torch.tensor([1, -100, 4])
        >>> want = F.cross_entropy(logits, targets, reduction="none")
        >>> torch.allclose(token_cross_entropy(logits, targets), want, atol=1e-6)
        True
    """
    kernels = _native.native_for(logits)
    if kernels is None or logits.dim() != 2 or targets.dtype != torch.int64:
        return F.cross_entropy(logits, targets, reduction="none")
    if not _native.tracked(logits):
        return _xent_kernel(logits, targets.contiguous(), kernels)[0]
    return _NativeTokenCrossEntropy.apply(logits, targets.contiguous(), kernels)  # type: ignore[no-any-return]
