"""The sampler's working copy of a model: the same train-mode function, faster on CPU.

SGMCMC chains run the model in train mode, as devinterp does, so every
forward pass draws dropout masks, and on CPU the train-mode forward of a
Hugging Face model spends about as much time in element-wise operations as
in its matrix products. :func:`train_copy` returns a deep copy (the
caller's model is never changed) whose pieces compute the same function
with fewer passes over memory:

* ``nn.Dropout`` modules become :class:`SeededDropout` (:func:`dropout`):
  a mask keeps an element with probability ``1 - q / 65536``, ``q =
  round(p * 65536)``, from 16 random bits per element, and scales kept ones
  by ``65536 / (65536 - q)``, so the output's expectation is exactly the
  input; the drop probability differs from ``p`` by at most ``2**-17``
  (``p = 0.1``: ``0.1000061``). torch's ``bernoulli_`` draws a double per
  element instead.
* Attention with dropout (PyTorch's fused kernels take none on CPU, so
  ``sdpa`` falls back to its slower math path) runs :func:`attention`:
  on CPU float32, one native kernel per batch and head computes the scores
  with BLAS ``sgemm`` from query, key and value where they lie (the
  head-major views of a projection: no copies), then scale, causal mask,
  softmax and dropout in cache, then the values into the ``[b, q, h, d]``
  output; elsewhere the same in torch operations. Without dropout (eval
  mode, or models whose attention dropout is 0) it is ``sdpa`` itself. It
  replaces ``"sdpa"`` (transformers' default) only if the copy's eval-mode
  loss still equals the model's (checked).
* transformers' ``gelu_new``, ``gelu_fast`` and ``gelu_pytorch_tanh``
  activations and ``nn.GELU(approximate="tanh")`` (five element-wise ops,
  or one slow ``tanh`` kernel) become :class:`TanhGELU`: the same function
  as ``x * sigmoid(2u)``.
* Llama-style RMSNorm and SwiGLU MLP modules become
  :mod:`gradsketch.slt._fused_blocks`' one-pass versions (where a probe
  gives the module's own output).
* The rotary embedding of queries and keys (transformers'
  ``apply_rotary_pos_emb``) runs :mod:`gradsketch.slt._rotary`'s one-pass
  kernel, the same bits as the model's own (where the train-mode probe
  shows them).
* :func:`token_cross_entropy` (used by
  :func:`~gradsketch.slt.per_token_loss`) reads the logits once.

On contiguous CPU float32 tensors these run the native kernels of
``csrc/gs_train.c`` (a library of their own, :mod:`gradsketch.slt._train_native`),
forward and backward, with errors against float64 no larger than torch's
own kernels'. Where autograd records nothing (observable passes) the
kernels run without autograd nodes. Elsewhere (other dtypes or devices, no
C compiler, ``GRADSKETCH_NATIVE_TRAIN=0`` or ``GRADSKETCH_NATIVE=0``) torch's
operations compute the same, with the same dropout masks: the bits are one
counter-based hash (:func:`dropout_bits`, SplitMix64 of the element's index
under one seed per call drawn from the stream) in C and in torch, so a
backward pass recomputes its mask instead of storing it, and a seed gives
the same chains with and without a C compiler.

Every dropout mask of the copy comes from the generator installed by
:func:`dropout_stream` in the calling thread (torch's default generator
when none is), so a chain's masks depend on its seed only: chains may run
in threads of one process and give the bits they give one after another
(:func:`uses_global_generator` tells whether anything else in a model's
forward still draws from torch's global generator). Timings:
``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from gradsketch.slt._train_native import blas_sgemm, train_library

__all__ = [
    "ATTENTION_NAME",
    "FAST_PATHS",
    "SeededDropout",
    "TanhGELU",
    "attention",
    "dropout",
    "dropout_bits",
    "dropout_stream",
    "engaged",
    "fast_kernels",
    "token_cross_entropy",
    "train_copy",
    "uses_global_generator",
]

logger = logging.getLogger(__name__)

#: The name :func:`attention` is registered under in transformers' interfaces.
ATTENTION_NAME = "gradsketch_sdpa"
#: Values of ``sample(..., fast_path=...)``: the working copy's pieces and kernels where
#: they engage (CPU), or the model's own modules and torch's operations.
FAST_PATHS = ("auto", "off")
#: Dropout probability the train-mode probe of the attention runs with: explicit maths
#: (``dropout > 0``) that drops nothing (``round(p * 65536) = 0``), so it must equal sdpa.
_PROBE_P = 1e-9

_BITS = 65536  # 16 random bits per element
_STREAM = threading.local()
_REGISTER_LOCK = threading.Lock()
_REGISTERED = False
#: ``(library, its kernels by name)`` as last bound.
_BOUND: tuple[Any, dict[str, Any]] | None = None


class _AttnShape(ctypes.Structure):
    """``gs_attn_shape``: the sizes and element strides of one fused attention call."""

    _fields_ = [
        *((name, ctypes.c_int64) for name in ("batch", "heads", "kv_heads", "q_len", "k_len", "d")),
        *((name, ctypes.c_int64 * 3) for name in ("q", "k", "v", "o")),
    ]


#: BLAS takes 32-bit sizes and strides.
_BLAS_INT_MAX = 2**31 - 1
#: Batch, head and token strides of a ``[b, h, t, d]`` tensor (:func:`_blas_strides`).
_Strides = tuple[int, int, int]


def _drop_rule(p: float) -> tuple[int, float]:
    """``(q, scale)``: drop when 16 random bits are below ``q``; scale kept elements.

    ``q = round(p * 65536)`` and ``scale = 65536 / (65536 - q)``, so the
    expectation is exact (:func:`dropout`; the fused attention kernel too).
    """
    q = round(p * _BITS)
    return q, _BITS / (_BITS - q)


def _stream() -> torch.Generator | None:
    """The :func:`dropout_stream` generator of the calling thread (None: torch's default)."""
    return getattr(_STREAM, "generator", None)


def _native_kernels() -> dict[str, Any] | None:
    """``gs_train.c``'s kernels from the train library (None without one).

    Bound once per library object: the library in use is asked for on every
    call, so a change of it (the tests load other builds) is followed.
    """
    global _BOUND
    if getattr(_STREAM, "plain", False):  # fast_kernels(False) in this thread
        return None
    lib = train_library()
    if lib is None:
        return None
    bound = _BOUND
    if bound is not None and bound[0] is lib:
        return bound[1]
    with _REGISTER_LOCK:
        ptr, size = ctypes.c_void_p, ctypes.c_int64
        signatures: dict[str, tuple[str, list[Any]]] = {
            "dropout": (
                "gs_dropout_f32",
                [ptr, ptr, size, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_float],
            ),
            "gelu": ("gs_gelu_tanh_f32", [ptr, ptr, size]),
            "gelu_backward": ("gs_gelu_tanh_backward_f32", [ptr, ptr, ptr, size]),
            "softmax_dropout": (
                "gs_softmax_dropout_f32",
                [ptr, ptr, ptr, size, size, size, ctypes.c_int, ctypes.c_float,
                 ctypes.c_uint64, ctypes.c_uint32, ctypes.c_float],
            ),
            "softmax_dropout_backward": (
                "gs_softmax_dropout_backward_f32",
                [ptr, ptr, ptr, size, size, ctypes.c_float, ctypes.c_uint64,
                 ctypes.c_uint32, ctypes.c_float],
            ),
            "attention": (
                "gs_attention_f32",
                [ptr, ctypes.c_int, ctypes.POINTER(_AttnShape), ptr, ptr, ptr, ptr, ptr,
                 ctypes.c_int, ctypes.c_float, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_float],
            ),
            "attention_backward": (
                "gs_attention_backward_f32",
                [ptr, ctypes.c_int, ctypes.POINTER(_AttnShape), ctypes.POINTER(_AttnShape), ptr,
                 ptr, ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_float, ctypes.c_uint64,
                 ctypes.c_uint32, ctypes.c_float],
            ),
            "xent": ("gs_token_xent_f32", [ptr, ptr, ptr, ptr, size, size]),
            "xent_backward": ("gs_token_xent_backward_f32", [ptr, ptr, ptr, ptr, ptr, size, size]),
            "rmsnorm": ("gs_rmsnorm_f32", [ptr, ptr, ptr, ptr, size, size, ctypes.c_float]),
            "rmsnorm_backward": (
                "gs_rmsnorm_backward_f32", [ptr, ptr, ptr, ptr, ptr, ptr, size, size]
            ),
            "swiglu": ("gs_swiglu_f32", [ptr, ptr, size, ptr, size, size]),
            "swiglu_backward": (
                "gs_swiglu_backward_f32", [ptr, ptr, ptr, size, ptr, ptr, size, size, size]
            ),
            "rotary": (
                "gs_rotary_f32",
                [ptr, ptr, ptr, ptr, ptr, ptr, ptr, size, size, size, size, size, ctypes.c_int],
            ),
        }  # fmt: skip
        kernels = {}
        for name, (symbol, argtypes) in signatures.items():
            fn = getattr(lib, symbol)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int if symbol.startswith("gs_attention") else None
            kernels[name] = fn
        _BOUND = (lib, kernels)
    return kernels


def _tracked(*tensors: torch.Tensor) -> bool:
    """Whether autograd records an op on ``tensors`` (else the kernels run without a node)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _native_for(x: torch.Tensor) -> dict[str, Any] | None:
    """The native kernels when ``x`` suits them (contiguous float32 on CPU), else None."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or not x.is_contiguous():
        return None
    return _native_kernels()


def _dropout_kernel(x: torch.Tensor, seed: int, q: int, scale: float, fn: Any) -> torch.Tensor:
    y = torch.empty_like(x)
    fn(x.data_ptr(), y.data_ptr(), x.numel(), seed, q, scale)
    return y


class _NativeDropout(torch.autograd.Function):
    """``gs_dropout_f32`` forward; backward applies the same (seed-determined) mask."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seed: int, q: int, scale: float, fn: Any) -> Any:
        ctx.args = (seed, q, scale, fn)
        return _dropout_kernel(x, seed, q, scale, fn)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        seed, q, scale, fn = ctx.args
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        fn(grad.data_ptr(), out.data_ptr(), grad.numel(), seed, q, scale)
        return out, None, None, None, None


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


def _xent_kernel(
    logits: torch.Tensor, targets: torch.Tensor, kernels: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, log-sum-exp)`` per row of ``[rows, vocab]`` logits."""
    rows, vocab = logits.shape
    loss = torch.empty(rows, dtype=logits.dtype)
    lse = torch.empty(rows, dtype=logits.dtype)
    kernels["xent"](
        logits.data_ptr(), targets.data_ptr(), loss.data_ptr(), lse.data_ptr(), rows, vocab
    )
    return loss, lse


class _NativeTokenCrossEntropy(torch.autograd.Function):
    """``gs_token_xent_f32``: per-row cross-entropy in one pass over the logits."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, kernels: Any) -> Any:
        loss, lse = _xent_kernel(logits, targets, kernels)
        ctx.save_for_backward(logits, targets, lse)
        ctx.kernels = kernels
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        logits, targets, lse = ctx.saved_tensors
        grad = grad.contiguous()
        out = torch.empty_like(logits)
        ctx.kernels["xent_backward"](
            grad.data_ptr(), logits.data_ptr(), targets.data_ptr(), lse.data_ptr(),
            out.data_ptr(), *logits.shape,
        )  # fmt: skip
        return out, None, None


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
        self.q, self.dscale = _drop_rule(p)
        self.seed = _seed(_stream())

    @staticmethod
    def shape(query: torch.Tensor, key: torch.Tensor, strides: list[_Strides]) -> _AttnShape:
        """The kernels' record: sizes, and strides of query, key, value and output.

        (Or of their gradients, in the same order.)
        """
        b, h, tq, d = query.shape
        return _AttnShape(b, h, key.shape[1], tq, key.shape[2], d, *strides)

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
    kernels, gemm = _native_kernels(), blas_sgemm()
    strides = [_blas_strides(t) for t in tensors]
    if kernels is None or gemm is None or None in strides:
        return None
    run = _FusedAttention(causal, scale, p, kernels, gemm, strides)  # type: ignore[arg-type]
    if _tracked(*tensors):
        return _NativeAttention.apply(query, key, value, run)  # type: ignore[no-any-return]
    return run.forward(query, key, value, keep_probs=False)[0]


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``F.cross_entropy(logits, targets, reduction="none")`` with ``ignore_index=-100``.

    ``[rows, vocab]`` logits and int64 ``[rows]`` targets; one native pass on
    contiguous CPU float32 logits (log-sum-exp and the target's logit), torch's
    ``cross_entropy`` otherwise.

    Example:
        >>> logits = torch.randn(3, 5)
        >>> targets = torch.tensor([1, -100, 4])
        >>> want = F.cross_entropy(logits, targets, reduction="none")
        >>> torch.allclose(token_cross_entropy(logits, targets), want, atol=1e-6)
        True
    """
    kernels = _native_for(logits)
    if kernels is None or logits.dim() != 2 or targets.dtype != torch.int64:
        return F.cross_entropy(logits, targets, reduction="none")
    if not _tracked(logits):
        return _xent_kernel(logits, targets.contiguous(), kernels)[0]
    return _NativeTokenCrossEntropy.apply(logits, targets.contiguous(), kernels)  # type: ignore[no-any-return]


def _seed(generator: torch.Generator | None) -> int:
    """One 64-bit seed for a native kernel's hash, drawn from ``generator``."""
    word = torch.empty((), dtype=torch.int64).random_(-(2**63), None, generator=generator)
    return int(word) % 2**64


def _gelu_kernel(x: torch.Tensor, kernels: dict[str, Any]) -> torch.Tensor:
    y = torch.empty_like(x)
    kernels["gelu"](x.data_ptr(), y.data_ptr(), x.numel())
    return y


class _NativeGELU(torch.autograd.Function):
    """``gs_gelu_tanh_f32`` forward and ``gs_gelu_tanh_backward_f32`` backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, kernels: dict[str, Any]) -> Any:
        y = _gelu_kernel(x, kernels)
        ctx.save_for_backward(x)
        ctx.kernels = kernels
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        (x,) = ctx.saved_tensors
        grad = grad.contiguous()
        out = torch.empty_like(x)
        ctx.kernels["gelu_backward"](grad.data_ptr(), x.data_ptr(), out.data_ptr(), x.numel())
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
        kernels = _native_for(input)
        if kernels is None:
            return F.gelu(input, approximate="tanh")
        if not _tracked(input):
            return _gelu_kernel(input, kernels)
        return _NativeGELU.apply(input, kernels)  # type: ignore[no-any-return]


@contextlib.contextmanager
def dropout_stream(generator: torch.Generator | None) -> Iterator[None]:
    """Draw every :func:`dropout` mask of this thread from ``generator`` inside the block.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> with dropout_stream(g):
        ...     a = dropout(torch.ones(8), 0.5)
        >>> with dropout_stream(torch.Generator().manual_seed(0)):
        ...     b = dropout(torch.ones(8), 0.5)
        >>> torch.equal(a, b)
        True
    """
    before = _stream()
    _STREAM.generator = generator
    try:
        yield
    finally:
        _STREAM.generator = before


@contextlib.contextmanager
def fast_kernels(enabled: bool) -> Iterator[None]:
    """Inside the block this thread's pieces run the native kernels (False: torch's operations).

    ``sample(..., fast_path="off")`` runs its chains under ``fast_kernels(False)``,
    so that :func:`token_cross_entropy` too is torch's ``cross_entropy``.

    Example:
        >>> with fast_kernels(False):
        ...     _native_kernels() is None
        True
    """
    before = getattr(_STREAM, "plain", False)
    _STREAM.plain = not enabled
    try:
        yield
    finally:
        _STREAM.plain = before


def dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """``x`` with each element zeroed with probability ``q / 65536`` (``q = round(p * 65536)``).

    Kept elements are scaled by ``65536 / (65536 - q)``, so ``E[dropout(x)] =
    x`` exactly. The mask is :func:`dropout_bits` of one seed drawn from the
    thread's :func:`dropout_stream` generator, the same on the native kernel
    (CPU float32) and on torch's operations, and independent of ``x``'s
    values; gradients flow through the kept elements (with the same scale),
    as ``torch.nn.functional.dropout``'s do.

    Example:
        >>> y = dropout(torch.ones(4, 4), 0.25)
        >>> sorted({round(v, 4) for v in y.flatten().tolist()} - {0.0})
        [1.3333]
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"`p` must be in [0, 1), got {p!r}; pass a dropout probability.")
    q, scale = _drop_rule(p)
    if q == 0:
        return x
    generator = _stream()
    kernels = _native_for(x)
    if kernels is not None:
        args = (x, _seed(generator), q, scale, kernels["dropout"])
        return _NativeDropout.apply(*args) if _tracked(x) else _dropout_kernel(*args)  # type: ignore[no-any-return]
    keep = dropout_bits(_seed(generator), x.numel(), x.device).view(x.shape) >= q
    return x * keep.to(x.dtype).mul_(scale)


def _signed(value: int) -> int:
    """The int64 with the bits of the uint64 ``value``."""
    value %= 2**64
    return value - 2**64 if value >= 2**63 else value


_MIX = (_signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB))
_GOLDEN = _signed(0x9E3779B97F4A7C15)


def _shift_right(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 ``z`` read as uint64 (torch's ``>>`` is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def dropout_bits(seed: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 mask bits of elements ``0 .. n - 1`` under ``seed``: int32 ``[n]`` in [0, 65536).

    Element ``i``'s are lane ``i % 4`` (little-endian 16-bit lanes) of
    SplitMix64's output function of ``seed + (i // 4) * 0x9E3779B97F4A7C15``
    (Steele, Lea and Flood 2014), in uint64 arithmetic: the counter-based
    hash of ``gs_train.c`` (``gs_lanes``), so the torch fallback and the
    native kernels drop the same elements for the same seed.

    Example:
        >>> dropout_bits(1, 4).tolist()
        [1509, 4107, 5661, 22162]
    """
    blocks = torch.arange((n + 3) // 4, dtype=torch.int64, device=device)
    z = blocks * _GOLDEN + _signed(seed)  # int64 products wrap as uint64's do
    z = (z ^ _shift_right(z, 30)) * _MIX[0]
    z = (z ^ _shift_right(z, 27)) * _MIX[1]
    z = z ^ _shift_right(z, 31)
    # Lane l of word b is bits 16 l .. 16 l + 15: element 4 b + l.
    lanes = torch.stack([_shift_right(z, 16 * lane) & 0xFFFF for lane in range(4)], dim=1)
    return lanes.reshape(-1)[:n].to(torch.int32)


class SeededDropout(nn.Dropout):
    """``nn.Dropout`` drawing its masks through :func:`dropout` (same ``p``, same ``inplace``).

    Example:
        >>> layer = SeededDropout(0.1).eval()
        >>> torch.equal(layer(torch.ones(3)), torch.ones(3))
        True
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return input
        return dropout(input, self.p)


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
    probe = getattr(_STREAM, "probe", None)
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
    kernels = _native_for(scores) if mask is None else None
    if kernels is not None:
        # One pass: scale, the causal mask, softmax and dropout (gs_softmax_dropout_f32).
        q, dscale = _drop_rule(p)
        weights = _NativeSoftmaxDropout.apply(
            scores, scale, causal, _seed(_stream()), q, dscale, kernels
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


def _is_tanh_gelu(module: nn.Module) -> bool:
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


def _swap_modules(model: nn.Module, *, dropout_modules: bool) -> None:
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _is_tanh_gelu(child):
                setattr(parent, name, TanhGELU())
            elif dropout_modules and type(child) is nn.Dropout:
                swapped = SeededDropout(child.p, inplace=child.inplace)
                swapped.train(child.training)
                setattr(parent, name, swapped)


def train_copy(
    model: nn.Module,
    device: torch.device,
    *,
    loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    probe: torch.Tensor,
    fast_path: str = "auto",
) -> nn.Module:
    """A deep copy of ``model`` on ``device`` with the faster train-mode pieces (module docstring).

    The pieces are swapped on CPU only, and only with ``fast_path="auto"``
    (``"off"``, or any other device, gives the plain copy: on CUDA sdpa's
    fused kernels and torch's dropout are already fast, and the explicit
    attention would be O(T²) in memory). The attention swap is probed in
    train mode, where it runs: on ``probe`` (a few token rows) every
    attention call with dropout is also computed by the explicit maths
    dropping nothing and by transformers' ``sdpa`` without dropout, which
    must agree; a model whose attention is never called with dropout in
    training (dropout 0), or whose mask code does not follow the interface,
    keeps its own. :func:`engaged` says what was swapped.

    Raises:
        ValueError: for a ``fast_path`` not in :data:`FAST_PATHS`.

    Example:
        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> from gradsketch.slt._data import per_token_loss
        >>> m = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16))
        >>> fast = train_copy(m, torch.device("cpu"), loss_fn=per_token_loss,
        ...                   probe=torch.zeros(1, 4, dtype=torch.long))
        >>> type(fast.transformer.drop).__name__, fast.config._attn_implementation
        ('SeededDropout', 'gradsketch_sdpa')
        >>> m.config._attn_implementation
        'sdpa'
    """
    if fast_path not in FAST_PATHS:
        raise ValueError(
            f"`fast_path` must be one of {list(FAST_PATHS)}, got {fast_path!r}; 'off' runs "
            "the model's own modules with torch's operations."
        )
    work = copy.deepcopy(model).to(device)
    if fast_path == "off" or device.type != "cpu":
        return work
    _swap_modules(work, dropout_modules=True)
    # They build on this module.
    from gradsketch.slt._fused_blocks import swap_blocks
    from gradsketch.slt._rotary import swap_rotary

    swap_blocks(work)

    def train_mode_probe() -> None:
        # The probe's masks come from a generator of its own: torch's global one is
        # left as it was found (a loss_fn may still draw from it).
        was_training = work.training
        state = torch.random.get_rng_state()
        try:
            with dropout_stream(torch.Generator().manual_seed(0)), torch.inference_mode():
                loss_fn(work.train(), probe.to(device))
        finally:
            torch.random.set_rng_state(state)
            work.train(was_training)

    swap_rotary(work, train_mode_probe)
    config: Any = getattr(work, "config", None)
    if getattr(config, "_attn_implementation", None) == "sdpa" and _register():
        checks: list[bool] = []
        config._attn_implementation = ATTENTION_NAME
        _STREAM.probe = checks
        try:
            train_mode_probe()
        except Exception:  # any failure keeps the model's own attention
            checks.append(False)
        finally:
            _STREAM.probe = None
        if not checks or not all(checks):
            config._attn_implementation = "sdpa"
    return work


def engaged(model: nn.Module) -> dict[str, Any]:
    """What of the fast path a working copy runs: ``{"modules": [...], "kernels": ...}``.

    ``modules``: the pieces :func:`train_copy` swapped in (``"attention"``,
    ``"dropout"``, ``"gelu"``, ``"rmsnorm"``, ``"rotary"``, ``"swiglu"``); ``kernels``:
    ``"native"`` when the train library is loaded and the copy is on CPU
    (float32 tensors then run it, and so does :func:`token_cross_entropy`),
    else ``"torch"``.

    Example:
        >>> engaged(nn.Sequential(SeededDropout(0.1)))["modules"]
        ['dropout']
    """
    # They build on this module.
    from gradsketch.slt._fused_blocks import FusedRMSNorm, SwiGLU
    from gradsketch.slt._rotary import swapped

    names = set()
    for module in model.modules():
        if isinstance(module, SeededDropout):
            names.add("dropout")
        elif isinstance(module, TanhGELU):
            names.add("gelu")
        elif isinstance(module, FusedRMSNorm):
            names.add("rmsnorm")
        elif isinstance(module, SwiGLU):
            names.add("swiglu")
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == ATTENTION_NAME:
        names.add("attention")
    if swapped(model):
        names.add("rotary")
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    native = on_cpu and not getattr(_STREAM, "plain", False) and train_library() is not None
    return {"modules": sorted(names), "kernels": "native" if native else "torch"}


def skip_seeds(generator: torch.Generator, count: int) -> None:
    """Draw ``count`` dropout seeds from ``generator`` and drop them (see :func:`stream_draws`)."""
    for _ in range(count):
        _seed(generator)


def stream_draws(
    forward: Callable[[], Any], device: torch.device | str = "cpu", *, limit: int = 4096
) -> int | None:
    """How many dropout seeds ``forward()`` draws from the thread's :func:`dropout_stream`.

    None when it draws from torch's global generator, or takes from the
    stream other than whole seeds (or more than ``limit``): then no count of
    :func:`skip_seeds` leaves the stream where ``forward()`` would.

    Example:
        >>> net = nn.Sequential(nn.Embedding(4, 4), SeededDropout(0.5), SeededDropout(0.5))
        >>> stream_draws(lambda: net.train()(torch.zeros(1, 3, dtype=torch.long)))
        2
        >>> stream_draws(lambda: nn.Dropout(0.5).train()(torch.ones(3)))  # global generator
    """
    probe = torch.Generator(device=device).manual_seed(0)
    cuda = torch.cuda.is_available() and torch.device(device).type == "cuda"
    if _draws_globally(forward, probe, cuda=cuda):
        return None
    after = probe.get_state()
    replay = torch.Generator(device=device).manual_seed(0)
    for count in range(limit + 1):
        if torch.equal(replay.get_state(), after):
            return count
        _seed(replay)
    return None


def _draws_globally(forward: Callable[[], Any], stream: torch.Generator, *, cuda: bool) -> bool:
    """Whether ``forward()`` on ``stream`` draws from torch's global generator.

    Run in inference mode; the CPU generator is checked, and the current CUDA
    one with ``cuda``. Their states are restored.
    """
    before = torch.random.get_rng_state()
    before_cuda = torch.cuda.get_rng_state() if cuda else None
    try:
        with dropout_stream(stream), torch.inference_mode():
            forward()
        return not torch.equal(before, torch.random.get_rng_state()) or (
            before_cuda is not None and not torch.equal(before_cuda, torch.cuda.get_rng_state())
        )
    finally:
        torch.random.set_rng_state(before)
        if before_cuda is not None:
            torch.cuda.set_rng_state(before_cuda)


def uses_global_generator(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    probe: torch.Tensor,
) -> bool:
    """Whether a train-mode ``loss_fn(model, probe)`` draws from torch's global CPU generator.

    Chains may share a process only when it does not (their dropout then
    comes from each chain's own :func:`dropout_stream`).

    Example:
        >>> net = nn.Sequential(nn.Embedding(4, 4), SeededDropout(0.5))
        >>> loss = lambda m, ids: m(ids).sum(-1)[:, 1:]
        >>> uses_global_generator(net, loss, torch.zeros(1, 3, dtype=torch.long))
        False
        >>> uses_global_generator(nn.Sequential(nn.Embedding(4, 4), nn.Dropout(0.5)), loss,
        ...                       torch.zeros(1, 3, dtype=torch.long))
        True
    """
    was_training = model.training
    try:
        stream = torch.Generator(device=probe.device)
        return _draws_globally(lambda: loss_fn(model.train(), probe), stream, cuda=False)
    finally:
        model.train(was_training)
