"""Normalization layers: elementwise scale (and shift) of a recomputed normalized input."""

from __future__ import annotations

from typing import Any

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
