"""The fast path's native kernels: the train library of ``csrc/gs_train.c`` and its bindings.

Seeded dropout, GELU's tanh form, attention's softmax with dropout (and the
fused attention through the caller's BLAS ``sgemm``), the per-token
cross-entropy, RMSNorm, SwiGLU and the rotary embedding, forward and
backward, for the working copy's pieces (:mod:`gradsketch.slt._fast`).
Compiled at first use and cached by :mod:`gradsketch._native_build`,
separately from the sketch kernels: ``GRADSKETCH_NATIVE_TRAIN=0`` turns these
off alone, ``GRADSKETCH_NATIVE=0`` both. Where the library cannot be built or
loaded the working copy runs torch's operations (one log line says why).

Every piece asks :func:`native_kernels` through this module at each call (a
test that swaps the loader swaps it everywhere), and :func:`fast_kernels`
switches them off in one thread.

Example:
    >>> status = train_status()
    >>> status.available == (train_library() is not None)
    True
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from gradsketch import _native_build
from gradsketch._native_build import NativeStatus, blas_sgemm

__all__ = [
    "ABI_VERSION",
    "SPEC",
    "AttnShape",
    "blas_sgemm",
    "fast_kernels",
    "keep",
    "kept",
    "native_for",
    "native_kernels",
    "plain",
    "tracked",
    "train_library",
    "train_status",
]

#: Must equal ``gs_train_abi_version()`` in ``csrc/gs_train.c``.
ABI_VERSION = 3
#: The library's source (package data, ``slt/csrc``) and the kernels it must export.
SPEC = _native_build.NativeSpec(
    name="train",
    source_dir=Path(__file__).parent.parent / "csrc",
    sources=("gs_train.c",),
    abi_version=ABI_VERSION,
    symbols=(
        "gs_dropout_f32",
        "gs_gelu_tanh_f32",
        "gs_gelu_tanh_backward_f32",
        "gs_softmax_dropout_f32",
        "gs_softmax_dropout_backward_f32",
        "gs_attention_f32",
        "gs_attention_backward_f32",
        "gs_token_xent_f32",
        "gs_token_xent_backward_f32",
        "gs_rmsnorm_f32",
        "gs_rmsnorm_backward_f32",
        "gs_swiglu_f32",
        "gs_swiglu_backward_f32",
        "gs_rotary_f32",
    ),
    abi_symbol="gs_train_abi_version",
)

#: The library, loaded at first use (tests set ``_LOADED.state`` to force a fresh load).
_LOADED = _native_build.OnceLoaded(SPEC, lambda: _native_build.load(SPEC), "torch's operations")


def train_library() -> ctypes.CDLL | None:
    """The loaded train-kernel library, compiling it first if needed (None when unavailable)."""
    return _LOADED.get()


def train_status() -> NativeStatus:
    """Whether the train kernels are in use, and why not when they are not."""
    return _LOADED.status()


#: This thread's switch (:func:`fast_kernels`): ``.plain`` set, the kernels are off.
_LOCAL = threading.local()
_BIND_LOCK = threading.Lock()
#: ``(library, its kernels by name)`` as last bound.
_BOUND: tuple[Any, dict[str, Any]] | None = None


class AttnShape(ctypes.Structure):
    """``gs_attn_shape``: the sizes and element strides of one fused attention call."""

    _fields_ = [
        *((name, ctypes.c_int64) for name in ("batch", "heads", "kv_heads", "q_len", "k_len", "d")),
        *((name, ctypes.c_int64 * 3) for name in ("q", "k", "v", "o")),
    ]


def native_kernels() -> dict[str, Any] | None:
    """``gs_train.c``'s kernels from the train library (None without one).

    Bound once per library object: the library in use is asked for on every
    call, so a change of it (the tests load other builds) is followed.
    """
    global _BOUND
    if plain():  # fast_kernels(False) in this thread
        return None
    lib = train_library()
    if lib is None:
        return None
    bound = _BOUND
    if bound is not None and bound[0] is lib:
        return bound[1]
    with _BIND_LOCK:
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
                [ptr, ctypes.c_int, ctypes.POINTER(AttnShape), ptr, ptr, ptr, ptr, ptr,
                 ctypes.c_int, ctypes.c_float, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_float],
            ),
            "attention_backward": (
                "gs_attention_backward_f32",
                [ptr, ctypes.c_int, ctypes.POINTER(AttnShape), ctypes.POINTER(AttnShape), ptr,
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


def tracked(*tensors: torch.Tensor) -> bool:
    """Whether autograd records an op on ``tensors`` (else the kernels run without a node)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def keep(ctx: Any, kernels: dict[str, Any], *tensors: torch.Tensor) -> None:
    """Save what a kernel's backward reads, ``tensors`` and ``kernels`` (see :func:`kept`)."""
    ctx.save_for_backward(*tensors)
    ctx.kernels = kernels


def kept(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, tuple[Any, ...], dict[str, Any]]:
    """``(contiguous grad, saved tensors, kernels)`` in a backward: what :func:`keep` saved."""
    return grad.contiguous(), ctx.saved_tensors, ctx.kernels


def native_for(x: torch.Tensor) -> dict[str, Any] | None:
    """The native kernels when ``x`` suits them (contiguous float32 on CPU), else None."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or not x.is_contiguous():
        return None
    return native_kernels()


@contextlib.contextmanager
def fast_kernels(enabled: bool) -> Iterator[None]:
    """Inside the block this thread's pieces run the native kernels (False: torch's operations).

    ``sample(..., fast_path="off")`` runs its chains under ``fast_kernels(False)``,
    so that :func:`~gradsketch.slt._fast.token_cross_entropy` too is torch's ``cross_entropy``.

    Example:
        >>> with fast_kernels(False):
        ...     native_kernels() is None
        True
    """
    before = getattr(_LOCAL, "plain", False)
    _LOCAL.plain = not enabled
    try:
        yield
    finally:
        _LOCAL.plain = before


def plain() -> bool:
    """Whether :func:`fast_kernels` switched the kernels off in this thread."""
    return bool(getattr(_LOCAL, "plain", False))
