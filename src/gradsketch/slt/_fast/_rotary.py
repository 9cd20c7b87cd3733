"""Rotary position embedding of the sampler's working copy: one native pass each way on CPU.

transformers' decoders with rotary embeddings (Llama, Mistral, Qwen2 and 3,
GPT-NeoX, Gemma, Phi-3, OLMo, StableLM and the families that copy them)
rotate every layer's queries and keys with a module-level
``apply_rotary_pos_emb(q, k, cos, sin)``: ``x * cos + rotate_half(x) * sin``
(GPT-NeoX and others on the first ``rotary_dim`` values only), ten
element-wise passes forward and as many backward, about 6 % of a small
Llama's train-mode step on one CPU thread. :func:`swap_rotary` makes the
working copy run :func:`rotary` instead: the kernel ``gs_rotary_f32``,
which rounds every product and sum as torch does (no fused multiply-adds),
so the rotated queries and keys, and their gradients, are the model's own
bit for bit.

How it reaches the model without changing it: the function the attention
layers call is looked up in their transformers module at call time, so
that module's ``apply_rotary_pos_emb`` is wrapped once per process
(:func:`_install`). The wrapper calls the original unless it runs inside
the forward pass of a working copy that :func:`swap_rotary` accepted
(forward hooks on the copy count the depth, in the calling thread) with
the native kernels on, and its arguments suit the kernel (CPU float32,
``unsqueeze_dim`` 1 or 2, ``cos`` and ``sin`` outside autograd); any
other model, thread or call gets the original. A copy is accepted only
if, on its train-mode probe, every call gave the original's result
exactly.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import inspect
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from gradsketch.slt._fast import _native

__all__ = ["FUNCTION", "rotary", "swap_rotary", "swapped"]

#: The module-level function transformers' attention layers rotate with.
FUNCTION = "apply_rotary_pos_emb"

_LOCAL = threading.local()  # .depth: accepted copies' forwards running; .checks: probe results
_INSTALL_LOCK = threading.Lock()


def _strides(t: torch.Tensor, heads_dim: int) -> Any:
    """Batch, head and token strides of a ``[b, ., ., d]`` tensor whose heads are ``heads_dim``."""
    return (ctypes.c_int64 * 3)(t.stride(0), t.stride(heads_dim), t.stride(3 - heads_dim))


def _rotary_kernel(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads_dim: int, backward: bool,
    kernels: dict[str, Any],
) -> torch.Tensor:  # fmt: skip
    rot = cos.shape[-1]
    # The layouts torch's operations give, which later reductions' order follows: the
    # rotated x that of x * cos (x's own) where every value rotates, else torch.cat's
    # (contiguous); its gradient always the contiguous one autograd sums into.
    whole = rot == x.shape[-1] and not backward
    y = torch.empty_like(x) if whole else torch.empty(x.shape, dtype=x.dtype)
    batch = cos.stride(0) if cos.shape[0] > 1 else 0
    kernels["rotary"](
        x.data_ptr(), _strides(x, heads_dim), cos.data_ptr(), sin.data_ptr(),
        (ctypes.c_int64 * 2)(batch, cos.stride(1)), y.data_ptr(), _strides(y, heads_dim),
        x.shape[0], x.shape[heads_dim], x.shape[3 - heads_dim], x.shape[3], rot, int(backward),
    )  # fmt: skip
    return y


class _NativeRotary(torch.autograd.Function):
    """``gs_rotary_f32`` forward; backward the same kernel's transpose."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads_dim: int,
        kernels: dict[str, Any],
    ) -> Any:  # fmt: skip
        ctx.save_for_backward(cos, sin)
        ctx.args = (heads_dim, kernels)
        return _rotary_kernel(x, cos, sin, heads_dim, False, kernels)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        cos, sin = ctx.saved_tensors
        heads_dim, kernels = ctx.args
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        return _rotary_kernel(grad, cos, sin, heads_dim, True, kernels), None, None, None, None


def _fits(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads_dim: int) -> bool:
    """Whether the kernel takes these arguments (else torch's operations run)."""
    if heads_dim not in (1, 2) or x.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        return False
    rot = cos.shape[-1]
    return (
        all(t.device.type == "cpu" and t.dtype == torch.float32 for t in (x, cos, sin))
        and not (torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad))
        and rot % 2 == 0
        and 0 < rot <= x.shape[-1]
        and cos.shape[0] in (1, x.shape[0])
        and cos.shape[1] == x.shape[3 - heads_dim]
        and x.stride(-1) == 1
        and cos.stride(-1) == 1
        and sin.stride() == cos.stride()
    )


def _torch_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads_dim: int
) -> torch.Tensor:
    """:func:`rotary` in torch's operations, as transformers writes it (the kernel's twin)."""
    cos, sin = cos.unsqueeze(heads_dim), sin.unsqueeze(heads_dim)
    rot = cos.shape[-1]
    part, rest = x[..., :rot], x[..., rot:]
    lo, hi = part[..., : rot // 2], part[..., rot // 2 :]
    out = part * cos + torch.cat((-hi, lo), dim=-1) * sin
    return out if rot == x.shape[-1] else torch.cat((out, rest), dim=-1)


def rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` on the first ``cos.shape[-1]`` values of each head.

    ``x`` is ``[b, heads, t, d]`` (``unsqueeze_dim=1``) or ``[b, t, heads, d]``
    (``2``); ``cos`` and ``sin`` are ``[b or 1, t, r]`` with ``r <= d`` even
    (Su et al. 2021, "RoFormer", in transformers' half-split form); values past
    ``r`` pass through. One native pass (and one backward) on CPU float32, the
    bits of torch's operations; torch's operations elsewhere.

    Example:
        >>> x, cos, sin = torch.randn(2, 3, 5, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 8)
        >>> half = torch.cat((-x[..., 4:], x[..., :4]), dim=-1)
        >>> torch.equal(rotary(x, cos, sin), x * cos[:, None] + half * sin[:, None])
        True
    """
    kernels = _native.native_kernels() if _fits(x, cos, sin, unsqueeze_dim) else None
    if kernels is None:
        return _torch_rotary(x, cos, sin, unsqueeze_dim)
    return _run_kernel(x, cos, sin, unsqueeze_dim, kernels)


def _run_kernel(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads_dim: int,
    kernels: dict[str, Any],
) -> torch.Tensor:  # fmt: skip
    """The kernel on arguments :func:`_fits` took: an autograd node only where one records."""
    if not _native.tracked(x):
        return _rotary_kernel(x, cos, sin, heads_dim, False, kernels)
    return _NativeRotary.apply(x, cos, sin, heads_dim, kernels)  # type: ignore[no-any-return]


def _arguments(
    signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[list[torch.Tensor], int] | None:
    """``([q, k, cos, sin], unsqueeze_dim)`` of a call the kernel takes, else None."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None
    names = list(signature.parameters)
    extra = {n: v for n, v in bound.arguments.items() if n not in names[:4]}
    dim = extra.pop("unsqueeze_dim", 1)
    if extra.pop("position_ids", None) is not None or extra or dim not in (1, 2):
        return None
    tensors = [bound.arguments.get(n) for n in names[:4]]
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return None
    return tensors, dim  # type: ignore[return-value]


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` (a module's ``apply_rotary_pos_emb``) behind the working copies' switch."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def apply_rotary_pos_emb(*args: Any, **kwargs: Any) -> Any:
        if not getattr(_LOCAL, "depth", 0):
            return original(*args, **kwargs)
        fused = _fused(signature, args, kwargs)
        checks = getattr(_LOCAL, "checks", None)
        if checks is None:
            return original(*args, **kwargs) if fused is None else fused
        want = original(*args, **kwargs)
        checks.append(
            fused is not None
            and isinstance(want, tuple)
            and len(want) == 2
            and all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(fused, want))
        )
        return want

    apply_rotary_pos_emb.__gradsketch_original__ = original  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def _fused(
    signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The kernel's ``(q, k)`` for a call it takes with the native kernels on, else None."""
    found = _arguments(signature, args, kwargs)
    if found is None:
        return None
    kernels = _native.native_kernels()
    if kernels is None:
        return None
    (q, k, cos, sin), heads_dim = found
    if not (_fits(q, cos, sin, heads_dim) and _fits(k, cos, sin, heads_dim)):
        return None
    return _run_kernel(q, cos, sin, heads_dim, kernels), _run_kernel(
        k, cos, sin, heads_dim, kernels
    )


def _takes_four(function: Callable[..., Any]) -> bool:
    """Whether ``function`` takes ``(q, k, cos, sin, ...)`` (GPT-J's takes ``(x, sin, cos)``)."""
    try:
        params = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return len(params) >= 4 and all(p.kind in positional for p in params[:4])


def _install(module_name: str) -> bool:
    """Wrap ``module_name``'s ``apply_rotary_pos_emb`` (once per process); False without one."""
    with _INSTALL_LOCK:
        module = sys.modules.get(module_name)
        function = getattr(module, FUNCTION, None)
        if getattr(function, "__gradsketch_original__", None) is not None:
            return True  # wrapped already
        if not callable(function) or not _takes_four(function):
            return False
        setattr(module, FUNCTION, _wrap(function))
        return True


def _enter(module: nn.Module, args: Any) -> None:
    _LOCAL.depth = getattr(_LOCAL, "depth", 0) + 1


def _leave(module: nn.Module, args: Any, output: Any) -> None:
    _LOCAL.depth = max(0, getattr(_LOCAL, "depth", 0) - 1)


@contextlib.contextmanager
def _checking(checks: list[bool]) -> Iterator[None]:
    _LOCAL.checks = checks
    try:
        yield
    finally:
        _LOCAL.checks = None


def swap_rotary(model: nn.Module, probe: Callable[[], Any]) -> bool:
    """Run ``model``'s rotary embedding through :func:`rotary` if ``probe()`` shows the same bits.

    ``model`` is a working copy; ``probe()`` runs it in train mode on a few
    rows. The transformers modules of ``model``'s layers get their
    ``apply_rotary_pos_emb`` wrapped (module docstring), and ``model`` forward
    hooks that switch the wrappers on in its forward passes; the hooks stay
    only if the probe called a wrapper and every call gave the original's
    result exactly (a family whose rotation is another, such as interleaved
    pairs, keeps its own).

    Returns:
        Whether ``model`` now runs the kernel.
    """
    modules = {type(m).__module__ for m in model.modules()}
    if not [
        name for name in sorted(modules) if name.startswith("transformers.") and _install(name)
    ]:
        return False
    handles = [
        model.register_forward_pre_hook(_enter),
        model.register_forward_hook(_leave, always_call=True),
    ]
    checks: list[bool] = []
    with _checking(checks):
        try:
            probe()
        except Exception:  # any failure keeps the model's own rotation
            checks.append(False)
    if checks and all(checks):
        return True
    for handle in handles:
        handle.remove()
    return False


def swapped(model: nn.Module) -> bool:
    """Whether :func:`swap_rotary` switched ``model``'s rotary embedding to the kernel."""
    return any(hook is _enter for hook in model._forward_pre_hooks.values())
