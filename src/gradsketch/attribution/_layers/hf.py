"""Rules for Hugging Face transformers' own layer types (imported only with transformers).

* ``Conv1D`` (GPT-2, GPT-J's ancestors): a Linear whose weight is stored
  transposed, ``y = x W + b`` with ``W [d_in, d_out]``, so
  ``dW[b] = sum_t a_t g_t^T`` and its Kronecker factors are the Linear ones.
* RMSNorm-style layers (``LlamaRMSNorm``, ``Qwen2RMSNorm``, ...): an
  elementwise scale of a normalized input, found by class name in the
  model (see :func:`register_model_types`) and given
  :func:`~gradsketch.attribution._layers.norm.elementwise_scale_grad_sample`.

:func:`gradsketch.attribution._layers.register_optional_rules` imports this
module when transformers is loaded (a model holding these layers implies it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

from gradsketch.attribution._layers._registry import (
    GRAD_SAMPLERS,
    register_grad_sampler,
    register_layer_factors,
)
from gradsketch.attribution._layers.norm import elementwise_scale_grad_sample


@register_layer_factors(Conv1D)
def conv1d_factors(
    module: nn.Module, inputs: tuple[Any, ...], grad_output: Tensor
) -> tuple[Tensor, Tensor]:
    """``a [B, T, d_in]``, ``g [B, T, d_out]``: the factors of the Linear ``x -> x W + b``."""
    assert isinstance(module, Conv1D)
    x = inputs[0]
    return x.reshape(x.shape[0], -1, module.nx), grad_output.reshape(x.shape[0], -1, module.nf)


@register_grad_sampler(Conv1D)
def conv1d_grad_sample(
    module: nn.Module, inputs: tuple[Any, ...], grad_output: Tensor
) -> dict[str, Tensor]:
    """``dW[b] = sum_t a_t g_t^T`` (``[d_in, d_out]``, the stored layout), ``db[b] = sum_t g_t``."""
    a, g = conv1d_factors(module, inputs, grad_output)
    out = {"weight": torch.bmm(a.to(g.dtype).transpose(1, 2), g)}
    if getattr(module, "bias", None) is not None:
        out["bias"] = g.sum(1)
    return out


def _is_rms_norm_type(module: nn.Module) -> bool:
    """A transformers class named ``*RMSNorm`` owning one 1-d ``weight`` and no children."""
    cls = type(module)
    if not (cls.__module__.startswith("transformers.") and cls.__name__.endswith("RMSNorm")):
        return False
    params = dict(module.named_parameters())
    weight = params.get("weight")
    return (
        len(params) == 1
        and weight is not None
        and weight.dim() == 1
        and not any(True for _ in module.children())
    )


def register_model_types(model: nn.Module) -> list[type[nn.Module]]:
    """Register the elementwise-scale rule for the model's RMSNorm classes; returns them.

    Every transformers model defines its own RMSNorm class (``LlamaRMSNorm``,
    ``Qwen2RMSNorm``, ``GemmaRMSNorm`` with its ``1 + weight``...), all of the
    form ``y = c(x) + weight * n(x)``. Classes already in the registry are
    left alone, so a rule registered by hand wins.
    """
    added: list[type[nn.Module]] = []
    for module in model.modules():
        cls = type(module)
        if cls not in GRAD_SAMPLERS and _is_rms_norm_type(module):
            register_grad_sampler(cls)(elementwise_scale_grad_sample)
            added.append(cls)
    return added
