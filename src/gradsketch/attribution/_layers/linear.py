"""Linear layers: ``dW[b] = sum_t g_t a_t^T`` over positions ``t`` (Goodfellow, 2015)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from gradsketch.attribution._layers._registry import register_grad_sampler, register_layer_factors


def _positions(t: Tensor, width: int) -> Tensor:
    return t.reshape(t.shape[0], -1, width)


@register_layer_factors(nn.Linear)
def linear_factors(
    module: nn.Module, inputs: tuple[Any, ...], grad_output: Tensor
) -> tuple[Tensor, Tensor]:
    """``a [B, T, d_in]``, ``g [B, T, d_out]`` for inputs ``[B, ..., d_in]``."""
    assert isinstance(module, nn.Linear)
    return _positions(inputs[0], module.in_features), _positions(grad_output, module.out_features)


@register_grad_sampler(nn.Linear)
def linear_grad_sample(
    module: nn.Module, inputs: tuple[Any, ...], grad_output: Tensor
) -> dict[str, Tensor]:
    """``dW[b] = sum_t g_t a_t^T``, ``db[b] = sum_t g_t``."""
    a, g = linear_factors(module, inputs, grad_output)
    out = {"weight": torch.bmm(g.transpose(1, 2), a.to(g.dtype))}
    if getattr(module, "bias", None) is not None:
        out["bias"] = g.sum(1)
    return out
