"""Which entries of a parameter are specified.

A parameter's *specified* entries come from up to two sources, and are their
intersection:

- an explicit mask: a boolean tensor shaped like the parameter, or a 1-D
  int64 tensor of strictly increasing flat indices into ``param.view(-1)``;
- the gradient itself: a sparse COO gradient specifies its stored indices
  (explicitly stored zeros included), a :class:`torch.masked.MaskedTensor`
  specifies its mask, and a dense gradient specifies every entry.

Two resolvers turn these into something to compute with. :func:`dense_view`
gives a dense boolean mask and a dense gradient (the readable reference
path). :func:`resolve` gives flat indices plus the gradient values there, or
a boolean mask that is scanned window by window into indices, or
leaves as a mask where so many entries are specified that gathering would
cost more than a masked dense pass (the fast path).

On CPU the index work (finding, gathering and scattering specified entries)
runs in numpy on raw bits: single-threaded, SIMD and exact, it is as fast as
torch on an idle machine and does not stall on thread barriers when other
processes load the cores.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gradsketch._parallel import run_parallel

from ._errors import MaskError, describe

__all__ = [
    "Specified",
    "dense_mask_index",
    "dense_view",
    "flat_nonzero",
    "gather",
    "resolve",
    "scatter_",
    "validate_mask",
    "for_each_window",
    "window_index",
]

# Boolean masks are scanned and applied in windows of this many entries (a
# 1 MB slice of the mask and 4 MB of each float32 tensor): the entries a
# window gathers are still cached when they are scattered back.
_WINDOW = 1 << 20
# Index paths gather, update and scatter this many entries at a time, for
# the same reason.
_INDEX_CHUNK = 1 << 14
# Windows run on parallel threads when the first one updated this many entries
# (density >= 0.4 % for full windows).
_PARALLEL_MIN_HITS = 1 << 12
# Below this many entries a plain `nonzero` is as fast as the word scan.
_SCAN_MIN = 1 << 15
# A word of 8 mask bytes is occupied with probability 1 - (1 - d)^8 at
# density d. Above this share of occupied words, skipping empty words does
# not pay and a plain `nonzero` is used (d > 3.5 %).
_SKIP_WORDS_BELOW = 0.25
# Above this share of occupied words (d > 25 %) the fast path updates with a
# masked dense pass instead of gathering: gather + scatter of three 16 M
# tensors at 50 % costs more than one pass over all of them.
_DENSE_WORD_OCCUPANCY = 0.9
# Adagrad's masked dense pass is one select plus torch's fused kernel, so it
# wins from d > 6 % on (occupancy 0.4).
_ADAGRAD_DENSE_WORD_OCCUPANCY = 0.4
# numpy's word scan expands occupied words one by one; below this share of
# occupied words (density < 0.25 %) that beats `flatnonzero` on the bytes.
_NUMPY_WORD_SCAN_BELOW = 0.02
# On CPU, numpy's single-threaded count_nonzero / flatnonzero (SIMD, skipping
# zero bytes) match the torch word scan on an idle machine and, having no
# thread barriers, stay fast when other processes load the cores.
_USE_NUMPY = True


def _is_masked_tensor(x: object) -> bool:
    return isinstance(x, torch.masked.MaskedTensor)


def validate_mask(mask: Tensor, param: Tensor, where: str) -> None:
    """Check that ``mask`` can restrict ``param``; raise :class:`MaskError` if not.

    Args:
        mask: Boolean tensor shaped like ``param`` on its device, or a 1-D
            int64 tensor of strictly increasing flat indices into
            ``param.view(-1)``.
        param: The parameter the mask restricts.
        where: How the caller names the mask in messages, e.g. ``"`masks`"``.
    """
    if not isinstance(mask, Tensor) or _is_masked_tensor(mask):
        raise MaskError(
            f"{where} for a parameter of shape {tuple(param.shape)} must be a boolean "
            f"tensor; received {describe(mask)}. Fix: pass a torch.bool tensor with "
            "True at the specified entries."
        )
    if mask.device != param.device:
        raise MaskError(
            f"{where} is on device {mask.device} but its parameter of shape "
            f"{tuple(param.shape)} is on {param.device}. Fix: move the mask with "
            f"`mask.to({str(param.device)!r})`."
        )
    if mask.dtype == torch.bool:
        if mask.shape != param.shape:
            raise MaskError(
                f"{where} has shape {tuple(mask.shape)} but its parameter has shape "
                f"{tuple(param.shape)}; a boolean mask must have exactly the "
                "parameter's shape (no broadcasting). Fix: expand it with "
                "`mask.expand_as(param).clone()`."
            )
        if mask.layout != torch.strided:
            raise MaskError(
                f"{where} has layout {mask.layout}; expected a dense (strided) boolean "
                "tensor. Fix: pass `mask.to_dense()`."
            )
        return
    if mask.dtype == torch.int64 and mask.dim() == 1 and mask.layout == torch.strided:
        n = param.numel()
        if mask.numel() and (int(mask[0]) < 0 or int(mask[-1]) >= n):
            raise MaskError(
                f"{where} holds flat indices from {int(mask[0])} to {int(mask[-1])}; "
                f"expected indices in [0, {n}) for a parameter of shape "
                f"{tuple(param.shape)}."
            )
        if mask.numel() > 1 and not bool((mask[1:] > mask[:-1]).all()):
            raise MaskError(
                f"{where} holds flat indices that are not strictly increasing; "
                "expected sorted, unique indices. Fix: pass `torch.unique(index)`."
            )
        return
    raise MaskError(
        f"{where} has dtype {mask.dtype} and shape {tuple(mask.shape)}; expected "
        f"torch.bool with shape {tuple(param.shape)} (True = specified) or a 1-D "
        "torch.int64 tensor of flat indices. Fix: convert with `mask != 0` or "
        "`mask.bool()`."
    )


def _check_grad(param: Tensor, grad: Tensor) -> None:
    if not isinstance(grad, Tensor):
        raise MaskError(f"gradient must be a tensor; received {describe(grad)}.")
    if grad.shape != param.shape:
        raise MaskError(
            f"gradient has shape {tuple(grad.shape)} but its parameter has shape "
            f"{tuple(param.shape)}. Fix: pass a gradient shaped like the parameter."
        )
    if grad.device != param.device:
        raise MaskError(f"gradient is on {grad.device} but its parameter is on {param.device}.")
    if _is_masked_tensor(grad):
        return
    if grad.layout not in (torch.strided, torch.sparse_coo):
        raise MaskError(
            f"gradient has layout {grad.layout}; supported: torch.strided, "
            "torch.sparse_coo and torch.masked.MaskedTensor. Fix: convert with "
            "`grad.to_sparse_coo()` or `grad.to_dense()`."
        )


def _index_to_bool(index: Tensor, like: Tensor) -> Tensor:
    out = torch.zeros(like.numel(), dtype=torch.bool, device=like.device)
    out[index] = True
    return out.view(like.shape)


def _coo_flat(grad: Tensor) -> tuple[Tensor, Tensor]:
    """Flat indices (sorted) and values of a sparse COO gradient, duplicates summed."""
    grad = grad.coalesce()
    indices, values = grad.indices(), grad.values()
    sparse_shape = grad.shape[: grad.sparse_dim()]
    flat = torch.zeros(indices.shape[1], dtype=torch.int64, device=grad.device)
    for dim, size in enumerate(sparse_shape):
        flat = flat * size + indices[dim]
    if grad.dense_dim():
        # Hybrid tensor: each stored index covers a dense block of entries.
        block = math.prod(grad.shape[grad.sparse_dim() :])
        offsets = torch.arange(block, device=grad.device)
        flat = (flat[:, None] * block + offsets).reshape(-1)
        values = values.reshape(-1)
    return flat, values


def dense_view(param: Tensor, grad: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """Dense boolean mask and dense gradient, both shaped like ``param``.

    The readable reference path uses this; nothing here is optimised.

    Args:
        param: Parameter, any shape ``[*shape]``.
        grad: Gradient: dense, sparse COO or MaskedTensor, ``[*shape]``.
        mask: Explicit mask (see :func:`validate_mask`) or ``None``.

    Returns:
        ``(specified, grad)``: boolean ``[*shape]`` and dense ``[*shape]``.
        Unspecified gradient entries are zero.
    """
    _check_grad(param, grad)
    if mask is not None:
        validate_mask(mask, param, "mask")
        if mask.dtype != torch.bool:
            mask = _index_to_bool(mask, param)
    if _is_masked_tensor(grad):
        masked: Any = grad
        own, dense = masked.get_mask(), masked.get_data()
    elif grad.layout == torch.sparse_coo:
        grad = grad.coalesce()
        ones = torch.ones_like(grad.values(), dtype=torch.bool)
        own = torch.sparse_coo_tensor(
            grad.indices(), ones, grad.shape, check_invariants=False
        ).to_dense()
        dense = grad.to_dense()
    else:
        own, dense = torch.ones_like(param, dtype=torch.bool), grad
    specified = own if mask is None else own & mask
    return specified, torch.where(specified, dense, torch.zeros_like(dense))


def flat_nonzero(flags: Tensor) -> Tensor:
    """Sorted positions of the ``True`` entries of a 1-D boolean tensor.

    Equal to ``flags.nonzero().squeeze(1)`` but faster for sparse flags. On
    CPU numpy's ``flatnonzero`` is used. Elsewhere the bytes are read as
    8-byte words, empty words are skipped, and the same trick is applied
    again to the word flags, so a 16 M-entry mask at 0.1 % density costs one
    streaming comparison plus work on the few occupied words.

    Args:
        flags: ``[n]`` boolean.

    Returns:
        ``[k]`` int64, strictly increasing.

    Example:
        >>> flat_nonzero(torch.tensor([False, True, False, True]))
        tensor([1, 3])
    """
    index = _scan(flags, dense_occupancy=None)
    assert index is not None
    return index


def _scan(flags: Tensor, dense_occupancy: float | None) -> Tensor | None:
    """Return :func:`flat_nonzero`, or ``None`` if the mask is dense.

    ``None`` means more than ``dense_occupancy`` of the 8-byte words hold a
    ``True``, so a masked dense pass is cheaper than gathering.
    """
    n = flags.numel()
    n8 = n - n % 8
    if n < _SCAN_MIN:
        return flags.nonzero().squeeze(1)
    if _USE_NUMPY and flags.device.type == "cpu":
        return _scan_numpy(flags.numpy(), dense_occupancy)
    if not flags.is_contiguous() or flags.storage_offset() % 8:
        return flags.nonzero().squeeze(1)
    words = flags[:n8].view(torch.int64)
    occupied_flags = words != 0
    if dense_occupancy is not None:
        share = int(occupied_flags.count_nonzero()) / words.numel()
        if share > dense_occupancy:
            return None
        if share > _SKIP_WORDS_BELOW:
            return flags.nonzero().squeeze(1)
    occupied = _scan(occupied_flags, dense_occupancy=None)
    assert occupied is not None
    if occupied.numel() > _SKIP_WORDS_BELOW * words.numel():
        # Dense enough that skipping empty words does not pay.
        return flags.nonzero().squeeze(1)
    picked = words.index_select(0, occupied).view(torch.uint8).view(-1, 8)
    rows, cols = picked.nonzero(as_tuple=True)
    index = occupied.index_select(0, rows).mul_(8).add_(cols)
    if n8 < n:
        index = torch.cat([index, flags[n8:].nonzero().squeeze(1) + n8])
    return index


def _scan_numpy(array: np.ndarray, dense_occupancy: float | None) -> Tensor | None:
    """:func:`_scan` for a 1-D numpy boolean array (CPU).

    One streaming pass compares 8-byte words with zero; their count decides
    the path. A dense mask returns ``None``; a very sparse one expands only
    its occupied words; otherwise ``flatnonzero`` on the bytes, whose cost
    grows with the number of hits, not with the skipped zeros.
    """
    n = array.size
    n8 = n - n % 8
    if not array.flags.c_contiguous or n8 == 0:
        if dense_occupancy is not None and n:
            density = np.count_nonzero(array) / n
            if 1 - (1 - density) ** 8 > dense_occupancy:
                return None
        return torch.from_numpy(np.flatnonzero(array).astype(np.int64, copy=False))
    words = array[:n8].view(np.uint64)
    occupied = words != 0
    share = np.count_nonzero(occupied) / words.size
    if dense_occupancy is not None and share > dense_occupancy:
        return None
    if share > _NUMPY_WORD_SCAN_BELOW:
        return torch.from_numpy(np.flatnonzero(array).astype(np.int64, copy=False))
    at = np.flatnonzero(occupied)
    rows, cols = np.nonzero(words[at].view(np.uint8).reshape(-1, 8))
    index = at[rows] * 8 + cols
    if n8 < n:
        index = np.concatenate([index, np.flatnonzero(array[n8:]) + n8])
    return torch.from_numpy(index.astype(np.int64, copy=False))


def dense_mask_index(mask: Tensor, *, dense_occupancy: float = _DENSE_WORD_OCCUPANCY) -> Tensor:
    """The flat indices of a boolean mask, or the mask itself if it is dense.

    What the fast path would compute from ``mask``, in a form that can be
    kept and passed again as a mask: a strictly increasing int64 index
    ``[k]``, or the boolean mask when a masked dense pass is cheaper.
    """
    found = _scan(mask.reshape(-1), dense_occupancy=dense_occupancy)
    return mask if found is None else found


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _numpy_bits(t: Tensor) -> np.ndarray | None:
    """A numpy view of the raw bits of a 1-D contiguous CPU tensor, if possible."""
    int_dtype = _INT_OF_SIZE.get(t.element_size())
    if not _USE_NUMPY or t.device.type != "cpu" or int_dtype is None or not t.is_contiguous():
        return None
    return t.detach().view(int_dtype).numpy()


def gather(flat: Tensor, index: Tensor) -> Tensor:
    """``flat[index]`` for 1-D ``flat`` and int64 ``index`` (a new tensor).

    On CPU this copies raw bits with numpy's single-threaded ``take``: as
    fast as ``index_select`` on an idle machine and unaffected by thread
    contention on a busy one.
    """
    bits = _numpy_bits(flat)
    if bits is None or index.device.type != "cpu":
        return flat.index_select(0, index)
    return torch.from_numpy(np.take(bits, index.numpy())).view(flat.dtype)


def scatter_(flat: Tensor, index: Tensor, values: Tensor) -> None:
    """``flat[index] = values`` in place (``index_copy_``); numpy on CPU."""
    bits = _numpy_bits(flat)
    source = _numpy_bits(values) if values.dtype == flat.dtype else None
    if bits is None or source is None or index.device.type != "cpu":
        flat.index_copy_(0, index, values)
        return
    bits[index.numpy()] = source
    # Writes through numpy bypass torch; keep autograd's in-place checks honest.
    torch.autograd.graph.increment_version(flat)


@dataclass(frozen=True)
class Specified:
    """The specified entries of one parameter, ready for the fast path.

    Exactly one representation is used:

    - ``index`` set: 1-D int64 flat indices ``[k]`` and ``values`` ``[k]``,
      the gradient there (``gathered``), or the full flat gradient
      ``[numel]``, gathered by the update chunk by chunk (not ``gathered``);
    - ``mask`` set: boolean ``[numel]`` and ``values`` the full flat
      gradient ``[numel]`` (garbage where unspecified); the update scans it
      window by window (see :func:`for_each_window`);
    - neither: every entry, ``values`` the full flat gradient ``[numel]``.
    """

    values: Tensor
    index: Tensor | None = None
    mask: Tensor | None = None
    gathered: bool = True


def resolve(param: Tensor, grad: Tensor, mask: Tensor | None) -> Specified:
    """Resolve the specified entries of ``param`` for the fast path.

    A boolean mask is kept as a mask: it is scanned window by window when
    the update runs (see :func:`for_each_window`), so that the index of each window
    is used while its entries are still in cache.

    Args:
        param: Parameter ``[*shape]``.
        grad: Gradient: dense, sparse COO or MaskedTensor ``[*shape]``.
        mask: Explicit mask (see :func:`validate_mask`) or ``None``.

    Returns:
        A :class:`Specified`.
    """
    _check_grad(param, grad)
    if mask is not None:
        validate_mask(mask, param, "mask")
    if _is_masked_tensor(grad):
        masked: Any = grad
        own, grad = masked.get_mask(), masked.get_data()
        if mask is not None and mask.dtype != torch.bool:
            mask = _index_to_bool(mask, param)
        mask = own if mask is None else own & mask
    if grad.layout == torch.sparse_coo:
        index, values = _coo_flat(grad)
        if mask is not None:
            if mask.dtype != torch.bool:
                mask = _index_to_bool(mask, param)
            keep = mask.reshape(-1)[index]
            index, values = index[keep], values[keep]
        return Specified(values=values, index=index)
    flat_grad = grad.reshape(-1)
    if mask is None:
        return Specified(values=flat_grad)
    if mask.dtype != torch.bool:
        return Specified(values=flat_grad, index=mask, gathered=False)
    return Specified(values=flat_grad, mask=mask.reshape(-1))


def window_index(flags: Tensor, dense_occupancy: float) -> Tensor | None:
    """Window-local flat indices of ``flags`` (1-D boolean), or ``None`` if dense.

    ``None`` means more than ``dense_occupancy`` of the window's 8-byte words
    are occupied, so a masked dense pass over the window is cheaper than
    gathering.
    """
    return _scan(flags, dense_occupancy=dense_occupancy)


def for_each_window(fn: Callable[[slice], int], n: int, device: torch.device) -> None:
    """Call ``fn(part)`` for consecutive windows covering ``range(n)``.

    ``fn`` handles the entries of one window and returns how many it
    updated. Windows touch disjoint entries, so the first window sets the
    pace for the others:

    - busy (at least :data:`_PARALLEL_MIN_HITS` entries updated): windows of
      :data:`_WINDOW` entries, spread over ``torch.get_num_threads()`` worker
      threads. Small windows keep a window's mask, index and gathered
      entries in cache between scan, gather, update and scatter, and numpy
      and torch release the GIL in their loops, so the single-threaded
      numpy scans, gathers and scatters use every core;
    - sparse: windows of ``4 * _WINDOW`` entries, in turn: their work is too
      short for threads to pay (the Python between calls contends for the
      GIL), and fewer windows cost less Python.

    Off CPU the whole range is one window (each scan synchronises with the
    device). The first exception raised by ``fn`` is re-raised.

    Example:
        >>> seen = []
        >>> for_each_window(lambda part: seen.append(part) or 0, 10, torch.device("cpu"))
        >>> seen
        [slice(0, 10, None)]
    """
    if device.type != "cpu":
        if n:
            fn(slice(0, n))
        return
    if n == 0:
        return
    first = slice(0, min(_WINDOW, n))
    busy = fn(first) >= _PARALLEL_MIN_HITS
    step = _WINDOW if busy else 4 * _WINDOW
    parts = [slice(start, min(start + step, n)) for start in range(first.stop, n, step)]
    if busy:
        run_parallel(fn, parts)
    else:
        for part in parts:
            fn(part)
