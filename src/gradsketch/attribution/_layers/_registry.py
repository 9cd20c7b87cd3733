"""Per-layer rules of the hooked gradient computer, keyed by exact module type.

A rule sees what one call of a module saw in the batched forward: its
inputs (detached) and the gradient ``g = dF/d(output)`` of the summed model
output ``F = sum_b f(z_b)``. Since examples do not interact, ``g[b]`` is
example ``b``'s own output gradient, and each rule is a closed form in
``(inputs[b], g[b])``. The tables are filled by the rule files of this
package (``linear.py``, ``conv.py``...) and by users through the decorators.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor, nn

#: ``rule(module, inputs, grad_output) -> {local parameter name: [B, *shape]}``.
GradSampler = Callable[[nn.Module, tuple[Any, ...], Tensor], dict[str, Tensor]]
#: ``factors(module, inputs, grad_output) -> (a [B, T, d_in], g [B, T, d_out])``.
LayerFactors = Callable[[nn.Module, tuple[Any, ...], Tensor], tuple[Tensor, Tensor]]
#: ``rows(module, inputs, grad_output) -> {local name: (rows [B, n], values [B, n, width])}``:
#: the per-example gradient is ``sum_j e_{rows[b, j]} ⊗ values[b, j]`` (row-sparse).
RowSparseSampler = Callable[[nn.Module, tuple[Any, ...], Tensor], dict[str, tuple[Tensor, Tensor]]]

#: Per-example gradient rules, keyed by exact module type (a subclass may
#: change ``forward``; register it explicitly).
GRAD_SAMPLERS: dict[type[nn.Module], GradSampler] = {}
#: Kronecker factors of the weight gradient, for the factorized projection.
LAYER_FACTORS: dict[type[nn.Module], LayerFactors] = {}
#: Row-sparse per-example gradients (embeddings), sketched without densifying.
ROW_SPARSE_SAMPLERS: dict[type[nn.Module], RowSparseSampler] = {}


class HookComputationError(RuntimeError):
    """Raised when a hooked forward / backward does not fit the per-example assumptions."""


def _register(
    table: dict[type[nn.Module], Any], module_types: Sequence[type[nn.Module]]
) -> Callable[[Any], Any]:
    for t in module_types:
        if not (isinstance(t, type) and issubclass(t, nn.Module)):
            raise TypeError(f"`module_types` must be nn.Module subclasses, got {t!r}.")

    def decorator(fn: Any) -> Any:
        for t in module_types:
            table[t] = fn
        return fn

    return decorator


def register_grad_sampler(*module_types: type[nn.Module]) -> Callable[[GradSampler], GradSampler]:
    """Decorator: ``fn(module, inputs, grad_output)`` gives per-example gradients.

    Example:
        >>> import torch
        >>> from gradsketch.attribution._layers.linear import linear_grad_sample
        >>> @register_grad_sampler(torch.nn.Linear)
        ... def my_linear(module, inputs, grad_output):
        ...     return linear_grad_sample(module, inputs, grad_output)
        >>> GRAD_SAMPLERS[torch.nn.Linear] is my_linear
        True
        >>> _ = register_grad_sampler(torch.nn.Linear)(linear_grad_sample)  # restore
    """
    return _register(GRAD_SAMPLERS, module_types)


def register_layer_factors(
    *module_types: type[nn.Module],
) -> Callable[[LayerFactors], LayerFactors]:
    """Decorator: ``fn(module, inputs, grad_output)`` gives Kronecker factors ``(a, g)``."""
    return _register(LAYER_FACTORS, module_types)


def register_row_sparse_sampler(
    *module_types: type[nn.Module],
) -> Callable[[RowSparseSampler], RowSparseSampler]:
    """Decorator: ``fn(module, inputs, grad_output)`` gives row-sparse per-example gradients."""
    return _register(ROW_SPARSE_SAMPLERS, module_types)
