"""The SLT sampler's native train-mode kernels: a library of their own (``csrc/gs_train.c``).

Seeded dropout, GELU's tanh form, attention's softmax with dropout (and the
fused attention through the caller's BLAS ``sgemm``), the per-token
cross-entropy, RMSNorm, SwiGLU and the rotary embedding, forward and backward, for
:mod:`gradsketch.slt._train_forward`. Compiled at first use and cached by
:mod:`gradsketch._native_build`, separately from the sketch kernels:
``GRADSKETCH_NATIVE_TRAIN=0`` turns these off alone, ``GRADSKETCH_NATIVE=0``
both. Where the library cannot be built or loaded the working copy runs
torch's operations (one log line says why).

Example:
    >>> status = train_status()
    >>> status.available == (train_library() is not None)
    True
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

from gradsketch import _native_build
from gradsketch._native_build import NativeStatus, blas_sgemm

__all__ = ["ABI_VERSION", "SPEC", "blas_sgemm", "train_library", "train_status"]

#: Must equal ``gs_train_abi_version()`` in ``csrc/gs_train.c``.
ABI_VERSION = 3
#: The library's source (package data) and the kernels it must export.
SPEC = _native_build.NativeSpec(
    name="train",
    source_dir=Path(__file__).with_name("csrc"),
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

_lock = threading.Lock()
_state: tuple[NativeStatus, ctypes.CDLL | None] | None = None


def _loaded() -> tuple[NativeStatus, ctypes.CDLL | None]:
    global _state
    state = _state
    if state is None:
        with _lock:
            if _state is None:
                _state = _native_build.load(SPEC)
                _native_build.report_fallback(SPEC, _state[0], "torch's operations")
            state = _state
    return state


def train_library() -> ctypes.CDLL | None:
    """The loaded train-kernel library, compiling it first if needed (None when unavailable)."""
    return _loaded()[1]


def train_status() -> NativeStatus:
    """Whether the train kernels are in use, and why not when they are not."""
    return _loaded()[0]
