"""Per-example gradient rules of :class:`~gradsketch.attribution.HookGradientComputer`.

One file per layer family, each registering its rules in the tables of
:mod:`._registry` when imported (the layout of opacus's ``grad_sample/``):
``sum_t g_t a_t^T`` for Linear, the same on im2col patches for Conv2d, a
scatter for Embedding, ``sum_t g_t * x_hat_t`` for LayerNorm (Goodfellow,
"Efficient per-example gradient computations", 2015), ``sum_t g_t * n(x_t)``
for RMSNorm. Importing this package registers them all; rules for optional
packages' layer types (Hugging Face's ``Conv1D`` and RMSNorm classes, and
its mixture-of-experts containers, hooked whole, in ``hf.py``) are
registered by :func:`register_optional_rules`.
"""

import sys

from torch import nn

from gradsketch.attribution._layers import conv, embedding, linear, norm
from gradsketch.attribution._layers._registry import (
    GRAD_SAMPLERS,
    LAYER_FACTORS,
    ROW_SPARSE_SAMPLERS,
    WHOLE_MODULES,
    GradSampler,
    HookComputationError,
    LayerFactors,
    RowSparseSampler,
    register_grad_sampler,
    register_layer_factors,
    register_row_sparse_sampler,
    register_whole_module,
)


def register_optional_rules(model: nn.Module) -> None:
    """Register the rules of optional packages that ``model``'s layers come from.

    Hugging Face layer types are only importable with transformers, and a
    model holding them has imported it: the rules load then, never at
    gradsketch's import. The model's RMSNorm and experts classes are registered
    by :func:`gradsketch.attribution._layers.hf.register_model_types`.
    """
    if "transformers" in sys.modules:
        from gradsketch.attribution._layers import hf

        hf.register_model_types(model)


__all__ = [
    "register_optional_rules",
    "GRAD_SAMPLERS",
    "LAYER_FACTORS",
    "ROW_SPARSE_SAMPLERS",
    "WHOLE_MODULES",
    "GradSampler",
    "HookComputationError",
    "LayerFactors",
    "RowSparseSampler",
    "register_grad_sampler",
    "register_layer_factors",
    "register_row_sparse_sampler",
    "register_whole_module",
    "conv",
    "embedding",
    "linear",
    "norm",
]
