"""Embedding: a per-example gradient that is a scatter of output gradients into rows."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from gradsketch.attribution._layers._registry import (
    register_grad_sampler,
    register_row_sparse_sampler,
)


def _embedding_rows(
    module: nn.Embedding, inputs: tuple[Any, ...], grad_output: Tensor
) -> tuple[Tensor, Tensor]:
    idx = inputs[0].reshape(inputs[0].shape[0], -1)
    g = grad_output.reshape(idx.shape[0], idx.shape[1], module.embedding_dim)
    if module.padding_idx is not None:
        # The padding row gets no gradient (nn.Embedding's backward skips it).
        g = g * (idx != module.padding_idx).unsqueeze(-1).to(g.dtype)
    if module.scale_grad_by_freq:
        counts = torch.zeros(idx.shape[0], module.num_embeddings, dtype=g.dtype, device=g.device)
        counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=g.dtype))
        g = g / counts.gather(1, idx).unsqueeze(-1)
    return idx, g


@register_row_sparse_sampler(nn.Embedding)
def embedding_rows(
    module: nn.Module, inputs: tuple[Any, ...], grad_output: Tensor
) -> dict[str, tuple[Tensor, Tensor]]:
    """Rows ``idx [B, T]`` and values ``g [B, T, D]``: ``dE[b] = sum_t e_{idx_t} g_t^T``."""
    assert isinstance(module, nn.Embedding)
    return {"weight": _embedding_rows(module, inputs, grad_output)}


@register_grad_sampler(nn.Embedding)
def embedding_grad_sample(
    module: nn.Module, inputs: tuple[Any, ...], grad_output: Tensor
) -> dict[str, Tensor]:
    """Dense ``[B, num_embeddings, D]`` scatter of the output gradients."""
    assert isinstance(module, nn.Embedding)
    idx, g = _embedding_rows(module, inputs, grad_output)
    out = torch.zeros(idx.shape[0], *module.weight.shape, dtype=g.dtype, device=g.device)
    out.scatter_add_(1, idx.unsqueeze(-1).expand_as(g), g)
    return {"weight": out}
