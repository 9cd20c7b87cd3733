"""Former home of the hooked gradient computer, kept so that old imports still work.

The computer is in :mod:`._hook_computer`, the per-layer rules in
:mod:`._layers` and the tasks' batched outputs in :mod:`._modelout`; import
from there in new code.
"""

from gradsketch.attribution._hook_computer import (
    HookGradientComputer,
    WrappedModelError,
    refuse_wrapped,
)
from gradsketch.attribution._layers import (
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
from gradsketch.attribution._layers.conv import (
    conv2d_factors,
    conv2d_grad_sample,
    conv2d_patches,
)
from gradsketch.attribution._layers.embedding import embedding_grad_sample, embedding_rows
from gradsketch.attribution._layers.linear import linear_factors, linear_grad_sample
from gradsketch.attribution._layers.norm import layer_norm_grad_sample
from gradsketch.attribution._modelout import (
    BATCH_OUTPUTS,
    LOSS_GRAD_FROM_OUTPUT,
    BatchOutput,
    LossGradFromOutput,
    _margins,
    image_classification_batch_output,
    image_classification_loss_grad,
    register_batch_output,
    register_loss_grad_from_output,
    resolve_batch_output,
    text_classification_batch_output,
    text_classification_loss_grad,
)

__all__ = [
    "BATCH_OUTPUTS",
    "GRAD_SAMPLERS",
    "LAYER_FACTORS",
    "LOSS_GRAD_FROM_OUTPUT",
    "ROW_SPARSE_SAMPLERS",
    "BatchOutput",
    "GradSampler",
    "HookComputationError",
    "HookGradientComputer",
    "LayerFactors",
    "LossGradFromOutput",
    "RowSparseSampler",
    "WrappedModelError",
    "_margins",
    "conv2d_factors",
    "conv2d_grad_sample",
    "conv2d_patches",
    "embedding_grad_sample",
    "embedding_rows",
    "image_classification_batch_output",
    "image_classification_loss_grad",
    "layer_norm_grad_sample",
    "linear_factors",
    "linear_grad_sample",
    "refuse_wrapped",
    "register_batch_output",
    "register_grad_sampler",
    "register_layer_factors",
    "register_loss_grad_from_output",
    "register_row_sparse_sampler",
    "resolve_batch_output",
    "text_classification_batch_output",
    "text_classification_loss_grad",
]
