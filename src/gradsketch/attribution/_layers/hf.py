"""Rules for Hugging Face transformers' own layer types (imported only with transformers).

* ``Conv1D`` (GPT-2, GPT-J's ancestors): a Linear whose weight is stored
  transposed, ``y = x W + b`` with ``W [d_in, d_out]``, so
  ``dW[b] = sum_t a_t g_t^T`` and its Kronecker factors are the Linear ones.
* ``*ScaledWordEmbedding`` (Gemma, BART, ...): ``embedding(ids) * embed_scale``,
  the Embedding rule (dense and row-sparse) on the scaled output gradient,
  instead of a dense ``[vocab, width]`` per-example gradient from ``torch.func``.
* ``FalconLinear``: ``nn.Linear``'s map written out (``x W^T + b``), so
  the Linear rule and factors serve it (rules are keyed by exact type).
* RMSNorm-style layers (``LlamaRMSNorm``, ``Qwen2RMSNorm``, ``T5LayerNorm``, ...): an
  elementwise scale of a normalized input, found by class name in the
  model (see :func:`register_model_types`) and given
  :func:`~gradsketch.attribution._layers.norm.elementwise_scale_grad_sample`.
* Mixture-of-experts containers (``MixtralExperts``, ``Qwen2MoeExperts``,
  ``SwitchTransformersExperts``, ...: transformers names them ``*Experts``)
  pick each expert's tokens from the router's indices; they are hooked as a
  whole (:data:`~gradsketch.attribution._layers.WHOLE_MODULES`), since their
  children see a data-dependent subset of the tokens. For K-FAC / EK-FAC each
  expert ``W[e]`` of their stacked ``[E, d_out, d_in]`` weights is a factored
  layer (see :mod:`gradsketch.attribution._layer_capture`).

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
    WHOLE_MODULES,
    register_grad_sampler,
    register_layer_factors,
    register_row_sparse_sampler,
)
from gradsketch.attribution._layers.embedding import embedding_grad_sample, embedding_rows
from gradsketch.attribution._layers.linear import linear_factors, linear_grad_sample
from gradsketch.attribution._layers.norm import elementwise_scale_grad_sample
from gradsketch.sketch import TRANSPOSED_WEIGHT

# Its weight is stored [d_in, d_out]: per-example weight gradients formed from its
# factors a row at a time (the hooks' streamed projection) read them in that order.
TRANSPOSED_WEIGHT.add(Conv1D)

#: transformers subclasses of ``nn.Linear`` whose forward is ``x W^T + b`` (by class name).
LINEAR_EQUIVALENTS = frozenset({"FalconLinear"})


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
    """A transformers ``*RMSNorm`` / ``*LayerNorm`` owning one 1-d ``weight`` and no children.

    Weight-only layer norms (``T5LayerNorm``) scale a normalized input the
    same way; norms with a bias have two parameters and are left out.
    """
    cls = type(module)
    named = cls.__name__.endswith(("RMSNorm", "LayerNorm"))
    if not (cls.__module__.startswith("transformers.") and named):
        return False
    params = dict(module.named_parameters())
    weight = params.get("weight")
    return (
        len(params) == 1
        and weight is not None
        and weight.dim() == 1
        and not any(True for _ in module.children())
    )


def _embed_scaled(module: nn.Module, grad_output: Tensor) -> Tensor:
    """``g * embed_scale``: the gradient at the unscaled lookup (scale in the weight dtype)."""
    scale: Any = getattr(module, "embed_scale")  # noqa: B009 - a buffer or a float
    if isinstance(scale, Tensor):
        weight = module.weight
        assert isinstance(weight, Tensor)
        scale = scale.to(weight.dtype).to(grad_output.dtype)
    return grad_output * scale


def scaled_embedding_rows(
    module: nn.Module, inputs: tuple[Any, ...], grad_output: Tensor
) -> dict[str, tuple[Tensor, Tensor]]:
    """Rows and values of ``embedding(ids) * embed_scale``'s per-example gradient."""
    return embedding_rows(module, inputs, _embed_scaled(module, grad_output))


def scaled_embedding_grad_sample(
    module: nn.Module, inputs: tuple[Any, ...], grad_output: Tensor
) -> dict[str, Tensor]:
    """Dense per-example gradient of ``embedding(ids) * embed_scale``."""
    return embedding_grad_sample(module, inputs, _embed_scaled(module, grad_output))


def _is_scaled_embedding(module: nn.Module) -> bool:
    cls = type(module)
    return (
        cls.__module__.startswith("transformers.")
        and cls.__name__.endswith("ScaledWordEmbedding")
        and isinstance(module, nn.Embedding)
        and hasattr(module, "embed_scale")
    )


def _is_linear_equivalent(module: nn.Module) -> bool:
    cls = type(module)
    return (
        cls.__module__.startswith("transformers.")
        and cls.__name__ in LINEAR_EQUIVALENTS
        and isinstance(module, nn.Linear)
    )


def _is_experts_type(module: nn.Module) -> bool:
    """A transformers class named ``*Experts`` that owns parameters (a MoE container)."""
    cls = type(module)
    return (
        cls.__module__.startswith("transformers.")
        and cls.__name__.endswith("Experts")
        and any(True for _ in module.parameters())
    )


def register_model_types(model: nn.Module) -> list[type[nn.Module]]:
    """Register the model's RMSNorm and mixture-of-experts classes; returns them.

    Every transformers model defines its own RMSNorm class (``LlamaRMSNorm``,
    ``Qwen2RMSNorm``, ``GemmaRMSNorm`` with its ``1 + weight``...), all of the
    form ``y = c(x) + weight * n(x)``: they get the elementwise-scale rule.
    Classes already in the registry are left alone, so a rule registered by
    hand wins. Experts containers are added to
    :data:`~gradsketch.attribution._layers.WHOLE_MODULES`, scaled word
    embeddings get the Embedding rules on the scaled gradient, and the
    :data:`LINEAR_EQUIVALENTS` get the Linear rule and factors.
    """
    added: list[type[nn.Module]] = []
    for module in model.modules():
        cls = type(module)
        if cls not in GRAD_SAMPLERS and _is_rms_norm_type(module):
            register_grad_sampler(cls)(elementwise_scale_grad_sample)
            added.append(cls)
        elif cls not in WHOLE_MODULES and _is_experts_type(module):
            WHOLE_MODULES.add(cls)
            added.append(cls)
        elif cls not in GRAD_SAMPLERS and _is_scaled_embedding(module):
            register_grad_sampler(cls)(scaled_embedding_grad_sample)
            register_row_sparse_sampler(cls)(scaled_embedding_rows)
            added.append(cls)
        elif cls not in GRAD_SAMPLERS and _is_linear_equivalent(module):
            register_grad_sampler(cls)(linear_grad_sample)
            register_layer_factors(cls)(linear_factors)
            added.append(cls)
    return added
