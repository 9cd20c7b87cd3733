"""GELU's tanh form of the working copy: one native pass each way on CPU.

transformers' ``gelu_new``, ``gelu_fast`` and ``gelu_pytorch_tanh``
activations and ``nn.GELU(approximate="tanh")`` (five element-wise ops, or
one slow ``tanh`` kernel) become :class:`TanhGELU`: the same function as
``x * sigmoid(2u)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from gradsketch.slt._fast import _native

__all__ = ["TanhGELU", "is_tanh_gelu"]


def _gelu_kernel(x: torch.Tensor, kernels: dict[str, Any]) -> torch.Tensor:
    y = torch.empty_like(x)
    kernels["gelu"](x.data_ptr(), y.data_ptr(), x.numel())
    return y


class _NativeGELU(torch.autograd.Function):
    """``gs_gelu_tanh_f32`` forward and ``gs_gelu_tanh_backward_f32`` backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, kernels: dict[str, Any]) -> Any:
        y = _gelu_kernel(x, kernels)
        _native.keep(ctx, kernels, x)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        grad, (x,), kernels = _native.kept(ctx, grad)
        out = torch.empty_like(x)
        kernels["gelu_backward"](grad.data_ptr(), x.data_ptr(), out.data_ptr(), x.numel())
        return out, None


class TanhGELU(nn.Module):
    """``0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))``: GELU's tanh form.

    The native kernel on contiguous float32 CPU tensors (relative error a few
    float32 ulp against float64), ``F.gelu(x, approximate="tanh")`` otherwise.

    Example:
        >>> x = torch.linspace(-3, 3, 7)
        >>> torch.allclose(TanhGELU()(x), F.gelu(x, approximate="tanh"), atol=1e-6)
        True
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        kernels = _native.native_for(input)
        if kernels is None:
            return F.gelu(input, approximate="tanh")
        if not _native.tracked(input):
            return _gelu_kernel(input, kernels)
        return _NativeGELU.apply(input, kernels)  # type: ignore[no-any-return]


def is_tanh_gelu(module: nn.Module) -> bool:
    """Whether ``module`` is a tanh-form GELU of transformers, or ``nn.GELU("tanh")``."""
    if type(module) is nn.GELU:
        return module.approximate == "tanh"
    try:
        from transformers import activations
    except ImportError:  # pragma: no cover - transformers is in the hf extra
        return False
    names = ("NewGELUActivation", "FastGELUActivation", "GELUTanh")
    classes = tuple(getattr(activations, name) for name in names if hasattr(activations, name))
    # GELUTanh(use_gelu_tanh_python=True) is the same function; either way it is swapped.
    return type(module) in classes
