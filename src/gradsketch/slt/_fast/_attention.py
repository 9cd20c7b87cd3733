"""Attention of the working copy: sdpa's function with seeded dropout, fused on CPU.

Attention with dropout (PyTorch's fused kernels take none on CPU, so
``sdpa`` falls back to its slower math path) runs :func:`attention`: on CPU
float32, one native kernel per batch and head computes the scores with BLAS
``sgemm`` from query, key and value where they lie (the head-major views of
a projection: no copies), then scale, causal mask, softmax and dropout in
cache, then the values into the ``[b, q, h, d]`` output; elsewhere the same
in torch operations. Without dropout (eval mode, or models whose attention
dropout is 0) it is ``sdpa`` itself. :func:`swap_attention` makes a working
copy use it (registered in transformers' interfaces as
:data:`ATTENTION_NAME`) only if its train-mode probe gives ``sdpa``'s output.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gradsketch.slt._fast import _native
from gradsketch.slt._fast._dropout import draw_seed, drop_rule, dropout, stream
from gradsketch.slt._fast._native import AttnShape, blas_sgemm

__all__ = ["ATTENTION_NAME", "attention", "swap_attention"]

logger = logging.getLogger(__name__)

#: The name :func:`attention` is registered under in transformers' interfaces.
ATTENTION_NAME = "gradsketch_sdpa"
#: Dropout probability the train-mode probe of the attention runs with: explicit maths
#: (``dropout > 0``) that drops nothing (``round(p * 65536) = 0``), so it must equal sdpa.
_PROBE_P = 1e-9

_REGISTER_LOCK = threading.Lock()
_REGISTERED = False
#: This thread's train-mode probe (:func:`swap_attention`): its checks in ``.probe``.
_PROBE = threading.local()

#: BLAS takes 32-bit sizes and strides.
_BLAS_INT_MAX = 2**31 - 1
#: Batch, head and token strides of a ``[b, h, t, d]`` tensor (:func:`_blas_strides`).
_Strides = tuple[int, int, int]


class _NativeSoftmaxDropout(torch.autograd.Function):
    """``gs_softmax_dropout_f32``: scaled, optionally causal softmax and dropout in one pass."""

    @staticmethod
    def forward(
        ctx: Any,
        scores: torch.Tensor,
        scale: float,
        causal: bool,
        seed: int,
        q: int,
        dscale: float,
        kernels: dict[str, Any],
    ) -> Any:
        cols, q_len = scores.shape[-1], scores.shape[-2]
        rows = scores.numel() // cols
        probs, out = torch.empty_like(scores), torch.empty_like(scores)
        kernels["softmax_dropout"](
            scores.data_ptr(), probs.data_ptr(), out.data_ptr(), rows, cols, q_len,
            int(causal), scale, seed, q, dscale,
        )  # fmt: skip
        ctx.save_for_backward(probs)
        ctx.args = (rows, cols, scale, seed, q, dscale, kernels)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        (probs,) = ctx.saved_tensors
        rows, cols, scale, seed, q, dscale, kernels = ctx.args
        grad = grad.contiguous()
        out = torch.empty_like(probs)
        kernels["softmax_dropout_backward"](
            grad.data_ptr(), probs.data_ptr(), out.data_ptr(), rows, cols, scale, seed, q, dscale
        )
        return out, None, None, None, None, None, None


def _blas_strides(t: torch.Tensor) -> _Strides | None:
    """Batch, head and token strides of a ``[b, h, t, d]`` tensor for BLAS, else None.

    None unless ``d`` is unit-strided and the token stride is at least ``d``
    (BLAS's ``lda >= k``) and within 32 bits; strides of size-1 dimensions
    are free, so they are set to suit.
    """
    d = t.shape[-1]
    if d > 1 and t.stride(-1) != 1:
        return None
    sb, sh, st = (t.stride(i) if t.shape[i] > 1 else 0 for i in range(3))
    st = st if t.shape[2] > 1 else d
    if st < d or max(sb, sh, st) > _BLAS_INT_MAX:
        return None
    return sb, sh, st


class _NativeAttention(torch.autograd.Function):
    """``gs_attention_f32`` forward and ``gs_attention_backward_f32`` backward."""

    @staticmethod
    def forward(
        ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, run: Any
    ) -> Any:
        out, probs = run.forward(query, key, value, keep_probs=True)
        ctx.save_for_backward(query, key, value, probs)
        ctx.run = run
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        query, key, value, probs = ctx.saved_tensors
        return (*ctx.run.backward(grad, query, key, value, probs), None)


class _FusedAttention:
    """One attention call of the fused kernels: settings, mask seed, kernels and sgemm.

    Also the BLAS strides of its query, key and value (:func:`_blas_strides`,
    checked by the caller).
    """

    def __init__(
        self,
        causal: bool,
        scale: float,
        p: float,
        kernels: dict[str, Any],
        gemm: int,
        strides: list[_Strides],
    ) -> None:
        self.causal, self.scale, self.kernels, self.gemm = causal, scale, kernels, gemm
        self.strides = strides
        self.q, self.dscale = drop_rule(p)
        self.seed = draw_seed(stream())

    @staticmethod
    def shape(query: torch.Tensor, key: torch.Tensor, strides: list[_Strides]) -> AttnShape:
        """The kernels' record: sizes, and strides of query, key, value and output.

        (Or of their gradients, in the same order.)
        """
        b, h, tq, d = query.shape
        return AttnShape(b, h, key.shape[1], tq, key.shape[2], d, *strides)

    @staticmethod
    def strides_of(t: torch.Tensor) -> _Strides:
        """:func:`_blas_strides` of a tensor this call laid out itself (always readable)."""
        strides = _blas_strides(t)
        assert strides is not None
        return strides

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, keep_probs: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(out [b, q, h, d], probs [b, h, q, k] or None)`` (``probs`` for the backward)."""
        b, h, tq, d = query.shape
        out = query.new_empty(b, tq, h, d)  # as the attention interface returns it
        sh = self.shape(query, key, [*self.strides, self.strides_of(out.transpose(1, 2))])
        probs = query.new_empty(b, h, tq, key.shape[2]) if keep_probs else None
        status = self.kernels["attention"](
            self.gemm, torch.get_num_threads(), ctypes.byref(sh), query.data_ptr(),
            key.data_ptr(), value.data_ptr(), out.data_ptr(),
            None if probs is None else probs.data_ptr(), int(self.causal), self.scale,
            self.seed, self.q, self.dscale,
        )  # fmt: skip
        _check_status(status)
        return out, probs

    def backward(
        self,
        grad: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        probs: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients of query, key and value for ``grad`` of the ``[b, q, h, d]`` output.

        Laid out ``[b, t, h, d]``, as the projections' outputs they flow back to are.
        """
        b, h, tq, d = query.shape
        g, tk = key.shape[1], key.shape[2]
        dq = query.new_empty(b, tq, h, d).transpose(1, 2)
        dk = key.new_empty(b, tk, g, d).transpose(1, 2)
        dv = value.new_empty(b, tk, g, d).transpose(1, 2)
        dout = grad.transpose(1, 2)
        dout_strides = _blas_strides(dout)
        if dout_strides is None:
            dout = grad.contiguous().transpose(1, 2)
            dout_strides = self.strides_of(dout)
        inputs = self.shape(query, key, [*self.strides, dout_strides])
        grads = self.shape(query, key, [*map(self.strides_of, (dq, dk, dv)), dout_strides])
        status = self.kernels["attention_backward"](
            self.gemm, torch.get_num_threads(), ctypes.byref(inputs), ctypes.byref(grads),
            dout.data_ptr(), query.data_ptr(), key.data_ptr(), value.data_ptr(),
            probs.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), self.scale,
            self.seed, self.q, self.dscale,
        )  # fmt: skip
        _check_status(status)
        return dq, dk, dv


def _check_status(status: int) -> None:
    if status != 0:
        raise MemoryError("the fused attention kernel could not allocate its rows of scores")


def _fused_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    p: float,
    scale: float,
    causal: bool,
) -> torch.Tensor | None:
    """Attention with dropout by the fused native kernels (``[b, q, h, d]``), or None.

    None, for the caller's path, unless query, key and value are float32 CPU
    ``[b, h, t, d]`` tensors that BLAS can read where they lie (any head and
    token strides; no copies), and the native kernels and a BLAS ``sgemm``
    are at hand. Heads share key/value heads in groups (grouped-query).
    """
    tensors = (query, key, value)
    if any(t.device.type != "cpu" or t.dtype != torch.float32 or t.dim() != 4 for t in tensors):
        return None
    if (
        key.shape != value.shape
        or key.shape[0] != query.shape[0]
        or key.shape[-1] != query.shape[-1]
    ):
        return None
    if query.shape[1] % key.shape[1] or query.numel() == 0 or key.shape[2] == 0:
        return None
    if max(*query.shape[2:], key.shape[2]) > _BLAS_INT_MAX:
        return None
    kernels, gemm = _native.native_kernels(), blas_sgemm()
    strides = [_blas_strides(t) for t in tensors]
    if kernels is None or gemm is None or None in strides:
        return None
    run = _FusedAttention(causal, scale, p, kernels, gemm, strides)  # type: ignore[arg-type]
    if _native.tracked(*tensors):
        return _NativeAttention.apply(query, key, value, run)  # type: ignore[no-any-return]
    return run.forward(query, key, value, keep_probs=False)[0]


def attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The ``sdpa`` attention of transformers, with :func:`dropout` on the weights when training.

    Arguments and masks are those of
    ``transformers.integrations.sdpa_attention.sdpa_attention_forward``
    (``[batch, heads, q, d]`` tensors, a boolean mask that is True where a
    position may attend, a float mask to add, or None for causal); the
    output is ``[batch, q, heads, d]``.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    explicit = (
        dropout > 0.0
        and module.training
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and not kwargs.get("output_attentions", False)
    )
    if not explicit:
        return sdpa_attention_forward(  # type: ignore[no-any-return]
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    probe = getattr(_PROBE, "checks", None)
    if probe is not None:
        # The train-mode probe of train_copy: the explicit maths, dropping nothing, must
        # equal sdpa without dropout on the arguments the model passes in training.
        mine = _attention_math(query, key, value, attention_mask, _PROBE_P, scaling, causal)
        theirs = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=0.0, scaling=scaling,
            is_causal=is_causal, **kwargs,
        )[0]  # fmt: skip
        probe.append(
            mine.shape == theirs.shape
            and bool(torch.allclose(mine, theirs.to(mine.dtype), rtol=1e-5, atol=1e-6))
        )
    return _attention_math(query, key, value, attention_mask, dropout, scaling, causal), None


def _attention_math(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    p: float,
    scaling: float | None,
    causal: bool,
) -> torch.Tensor:
    """``softmax(q k^T * scaling + mask)`` with :func:`dropout`, times ``v``: ``[b, q, h, d]``."""
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    if mask is None:
        fused = _fused_attention(query, key, value, p, scale, causal)
        if fused is not None:
            return fused
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` heads
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    q_len, k_len = query.shape[2], key.shape[2]
    scores = torch.matmul(query, key.transpose(-1, -2))
    kernels = _native.native_for(scores) if mask is None else None
    if kernels is not None:
        # One pass: scale, the causal mask, softmax and dropout (gs_softmax_dropout_f32).
        q, dscale = drop_rule(p)
        weights = _NativeSoftmaxDropout.apply(
            scores, scale, causal, draw_seed(stream()), q, dscale, kernels
        )
        return torch.matmul(weights.to(value.dtype), value).transpose(1, 2).contiguous()
    scores = scores.mul_(scale)
    lowest = torch.finfo(scores.dtype).min
    hidden: torch.Tensor | None = None
    if mask is None:
        if causal and q_len > 1:
            # sdpa's is_causal: query i (aligned to the last keys) sees keys <= i + k - q.
            allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device)
            scores.masked_fill_(~allowed.tril_(k_len - q_len), lowest)
    elif mask.dtype == torch.bool:
        mask = mask[..., :k_len]
        scores.masked_fill_(~mask, lowest)
        hidden = ~mask.any(dim=-1, keepdim=True)  # queries that see no key (padding)
    else:
        scores = scores + mask[..., :k_len]
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    if hidden is not None:
        weights = weights.masked_fill(hidden, 0.0)  # as sdpa's safe softmax: output 0
    out = torch.matmul(dropout(weights, p), value)
    return out.transpose(1, 2).contiguous()


def _register() -> bool:
    """Register :func:`attention` (with ``sdpa``'s masks) under :data:`ATTENTION_NAME`, once.

    False, registering nothing, where transformers lacks the interfaces
    (``AttentionInterface`` and ``masking_utils``, from 4.53; the ``hf``
    extra asks for 5.0): the working copy then keeps ``sdpa``.
    """
    global _REGISTERED
    with _REGISTER_LOCK:
        if _REGISTERED:
            return True
        try:
            from transformers import AttentionInterface
            from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
        except ImportError as err:
            logger.warning(
                "gradsketch: transformers %s lacks the attention interfaces of 4.53 (%s); the "
                "sampler's working copy keeps sdpa (pip install 'transformers>=5.0')",
                _transformers_version(),
                err,
            )
            return False
        AttentionInterface.register(ATTENTION_NAME, attention)
        AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
        _REGISTERED = True
        return True


def _transformers_version() -> str:
    try:
        import transformers
    except ImportError:  # pragma: no cover - transformers is in the hf extra
        return "(not installed)"
    return str(getattr(transformers, "__version__", "?"))


def swap_attention(work: nn.Module, probe: Callable[[], Any]) -> bool:
    """Make the working copy ``work`` run :func:`attention` if ``probe()`` shows sdpa's output.

    ``probe()`` runs ``work`` in train mode on a few rows; every attention
    call with dropout is then also computed by the explicit maths dropping
    nothing and by transformers' ``sdpa`` without dropout, which must agree.
    A model whose attention is not ``"sdpa"``, is never called with dropout
    in training (dropout 0), or whose mask code does not follow the
    interface, keeps its own.

    Returns:
        Whether ``work`` now runs :func:`attention`.
    """
    config: Any = getattr(work, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not _register():
        return False
    checks: list[bool] = []
    config._attn_implementation = ATTENTION_NAME
    _PROBE.checks = checks
    try:
        probe()
    except Exception:  # any failure keeps the model's own attention
        checks.append(False)
    finally:
        _PROBE.checks = None
    if not checks or not all(checks):
        config._attn_implementation = "sdpa"
        return False
    return True
