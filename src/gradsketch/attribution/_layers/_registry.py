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

from gradsketch.errors import HookComputationError as HookComputationError

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
#: Modules hooked as a whole, their children never on their own: the experts of
#: a mixture-of-experts layer, whose children each see a data-dependent subset
#: of the tokens (gathered by the router), so only the container sees every
#: example's rows. Their parameters' per-example gradients come from
#: ``torch.func`` (or a loop over the examples) on the container's inputs.
WHOLE_MODULES: set[type[nn.Module]] = set()


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


def register_whole_module(*module_types: type[nn.Module]) -> None:
    """Hook modules of these types as a whole (see :data:`WHOLE_MODULES`).

    Use it for a mixture-of-experts container of your own whose experts are
    called on the tokens the router picked: hooks on the experts would see
    rows they cannot attribute to examples (a gathered subset of the tokens
    is only told apart from a batch by its size).

    Example:
        >>> import torch
        >>> class MyExperts(torch.nn.ModuleList):
        ...     def forward(self, x, expert_index): ...
        >>> register_whole_module(MyExperts)
        >>> MyExperts in WHOLE_MODULES
        True
        >>> WHOLE_MODULES.discard(MyExperts)
    """
    for t in module_types:
        if not (isinstance(t, type) and issubclass(t, nn.Module)):
            raise TypeError(f"`module_types` must be nn.Module subclasses, got {t!r}.")
    WHOLE_MODULES.update(module_types)
