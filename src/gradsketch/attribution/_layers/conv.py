"""Conv2d: the Linear rule on im2col patches (groups handled block-diagonally)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradsketch.attribution._layers._registry import (
    HookComputationError,
    register_grad_sampler,
    register_layer_factors,
)


def conv2d_patches(module: nn.Conv2d, x: Tensor) -> Tensor:
    """im2col: ``[B, C_in * kh * kw, L]`` patches exactly as ``module`` sees them."""
    if module.padding_mode != "zeros" or isinstance(module.padding, str):
        x = F.pad(x, _explicit_padding(module), mode=_pad_mode(module))
        padding: Any = 0
    else:
        padding = module.padding
    return F.unfold(
        x, module.kernel_size, dilation=module.dilation, padding=padding, stride=module.stride
    )


def _pad_mode(module: nn.Conv2d) -> str:
    return "constant" if module.padding_mode == "zeros" else module.padding_mode


def _explicit_padding(module: nn.Conv2d) -> list[int]:
    """``F.pad`` widths ``[left, right, top, bottom]`` of ``module``'s padding."""
    if module.padding == "valid":
        return [0, 0, 0, 0]
    if module.padding == "same":
        widths: list[int] = []
        for k, d in zip(reversed(module.kernel_size), reversed(module.dilation)):
            total = d * (k - 1)
            widths += [total // 2, total - total // 2]
        return widths
    assert isinstance(module.padding, tuple)
    ph, pw = module.padding
    return [pw, pw, ph, ph]


@register_layer_factors(nn.Conv2d)
def conv2d_factors(
    module: nn.Module, inputs: tuple[Any, ...], grad_output: Tensor
) -> tuple[Tensor, Tensor]:
    """``a [B, L, C_in kh kw]`` patches and ``g [B, L, C_out]`` (``groups=1``)."""
    assert isinstance(module, nn.Conv2d)
    if module.groups != 1:
        raise HookComputationError(
            f"Conv2d with groups={module.groups} has no single Kronecker factorization; it is "
            "projected through its per-example gradient (FactorizedProjector.from_model puts it "
            "in the rest block)."
        )
    patches = conv2d_patches(module, inputs[0])
    g = grad_output.reshape(grad_output.shape[0], grad_output.shape[1], -1)
    return patches.transpose(1, 2), g.transpose(1, 2)


@register_grad_sampler(nn.Conv2d)
def conv2d_grad_sample(
    module: nn.Module, inputs: tuple[Any, ...], grad_output: Tensor
) -> dict[str, Tensor]:
    """``dW[b] = sum_l g_l p_l^T`` over output positions ``l`` and im2col patches ``p_l``."""
    assert isinstance(module, nn.Conv2d)
    batch, groups = grad_output.shape[0], module.groups
    patches = conv2d_patches(module, inputs[0]).to(grad_output.dtype)
    g = grad_output.reshape(batch, groups, module.out_channels // groups, -1)
    p = patches.reshape(batch, groups, patches.shape[1] // groups, -1)
    weight = torch.einsum("bgol,bgil->bgoi", g, p).reshape(batch, *module.weight.shape)
    out = {"weight": weight}
    if module.bias is not None:
        out["bias"] = grad_output.reshape(batch, module.out_channels, -1).sum(-1)
    return out
