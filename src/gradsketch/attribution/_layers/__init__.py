"""Per-example gradient rules of :class:`~gradsketch.attribution.HookGradientComputer`.

One file per layer family, each registering its rules in the tables of
:mod:`._registry` when imported (the layout of opacus's ``grad_sample/``):
``sum_t g_t a_t^T`` for Linear, the same on im2col patches for Conv2d, a
scatter for Embedding, ``sum_t g_t * x_hat_t`` for LayerNorm (Goodfellow,
"Efficient per-example gradient computations", 2015). Importing this package
registers them all.
"""

from gradsketch.attribution._layers import conv, embedding, linear, norm
from gradsketch.attribution._layers._registry import (
    GRAD_SAMPLERS,
    LAYER_FACTORS,
    ROW_SPARSE_SAMPLERS,
    GradSampler,
    HookComputationError,
    LayerFactors,
    RowSparseSampler,
    register_grad_sampler,
    register_layer_factors,
    register_row_sparse_sampler,
)

__all__ = [
    "GRAD_SAMPLERS",
    "LAYER_FACTORS",
    "ROW_SPARSE_SAMPLERS",
    "GradSampler",
    "HookComputationError",
    "LayerFactors",
    "RowSparseSampler",
    "register_grad_sampler",
    "register_layer_factors",
    "register_row_sparse_sampler",
    "conv",
    "embedding",
    "linear",
    "norm",
]
