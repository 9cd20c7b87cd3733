"""Which kernels run the sketches' hot loops: native C, Triton or torch.

Three operations have a fast implementation beside their torch twin:

* ``"scatter"``: add the columns of a block into a count-sketch accumulator
  through a folded table (and, for the sampler, take the Gram matrix of the
  same rows): the native CPU kernels of :mod:`gradsketch.sketch._native`, or
  torch's ``index_add_`` / ``scatter_add_`` and ``bmm``.
* ``"hashed"``: a count sketch whose buckets and signs are hashed in registers,
  never read from a table: the Triton kernel, or a table and the scatter.
* ``"dense"``: a dense JL map generated tile by tile in registers: the Triton
  kernel (float32), or torch's tile-by-tile matmul.

:func:`default_backend` is the one place that chooses between them (the way
``torch.optim`` decides between its fused, foreach and for-loop paths): the
sketch and sampling code ask it, and call the kernels through this module.
The user's option is ``backend=`` where a caller passes it, else the
environment: ``GRADSKETCH_NATIVE_SKETCH=0`` (or ``GRADSKETCH_NATIVE=0``)
turns the native kernels off and
``GRADSKETCH_TRITON`` (``auto``: CUDA tensors only; ``1``: wherever Triton
runs; ``0``: never) steers the Triton ones. Every choice gives the same
results up to the order of float additions.

Example:
    >>> default_backend(torch.device("cpu"), kernel="scatter") in ("native", "torch")
    True
    >>> default_backend(torch.device("cpu"), kernel="dense", backend="torch")
    'torch'
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import torch

from gradsketch.sketch import _native, _tables
from gradsketch.sketch._native import NativeStatus, blas_sgemm, native_status

__all__ = [
    "BACKENDS",
    "KERNELS",
    "NativeStatus",
    "blas_sgemm",
    "buckets_and_signs",
    "default_backend",
    "native_status",
    "reduce_",
    "reduce_rows_",
    "triton",
]

#: Every backend name ``default_backend`` returns or accepts (besides ``"auto"``).
BACKENDS: tuple[str, ...] = ("native", "triton", "torch")

#: The backends of each operation, fastest first; ``"torch"`` runs everywhere.
KERNELS: dict[str, tuple[str, ...]] = {
    "scatter": ("native", "torch"),
    "hashed": ("triton", "torch"),
    "dense": ("triton", "torch"),
}

#: Value types the native scatter takes.
_NATIVE_DTYPES = (torch.float32, torch.float64)


def _triton_wanted(device: torch.device) -> bool:
    """Whether the Triton kernels run for ``device`` (``GRADSKETCH_TRITON``, see the module).

    Decided without importing triton for CPU devices under ``auto``: CPU users
    never pay for importing it (about 70 MB and half a second) unless
    ``GRADSKETCH_TRITON`` asks for the kernels (e.g. ``1`` with
    ``TRITON_INTERPRET=1`` in the tests).
    """
    mode = os.environ.get("GRADSKETCH_TRITON", "auto").strip().lower()
    if device.type != "cuda" and mode in ("", "auto"):
        return False
    return triton().use_triton(device)


def triton() -> ModuleType:
    """The Triton kernels module (imported on first call; ask :func:`default_backend` first).

    Example:
        >>> hasattr(triton(), "triton_count_sketch")
        True
    """
    from gradsketch.sketch import _triton

    return _triton


def _check_choice(kernel: str, backend: str | None) -> str:
    if kernel not in KERNELS:
        raise ValueError(f"`kernel` must be one of {list(KERNELS)}, got {kernel!r}.")
    requested = "auto" if backend is None else backend
    allowed = ("auto", *KERNELS[kernel])
    if requested not in allowed:
        raise ValueError(
            f"`backend` for the {kernel!r} kernel must be one of {list(allowed)}, got "
            f"{backend!r}; leave it None (or 'auto') to let the device and the "
            "environment decide."
        )
    return requested


def default_backend(
    device: torch.device | torch.Tensor,
    *,
    kernel: str,
    dtype: torch.dtype | None = None,
    backend: str | None = None,
) -> str:
    """The backend that runs ``kernel`` on ``device`` for values of ``dtype``.

    ``"auto"`` (``None``) takes the first backend of :data:`KERNELS` that can
    run here: the native kernels for a CPU scatter of float32/float64 values
    when they are built and loaded (:func:`native_status`), Triton for CUDA
    tensors when ``triton`` is installed (the dense kernel for float32 only),
    else torch. ``"torch"`` always gives torch. Naming a faster backend that
    cannot run here is an error, so a request is never silently ignored.

    Args:
        device: where the data lives (or a tensor on it).
        kernel: one of :data:`KERNELS`.
        dtype: the value type (None: not restricted).
        backend: the user's option: None / ``"auto"``, or a name in ``KERNELS[kernel]``.

    Returns:
        ``"native"``, ``"triton"`` or ``"torch"``.

    Raises:
        ValueError: for an unknown ``kernel`` or ``backend``.
        RuntimeError: when the requested backend cannot run on this device.

    Example:
        >>> default_backend(torch.zeros(2), kernel="hashed")
        'torch'
    """
    requested = _check_choice(kernel, backend)
    if requested == "torch":
        return "torch"
    if isinstance(device, torch.Tensor):
        dtype = device.dtype if dtype is None else dtype
        device = device.device
    chosen = "torch"
    if kernel == "scatter":
        if (dtype is None or dtype in _NATIVE_DTYPES) and _native.available(device):
            chosen = "native"
    elif (kernel == "hashed" or dtype in (None, torch.float32)) and _triton_wanted(device):
        chosen = "triton"
    if requested not in ("auto", chosen):
        why = native_status().reason if requested == "native" else "see GRADSKETCH_TRITON"
        raise RuntimeError(
            f"`backend={requested!r}` was asked for the {kernel!r} kernel on {device} "
            f"({dtype}), but it cannot run there ({why}); pass backend=None to fall back."
        )
    return chosen


def reduce_(
    out: torch.Tensor | None, index: torch.Tensor | None, block: torch.Tensor, **options: Any
) -> bool:
    """The native scatter (and Gram) of a ``[r, n]`` block: :func:`._native.reduce_`.

    Returns False, touching nothing, where the native kernels do not run or
    do not take these tensors: the caller then runs its torch path.
    ``options`` (``rows``, ``gram``) are :func:`._native.reduce_`'s.

    Example:
        >>> out = torch.zeros(1, 2)
        >>> if not reduce_(out, torch.tensor([1, 1]), torch.ones(1, 2)):
        ...     out.index_add_(1, torch.tensor([1, 1]), torch.ones(1, 2))
        >>> out
        tensor([[0., 2.]])
    """
    if default_backend(block, kernel="scatter") != "native":
        return False
    return _native.reduce_(out, index, block, **options)


def buckets_and_signs(
    key: int, offset: int, length: int, num_buckets: int, device: torch.device
) -> torch.Tensor:
    """The folded count-sketch table of every sketch: :func:`._tables.buckets_and_signs`.

    On CPU, for coordinates below 2**32, the native kernel computes it
    (:func:`._native.buckets_and_signs_`) where the kernels are loaded,
    whatever scatter backend is chosen: the table is integer arithmetic, the
    same bits on every path.

    Example:
        >>> cpu = torch.device("cpu")
        >>> torch.equal(buckets_and_signs(7, 0, 100, 64, cpu),
        ...             _tables.buckets_and_signs(7, 0, 100, 64, cpu, fast=False))
        True
    """
    if device.type == "cpu" and offset + length <= 1 << 32:
        table = torch.empty(length, dtype=torch.int64)
        if _native.buckets_and_signs_(table, key, offset, num_buckets):
            return table
    return _tables.buckets_and_signs(key, offset, length, num_buckets, device)


def reduce_rows_(
    out: torch.Tensor | None,
    index: torch.Tensor | None,
    segments: list[list[torch.Tensor]],
    **options: Any,
) -> bool:
    """:func:`reduce_` of a block given as segments of rows (:func:`._native.reduce_rows_`).

    Returns False, touching nothing, where the native kernels do not take them.
    """
    if not segments or not segments[0]:
        return False
    if default_backend(segments[0][0], kernel="scatter") != "native":
        return False
    return _native.reduce_rows_(out, index, segments, **options)


def __getattr__(name: str) -> Any:
    # The Triton module's error, without importing it before it is asked for.
    if name == "TritonUnavailableError":
        return triton().TritonUnavailableError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
