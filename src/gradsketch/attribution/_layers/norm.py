"""Normalization layers: elementwise scale (and shift) of a recomputed normalized input."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradsketch.attribution._layers._registry import register_grad_sampler


@register_grad_sampler(nn.LayerNorm)
def layer_norm_grad_sample(
    module: nn.Module, inputs: tuple[Any, ...], grad_output: Tensor
) -> dict[str, Tensor]:
    """``dw[b] = sum_t g_t * x_hat_t``, ``db[b] = sum_t g_t`` with ``x_hat`` recomputed."""
    assert isinstance(module, nn.LayerNorm)
    x = inputs[0]
    shape = tuple(module.normalized_shape)
    x_hat = F.layer_norm(x, shape, eps=module.eps).to(grad_output.dtype)
    batch = x.shape[0]
    out: dict[str, Tensor] = {}
    if module.weight is not None:
        out["weight"] = (grad_output * x_hat).reshape(batch, -1, *shape).sum(1)
    if module.bias is not None:
        out["bias"] = grad_output.reshape(batch, -1, *shape).sum(1)
    return out


@register_grad_sampler(nn.RMSNorm)
def elementwise_scale_grad_sample(
    module: nn.Module, inputs: tuple[Any, ...], grad_output: Tensor
) -> dict[str, Tensor]:
    """``dw[b] = sum_t g_t * n(x_t)`` for ``y = c(x) + w * n(x)`` (RMSNorm and its variants).

    ``n(x) = y(w=1) - y(w=0)``: two calls of the module itself, so every
    variant's own normalization, epsilon and dtype casts are kept (``w * n``
    as in Llama, ``(1 + w) * n`` as in Gemma) without a formula per class.
    Register other weight-only elementwise-scale norms with
    ``register_grad_sampler(MyNorm)(elementwise_scale_grad_sample)``.

    Example:
        >>> norm = torch.nn.RMSNorm(4)
        >>> x, g = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
        >>> rule = elementwise_scale_grad_sample(norm, (x,), g)["weight"]
        >>> ref = (g * torch.nn.functional.rms_norm(x, (4,))).sum(1)
        >>> torch.allclose(rule, ref)
        True
    """
    weight = module.weight
    assert isinstance(weight, Tensor)
    with torch.no_grad():
        scaled = torch.func.functional_call(module, {"weight": torch.ones_like(weight)}, inputs)
        shifted = torch.func.functional_call(module, {"weight": torch.zeros_like(weight)}, inputs)
    normalized = (scaled - shifted).to(grad_output.dtype)
    batch = grad_output.shape[0]
    return {"weight": (grad_output * normalized).reshape(batch, -1, *weight.shape).sum(1)}
