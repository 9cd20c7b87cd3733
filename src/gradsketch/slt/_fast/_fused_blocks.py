"""RMSNorm and SwiGLU blocks of the sampler's working copy, one memory pass each on CPU.

Llama-style decoders (Llama, Mistral, Qwen2 and the families that copy
them) spend a third of a small model's train-mode step outside its matrix
products, mostly in RMSNorm (five element-wise passes and a reduction) and
in the gated MLP's ``silu(gate) * up`` (two passes, and torch's ``silu``
is slow on one thread). :func:`swap_blocks` replaces, in a working copy:

* every ``*RMSNorm`` module computing ``w * (x * rsqrt(mean(x^2) + eps))``
  by :class:`FusedRMSNorm` (the same ``weight`` parameter);
* every MLP with ``gate_proj``, ``up_proj`` and ``down_proj`` and a SiLU
  ``act_fn`` by :class:`SwiGLU` (the same three ``nn.Linear`` modules): one
  matrix product with the gate's and up's weights stacked, then one pass for
  ``silu(gate) * up``.

Parameters keep their names and order, so masks and weight resets see the
model's own. A candidate is swapped only if the replacement gives the
module's own output on a probe input (a module of another form, such as
Gemma's ``(1 + w)`` norm, keeps its own). On contiguous CPU float32 tensors
the kernels of ``csrc/gs_train.c`` run, forward and backward; elsewhere the
torch twins (:func:`rms_norm`, :func:`swiglu`) compute the same.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from gradsketch.slt._fast import _native

__all__ = ["FusedRMSNorm", "SwiGLU", "rms_norm", "swap_blocks", "swiglu"]

#: Relative and absolute tolerance of the probe comparing a replacement with the module.
_PROBE_TOL = 1e-4


def _rms_kernel(
    x: torch.Tensor, weight: torch.Tensor, eps: float, kernels: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    d = x.shape[-1]
    rows = x.numel() // d
    y = torch.empty_like(x)
    rstd = torch.empty(rows, dtype=x.dtype)
    kernels["rmsnorm"](x.data_ptr(), weight.data_ptr(), y.data_ptr(), rstd.data_ptr(), rows, d, eps)
    return y, rstd


class _NativeRMSNorm(torch.autograd.Function):
    """``gs_rmsnorm_f32`` forward, ``gs_rmsnorm_backward_f32`` backward."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, kernels: dict[str, Any]
    ) -> Any:
        y, rstd = _rms_kernel(x, weight, eps, kernels)
        _native.keep(ctx, kernels, x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        grad, (x, weight, rstd), kernels = _native.kept(ctx, grad)
        d = x.shape[-1]
        dx = torch.empty_like(x)
        dw = torch.zeros(d, dtype=torch.float64)
        kernels["rmsnorm_backward"](
            grad.data_ptr(), x.data_ptr(), weight.data_ptr(), rstd.data_ptr(), dx.data_ptr(),
            dw.data_ptr(), x.numel() // d, d,
        )  # fmt: skip
        return dx, dw.to(weight.dtype), None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2, -1) + eps))`` computed in float32, as Llama's RMSNorm.

    ``x`` is ``[..., d]`` and ``weight`` ``[d]``; the normalised input is cast
    back to ``x``'s dtype before the weight (Llama's order). One native pass
    on contiguous CPU float32 tensors.

    Example:
        >>> x, w = torch.randn(3, 8), torch.randn(8)
        >>> want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        >>> torch.allclose(rms_norm(x, w, 1e-6), want, atol=1e-6)
        True
    """
    kernels = _native.native_for(x)
    if kernels is not None and weight.dtype == torch.float32 and weight.is_contiguous():
        if not _native.tracked(x, weight):
            return _rms_kernel(x, weight, eps, kernels)[0]
        return _NativeRMSNorm.apply(x, weight, eps, kernels)  # type: ignore[no-any-return]
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, f]`` without a copy where its leading dimensions merge (else one)."""
    flat = t.reshape(-1, t.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def _swiglu_kernel(gate: torch.Tensor, up: torch.Tensor, kernels: dict[str, Any]) -> torch.Tensor:
    g, u = _rows(gate), _rows(up)
    if g.stride(0) != u.stride(0):
        g, u = g.contiguous(), u.contiguous()
    rows, f = g.shape
    y = gate.new_empty(gate.shape)
    kernels["swiglu"](g.data_ptr(), u.data_ptr(), g.stride(0), y.data_ptr(), rows, f)
    return y


class _NativeSwiGLU(torch.autograd.Function):
    """``gs_swiglu_f32`` forward, ``gs_swiglu_backward_f32`` backward (gate and up apart)."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, kernels: dict[str, Any]) -> Any:
        _native.keep(ctx, kernels, gate, up)
        return _swiglu_kernel(gate, up, kernels)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        grad, (gate, up), kernels = _native.kept(ctx, grad)
        g, u = _rows(gate).contiguous(), _rows(up).contiguous()
        rows, f = g.shape
        dg, du = torch.empty_like(g), torch.empty_like(u)
        kernels["swiglu_backward"](
            grad.data_ptr(), g.data_ptr(), u.data_ptr(), f, dg.data_ptr(), du.data_ptr(), f,
            rows, f,
        )  # fmt: skip
        return dg.view(gate.shape), du.view(up.shape), None


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (``[..., f]`` each), one native pass on CPU float32.

    The two may be the halves of one ``[..., 2f]`` product (row-strided
    views: read in place).

    Example:
        >>> gate, up = torch.randn(3, 4), torch.randn(3, 4)
        >>> torch.allclose(swiglu(gate, up), F.silu(gate) * up, atol=1e-6)
        True
    """
    ready = all(t.device.type == "cpu" and t.dtype == torch.float32 for t in (gate, up))
    # Read through the module: a test swapping its loader swaps it here too.
    kernels = _native.native_kernels() if ready and up.shape == gate.shape else None
    if kernels is None:
        return F.silu(gate) * up
    if not _native.tracked(gate, up):
        return _swiglu_kernel(gate, up, kernels)
    return _NativeSwiGLU.apply(gate, up, kernels)  # type: ignore[no-any-return]


class FusedRMSNorm(nn.Module):
    """Llama's RMSNorm through :func:`rms_norm`, holding the replaced module's ``weight``.

    Example:
        >>> norm = FusedRMSNorm(nn.Parameter(torch.ones(4)), eps=1e-6)
        >>> norm(torch.tensor([[1.0, -1.0, 1.0, -1.0]])).detach()
        tensor([[ 1.0000, -1.0000,  1.0000, -1.0000]])
    """

    def __init__(self, weight: nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight = weight
        self.eps = float(eps)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return rms_norm(input.contiguous(), self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class SwiGLU(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``; without autograd one product for both.

    Holds the replaced MLP's own ``gate_proj``, ``up_proj`` and ``down_proj``
    (names and parameter order unchanged).

    Example:
        >>> g, u, d = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 4)
        >>> x = torch.randn(2, 4)
        >>> torch.allclose(SwiGLU(g, u, d)(x), d(F.silu(g(x)) * u(x)), atol=1e-6)
        True
    """

    def __init__(self, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear) -> None:
        super().__init__()
        self.gate_proj = gate_proj
        self.up_proj = up_proj
        self.down_proj = down_proj

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        gp, up = self.gate_proj, self.up_proj
        if _native.tracked(input, *self.parameters()):
            # Training: apart (a stacked product's backward costs a copy of its gradient).
            return self.down_proj(swiglu(gp(input), up(input)))
        weight = torch.cat([gp.weight, up.weight])
        bias = None if gp.bias is None or up.bias is None else torch.cat([gp.bias, up.bias])
        gu = F.linear(input, weight, bias)
        f = gp.out_features
        return self.down_proj(swiglu(gu[..., :f], gu[..., f:]))


def _rms_candidate(module: nn.Module) -> FusedRMSNorm | None:
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not type(module).__name__.endswith("RMSNorm") or not isinstance(eps, float):
        return None
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1:
        return None
    if list(dict(module.named_parameters()).keys()) != ["weight"]:
        return None
    return FusedRMSNorm(weight, eps)


def _is_silu(module: Any) -> bool:
    return isinstance(module, nn.SiLU) or type(module).__name__ in ("SiLUActivation", "SiLU")


def _mlp_candidate(module: nn.Module) -> SwiGLU | None:
    layers = [getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(type(layer) is nn.Linear for layer in layers):
        return None
    gate, up, down = layers
    assert isinstance(gate, nn.Linear) and isinstance(up, nn.Linear)
    assert isinstance(down, nn.Linear)
    if not _is_silu(getattr(module, "act_fn", None)) or gate.weight.shape != up.weight.shape:
        return None
    if (gate.bias is None) != (up.bias is None):
        return None
    if set(dict(module.named_children())) != {"gate_proj", "up_proj", "down_proj", "act_fn"}:
        return None
    swapped = SwiGLU(gate, up, down)
    # Parameter order must stay the model's (weight resets zip the two lists).
    if [id(p) for p in module.parameters()] != [id(p) for p in swapped.parameters()]:
        return None
    return swapped


@torch.no_grad()
def _same_function(old: nn.Module, new: nn.Module, width: int, ref: torch.Tensor) -> bool:
    """Whether ``new`` gives ``old``'s output on a seeded probe input (no global randomness)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((2, 3, width), generator=gen, dtype=torch.float64).to(ref)
    try:
        want, got = old(x), new(x)
    except Exception:  # a module of another form keeps its own
        return False
    if not isinstance(want, torch.Tensor) or want.shape != got.shape:
        return False
    return bool(torch.allclose(got, want, rtol=_PROBE_TOL, atol=_PROBE_TOL))


def swap_blocks(model: nn.Module) -> list[str]:
    """Replace the RMSNorm and SwiGLU blocks of ``model`` in place; the kinds swapped.

    Returns:
        Sorted names of what was swapped: ``"rmsnorm"``, ``"swiglu"``.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> m = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=8,
        ...     num_attention_heads=2, intermediate_size=16, vocab_size=16))
        >>> swap_blocks(m)
        ['rmsnorm', 'swiglu']
        >>> type(m.model.layers[0].mlp).__name__
        'SwiGLU'
    """
    kinds: set[str] = set()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            norm = _rms_candidate(child)
            if norm is not None:
                if _same_function(child, norm, norm.weight.shape[0], norm.weight):
                    norm.train(child.training)
                    setattr(parent, name, norm)
                    kinds.add("rmsnorm")
                continue
            mlp = _mlp_candidate(child)
            if mlp is not None:
                gate = mlp.gate_proj
                if _same_function(child, mlp, gate.in_features, gate.weight):
                    mlp.train(child.training)
                    setattr(parent, name, mlp)
                    kinds.add("swiglu")
    return sorted(kinds)
