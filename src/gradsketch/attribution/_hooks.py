"""Former home of the hooked gradient computer, kept so that old imports still work.

The computer is in :mod:`._hook_computer`, the per-layer rules in
:mod:`._layers` and the tasks' batched outputs in :mod:`._modelout`.
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
    HookComputationError,
    register_grad_sampler,
    register_layer_factors,
    register_row_sparse_sampler,
)
from gradsketch.attribution._modelout import (
    BATCH_OUTPUTS,
    LOSS_GRAD_FROM_OUTPUT,
    register_batch_output,
    register_loss_grad_from_output,
    resolve_batch_output,
)

__all__ = [
    "BATCH_OUTPUTS",
    "GRAD_SAMPLERS",
    "LAYER_FACTORS",
    "LOSS_GRAD_FROM_OUTPUT",
    "ROW_SPARSE_SAMPLERS",
    "HookComputationError",
    "HookGradientComputer",
    "WrappedModelError",
    "refuse_wrapped",
    "register_batch_output",
    "register_grad_sampler",
    "register_layer_factors",
    "register_loss_grad_from_output",
    "register_row_sparse_sampler",
    "resolve_batch_output",
]
