"""Functional masked Adagrad, Adam and SGD.

Masked semantics: each parameter has *specified* entries (see
:mod:`gradsketch.masked._specified` for where they come from). An update step
changes the parameter and every state tensor at the specified entries only;
unspecified entries are left untouched, bit for bit. Specified entries whose
gradient value is zero are still updated (their accumulators decay or grow as
for any other value), exactly as torch treats explicitly stored zeros of a
sparse gradient.

Weight decay is L2 regularisation added to the gradient, ``g <- g + wd * p``,
at the specified entries only: an entry that is not specified receives
neither gradient nor decay in that step. (torch's sparse Adagrad refuses
weight decay; with an all-True mask this equals torch's dense optimizers.)

Every function has two paths that compute the same numbers:

- the *reference* path (``fast=False``): dense tensors and ``torch.where``,
  written to be read;
- the *fast* path (default): the specified entries are found once as flat
  indices, gathered, updated as short 1-D tensors and scattered back; when a
  mask is so dense that gathering costs more than a full pass, a masked dense
  pass is used instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from gradsketch._parallel import run_parallel

from . import _specified as specified
from ._errors import MaskError
from ._specified import Specified, dense_view, gather, resolve, scatter_

__all__ = ["adagrad", "adam", "sgd"]

StepCounts = Literal["entry", "parameter"]


# Each optimizer's reference and fast paths take the same arguments: the
# gradient, the mask, the parameter with its state tensors, and one frozen
# record of the step's hyperparameters, built once by the public function.
@dataclass(frozen=True)
class _AdagradHyper:
    clr: float
    weight_decay: float
    eps: float
    maximize: bool


@dataclass(frozen=True)
class _AdamHyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    maximize: bool
    per_entry: bool


@dataclass(frozen=True)
class _SgdHyper:
    lr: float
    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool
    maximize: bool


def _check_lists(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    masks: Sequence[Tensor | None],
    **state: Sequence[object],
) -> int:
    """The number of parameters; every list (named in the error) must have one entry each."""
    lists = {"params": params, "grads": grads, "masks": masks, **state}
    lengths = {name: len(value) for name, value in lists.items()}
    if len(set(lengths.values())) > 1:
        shown = ", ".join(f"`{k}`: {v}" for k, v in lengths.items())
        raise MaskError(
            f"the per-parameter lists must have equal lengths; received {shown}. "
            "Fix: pass one entry per parameter (None for an unrestricted mask)."
        )
    return next(iter(lengths.values()))


def _zero_unspecified(values: Tensor, mask: Tensor) -> Tensor:
    """``torch.where(mask, values, 0)`` for 1-D ``values`` and boolean ``mask``.

    On CPU torch's ``where`` branches per element, which costs several times
    a memory pass for an irregular mask. There the selection is done on the
    bit patterns with numpy instead, branch-free and exact (NaN and inf in
    unspecified entries become +0.0): ``bits & -int(mask)``.
    """
    int_dtype = specified._INT_OF_SIZE.get(values.element_size())
    if (
        not specified._USE_NUMPY
        or values.device.type != "cpu"
        or int_dtype is None
        or values.is_complex()
        or not values.is_contiguous()
    ):
        return torch.where(mask, values, torch.zeros((), dtype=values.dtype))
    out = torch.empty_like(values)
    src = values.detach().view(int_dtype).numpy()
    keep = mask.numpy().view(np.uint8).astype(src.dtype)
    np.negative(keep, out=keep)  # 1 -> all bits set, 0 -> none
    np.bitwise_and(src, keep, out=out.view(int_dtype).numpy())
    return out


# Index paths with at least twice this many entries are split into parts of
# at least this size, two per thread, updated on parallel threads.
_PARALLEL_MIN_PART = 1 << 15


def _apply(
    kernel: Callable[..., None],
    spec: Specified,
    tensors: list[Tensor],
    *,
    dense_occupancy: float | None = None,
    dense_window: Callable[[Tensor, Tensor, list[Tensor]], None] | None = None,
) -> None:
    """Run ``kernel(g, *tensors)`` on the specified entries of ``tensors`` only.

    ``kernel`` is elementwise, updates its tensor arguments in place and
    only reads ``g``. A boolean mask is handled window by window (see
    :func:`~gradsketch.masked._specified.for_each_window`): sparse windows gather,
    update and scatter their entries; dense ones (more than
    ``dense_occupancy`` of their 8-byte words occupied) take
    ``dense_window(g, mask, tensors)`` on the window's slices, by default
    the kernel on copies followed by a select.
    """
    flats = [t.view(-1) for t in tensors]
    if spec.index is not None:
        index, values, n = spec.index, spec.values, spec.index.numel()
        threads = torch.get_num_threads()
        if index.device.type != "cpu" or threads < 2 or n < 2 * _PARALLEL_MIN_PART:
            _apply_index(kernel, values, index, flats, gathered=spec.gathered)
            return

        def run_part(part: slice) -> None:
            chunk = index[part]
            picked = values[part] if spec.gathered else values
            _apply_index(kernel, picked, chunk, flats, gathered=spec.gathered)

        # Parts touch disjoint entries; numpy's take/put and torch's kernels
        # release the GIL, so the cold random accesses overlap across cores.
        step = max(_PARALLEL_MIN_PART, -(-n // (2 * threads)))
        run_parallel(run_part, [slice(a, min(a + step, n)) for a in range(0, n, step)])
    elif spec.mask is not None:
        occupancy = specified._DENSE_WORD_OCCUPANCY if dense_occupancy is None else dense_occupancy
        dense = dense_window or _dense_window(kernel)
        mask, values = spec.mask, spec.values

        def run(part: slice) -> int:
            index = specified.window_index(mask[part], occupancy)
            views = [f[part] for f in flats]
            if index is None:
                dense(values[part], mask[part], views)
                return part.stop - part.start
            if index.numel():
                _apply_index(kernel, values[part], index, views, gathered=False)
            return index.numel()

        specified.for_each_window(run, mask.numel(), mask.device)
    else:
        kernel(spec.values, *flats)


def _apply_index(
    kernel: Callable[..., None],
    values: Tensor,
    index: Tensor,
    flats: list[Tensor],
    *,
    gathered: bool = True,
) -> None:
    """Gather, update and scatter the entries at ``index``, a cache-sized chunk at a time.

    ``values`` holds the gradient at ``index`` (``gathered``) or everywhere
    (flat, gathered here chunk by chunk).
    """
    step = specified._INDEX_CHUNK
    for start in range(0, index.numel(), step):
        chunk = index[start : start + step]
        picked = [gather(f, chunk) for f in flats]
        g = values[start : start + step] if gathered else gather(values, chunk)
        kernel(g, *picked)
        for flat, new in zip(flats, picked):
            scatter_(flat, chunk, new)


def _dense_window(kernel: Callable[..., None]) -> Callable[[Tensor, Tensor, list[Tensor]], None]:
    def run(g: Tensor, mask: Tensor, views: list[Tensor]) -> None:
        updated = [v.clone() for v in views]
        kernel(g, *updated)
        for view, new in zip(views, updated):
            torch.where(mask, new, view, out=view)

    return run


def _use_fast(fast: bool, tensors: Sequence[Tensor]) -> bool:
    # Flat views need contiguous storage; anything else takes the reference path.
    return fast and all(t.is_contiguous() for t in tensors)


def _prepare_grad(g: Tensor, p: Tensor, *, weight_decay: float, maximize: bool) -> Tensor:
    g = -g if maximize else g
    return g.add(p, alpha=weight_decay) if weight_decay != 0 else g


def _reference_grad(
    param: Tensor, grad: Tensor, mask: Tensor | None, *, weight_decay: float, maximize: bool
) -> tuple[Tensor, Tensor]:
    """The reference paths' start: the specified entries and the dense gradient to apply.

    Unlike :func:`_prepare_grad` it adds ``weight_decay * param`` even when the
    decay is 0, as the reference formulas read.
    """
    specified, grad = dense_view(param, grad, mask)
    if maximize:
        grad = -grad
    return specified, grad + weight_decay * param


# --------------------------------------------------------------------------- adagrad


def adagrad(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    masks: Sequence[Tensor | None],
    state_sums: Sequence[Tensor],
    state_steps: Sequence[Tensor],
    *,
    lr: float,
    lr_decay: float,
    weight_decay: float,
    eps: float,
    maximize: bool = False,
    fast: bool = True,
) -> None:
    r"""Masked Adagrad step, in place, at the specified entries only.

    At a specified entry with gradient :math:`g` (after weight decay),
    :math:`s \leftarrow s + g^2` and
    :math:`p \leftarrow p - \eta_t\, g / (\sqrt{s} + \epsilon)` with
    :math:`\eta_t = \text{lr} / (1 + (t - 1)\,\text{lr\_decay})`, where
    :math:`t` is the parameter's step count (Duchi, Hazan and Singer, 2011).
    As in :func:`torch.optim.Adagrad`, ``eps`` is added after the square
    root and only specified entries see it.

    Args:
        params: Parameters, each ``[*shape_i]``.
        grads: Gradients ``[*shape_i]``: dense, sparse COO (specifies its
            stored indices) or :class:`torch.masked.MaskedTensor`.
        masks: Per parameter ``None`` (as the gradient specifies), a boolean
            ``[*shape_i]`` mask, or 1-D int64 strictly increasing flat
            indices; intersected with what the gradient specifies.
        state_sums: Squared-gradient accumulators ``[*shape_i]``.
        state_steps: Scalar step counters (as in torch), incremented here.
        lr: Learning rate.
        lr_decay: Learning-rate decay.
        weight_decay: L2 penalty, applied at specified entries only.
        eps: Added to the denominator.
        maximize: Ascend instead of descend.
        fast: Use the gathered fast path; ``False`` runs the reference path.

    Example:
        >>> p = torch.zeros(4)
        >>> s, t = torch.zeros(4), torch.tensor(0.0)
        >>> adagrad([p], [torch.ones(4)], [torch.tensor([True, False, True, False])],
        ...         [s], [t], lr=0.5, lr_decay=0.0, weight_decay=0.0, eps=0.0)
        >>> p
        tensor([-0.5000,  0.0000, -0.5000,  0.0000])
    """
    n = _check_lists(params, grads, masks, state_sums=state_sums, state_steps=state_steps)
    for i in range(n):
        param, grad, mask, state_sum, step_t = (
            params[i],
            grads[i],
            masks[i],
            state_sums[i],
            state_steps[i],
        )
        step_t += 1
        clr = lr / (1 + (float(step_t) - 1) * lr_decay)
        hp = _AdagradHyper(clr, weight_decay, eps, maximize)
        update = _adagrad_fast if _use_fast(fast, (param, state_sum)) else _adagrad_reference
        update(grad, mask, [param, state_sum], hp)


def _adagrad_reference(
    grad: Tensor, mask: Tensor | None, tensors: list[Tensor], hp: _AdagradHyper
) -> None:
    param, state_sum = tensors
    specified, grad = _reference_grad(
        param, grad, mask, weight_decay=hp.weight_decay, maximize=hp.maximize
    )
    new_sum = state_sum + grad * grad
    new_param = param - hp.clr * grad / (new_sum.sqrt() + hp.eps)
    state_sum.copy_(torch.where(specified, new_sum, state_sum))
    param.copy_(torch.where(specified, new_param, param))


# torch's fused Adagrad kernel (what `torch.optim.Adagrad(fused=True)` calls)
# does the whole update in one pass. It is private API, so it is used only
# where it exists and for what it supports, with plain ops as the fallback.
_FUSED_ADAGRAD = getattr(torch, "_fused_adagrad_", None)
_FUSED_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
# Below torch's parallel grain size the plain in-place ops run inline, while
# the fused kernel always dispatches to the thread pool: after the numpy scan
# the pool is asleep and waking it costs milliseconds (measured 3.5-10 ms for
# 16k gathered entries against 0.03 ms inline).
_FUSED_MIN_NUMEL = 1 << 15


def _adagrad_update(p: Tensor, g: Tensor, s: Tensor, *, clr: float, eps: float) -> None:
    """``s += g*g; p -= clr * g / (sqrt(s) + eps)`` in place, all entries."""
    if (
        _FUSED_ADAGRAD is not None
        and p.device.type == "cpu"
        and p.dtype in _FUSED_DTYPES
        and p.numel() >= _FUSED_MIN_NUMEL
    ):
        # lr_decay is already folded into clr; the step tensor is then unused.
        one = torch.ones((), dtype=torch.float32)
        _FUSED_ADAGRAD(
            [p], [g], [s], [one],
            lr=clr, lr_decay=0.0, weight_decay=0.0, eps=eps, maximize=False,
            grad_scale=None, found_inf=None,
        )  # fmt: skip
        return
    s.addcmul_(g, g)
    p.addcdiv_(g, s.sqrt().add_(eps), value=-clr)


def _adagrad_fast(
    grad: Tensor, mask: Tensor | None, tensors: list[Tensor], hp: _AdagradHyper
) -> None:
    clr, eps, weight_decay, maximize = hp.clr, hp.eps, hp.weight_decay, hp.maximize

    def kernel(g: Tensor, p: Tensor, s: Tensor) -> None:
        g = _prepare_grad(g, p, weight_decay=weight_decay, maximize=maximize)
        _adagrad_update(p, g.contiguous(), s, clr=clr, eps=eps)

    dense_window = None
    if eps > 0:
        # Dense window: a zero gradient leaves Adagrad's (non-negative) sum
        # unchanged and, with eps > 0, moves the parameter by exactly -0.0, so
        # zeroing the unspecified entries replaces copies and the final
        # selects: one select plus one fused pass.
        def dense_window(g: Tensor, mask: Tensor, views: list[Tensor]) -> None:
            p, s = views
            g = _prepare_grad(g, p, weight_decay=weight_decay, maximize=maximize)
            _adagrad_update(p, _zero_unspecified(g, mask), s, clr=clr, eps=eps)

    _apply(
        kernel,
        resolve(tensors[0], grad, mask),
        tensors,
        dense_occupancy=specified._ADAGRAD_DENSE_WORD_OCCUPANCY,
        dense_window=dense_window,
    )


# --------------------------------------------------------------------------- adam


def adam(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    masks: Sequence[Tensor | None],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    state_steps: Sequence[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step_counts: StepCounts = "entry",
    maximize: bool = False,
    fast: bool = True,
) -> None:
    r"""Lazy masked Adam step, in place, at the specified entries only.

    At a specified entry with gradient :math:`g` (after weight decay) and
    step count :math:`t`:
    :math:`m \leftarrow \beta_1 m + (1-\beta_1) g`,
    :math:`v \leftarrow \beta_2 v + (1-\beta_2) g^2`,
    :math:`p \leftarrow p - \text{lr}\,\hat m / (\sqrt{\hat v} + \epsilon)`
    with :math:`\hat m = m / (1-\beta_1^t)`, :math:`\hat v = v / (1-\beta_2^t)`
    (Kingma and Ba, 2015, Algorithm 1, as :func:`torch.optim.Adam`).

    With ``step_counts="entry"`` each entry counts the steps in which it was
    specified, so its bias correction matches the number of updates its
    moments have seen. With ``"parameter"`` the count is one scalar per
    parameter advanced every step, as in :class:`torch.optim.SparseAdam`.
    (SparseAdam also adds ``eps`` before the bias correction; here it is
    added after, as in :class:`torch.optim.Adam`. The two agree as
    ``eps -> 0``.)

    Args:
        params: Parameters, each ``[*shape_i]``.
        grads: Gradients ``[*shape_i]``: dense, sparse COO or MaskedTensor.
        masks: Per parameter ``None``, a boolean ``[*shape_i]`` mask or 1-D
            int64 flat indices; intersected with what the gradient specifies.
        exp_avgs: First moments ``[*shape_i]``.
        exp_avg_sqs: Second moments ``[*shape_i]``.
        state_steps: Step counts: int32 ``[*shape_i]`` for ``"entry"``, a
            scalar tensor for ``"parameter"``. Incremented here.
        lr: Learning rate.
        beta1: First-moment decay.
        beta2: Second-moment decay.
        eps: Added to the denominator.
        weight_decay: L2 penalty, applied at specified entries only.
        step_counts: ``"entry"`` or ``"parameter"``, see above.
        maximize: Ascend instead of descend.
        fast: Use the gathered fast path; ``False`` runs the reference path.

    Example:
        >>> p, m, v = torch.zeros(3), torch.zeros(3), torch.zeros(3)
        >>> t = torch.zeros(3, dtype=torch.int32)
        >>> adam([p], [torch.ones(3)], [torch.tensor([True, True, False])], [m], [v], [t],
        ...      lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
        >>> p, t
        (tensor([-0.1000, -0.1000,  0.0000]), tensor([1, 1, 0], dtype=torch.int32))
    """
    n = _check_lists(
        params, grads, masks, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs, state_steps=state_steps
    )
    check_step_counts(step_counts)
    per_entry = step_counts == "entry"
    hp = _AdamHyper(lr, beta1, beta2, eps, weight_decay, maximize, per_entry)
    for i in range(n):
        param, step_t = params[i], state_steps[i]
        if per_entry and step_t.shape != param.shape:
            raise MaskError(
                f"`state_steps[{i}]` has shape {tuple(step_t.shape)}; with "
                f"step_counts='entry' it must have the parameter's shape "
                f"{tuple(param.shape)}. Fix: pass `torch.zeros_like(param, "
                "dtype=torch.int32)` or use step_counts='parameter'."
            )
        if not per_entry and step_t.dim() != 0:
            raise MaskError(
                f"`state_steps[{i}]` has shape {tuple(step_t.shape)}; with "
                "step_counts='parameter' it must be a scalar tensor."
            )
        if not per_entry:
            step_t += 1
        tensors = [param, exp_avgs[i], exp_avg_sqs[i], step_t]
        update = _adam_fast if _use_fast(fast, tensors) else _adam_reference
        update(grads[i], masks[i], tensors, hp)


def check_step_counts(step_counts: object) -> None:
    """Raise :class:`MaskError` unless ``step_counts`` is ``"entry"`` or ``"parameter"``."""
    if step_counts not in ("entry", "parameter"):
        raise MaskError(f"`step_counts` must be 'entry' or 'parameter'; received {step_counts!r}.")


def _compute_dtype(param: Tensor) -> torch.dtype:
    return torch.promote_types(param.dtype, torch.float32)


def _adam_reference(
    grad: Tensor, mask: Tensor | None, tensors: list[Tensor], hp: _AdamHyper
) -> None:
    param, exp_avg, exp_avg_sq, step_t = tensors
    lr, beta1, beta2, eps = hp.lr, hp.beta1, hp.beta2, hp.eps
    specified, grad = _reference_grad(
        param, grad, mask, weight_decay=hp.weight_decay, maximize=hp.maximize
    )
    if hp.per_entry:
        step_t.copy_(torch.where(specified, step_t + 1, step_t))
        t = step_t.to(_compute_dtype(param))
    else:
        t = torch.full_like(param, float(step_t), dtype=_compute_dtype(param))
    new_m = beta1 * exp_avg + (1 - beta1) * grad
    new_v = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
    m_hat = new_m / (1 - beta1**t)
    v_hat = new_v / (1 - beta2**t)
    new_param = param - lr * m_hat / (v_hat.sqrt() + eps)
    exp_avg.copy_(torch.where(specified, new_m, exp_avg))
    exp_avg_sq.copy_(torch.where(specified, new_v, exp_avg_sq))
    param.copy_(torch.where(specified, new_param, param))


def _adam_fast(grad: Tensor, mask: Tensor | None, tensors: list[Tensor], hp: _AdamHyper) -> None:
    param, step_t = tensors[0], tensors[3]
    lr, beta1, beta2, eps = hp.lr, hp.beta1, hp.beta2, hp.eps
    weight_decay, maximize = hp.weight_decay, hp.maximize
    dtype = _compute_dtype(param)

    def kernel(g: Tensor, p: Tensor, m: Tensor, v: Tensor, *steps: Tensor) -> None:
        g = _prepare_grad(g, p, weight_decay=weight_decay, maximize=maximize)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        if steps:
            t = steps[0].add_(1).to(dtype)
            step_size = torch.pow(beta1, t).neg_().add_(1).reciprocal_().mul_(-lr)
            bias2_sqrt_t = torch.pow(beta2, t).neg_().add_(1).sqrt_()
            denom = v.sqrt().div_(bias2_sqrt_t).add_(eps)
            p.addcmul_(m, step_size.div_(denom))
        else:
            step = float(step_t)
            denom = v.sqrt().div_(math.sqrt(1 - beta2**step)).add_(eps)
            p.addcdiv_(m, denom, value=-lr / (1 - beta1**step))

    # The kernel counts per-entry steps itself; a per-parameter count was
    # already advanced by `adam`.
    _apply(kernel, resolve(param, grad, mask), tensors if hp.per_entry else tensors[:3])


# --------------------------------------------------------------------------- sgd


def sgd(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    masks: Sequence[Tensor | None],
    momentum_buffers: list[Tensor | None],
    momentum_started: list[Tensor | None],
    *,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool = False,
    fast: bool = True,
) -> None:
    r"""Masked SGD step (with momentum), in place, at the specified entries only.

    At a specified entry with gradient :math:`g` (after weight decay):
    :math:`b \leftarrow \mu b + (1 - \tau) g` (or :math:`b \leftarrow g` the
    first time the entry is specified), then
    :math:`p \leftarrow p - \text{lr}\,(g + \mu b)` with Nesterov momentum,
    else :math:`p \leftarrow p - \text{lr}\, b`; as :class:`torch.optim.SGD`
    (Sutskever et al., 2013). Momentum acts only where specified: an
    unspecified entry keeps its buffer and its parameter value.

    Args:
        params: Parameters, each ``[*shape_i]``.
        grads: Gradients ``[*shape_i]``: dense, sparse COO or MaskedTensor.
        masks: Per parameter ``None``, a boolean ``[*shape_i]`` mask or 1-D
            int64 flat indices; intersected with what the gradient specifies.
        momentum_buffers: Buffers ``[*shape_i]``; ``None`` entries are
            created (zeros) and written back into the list. Unused when
            ``momentum == 0``.
        momentum_started: Boolean ``[*shape_i]``, True where the buffer has
            been started; created like ``momentum_buffers``.
        lr: Learning rate.
        momentum: Momentum factor :math:`\mu`.
        dampening: Dampening :math:`\tau`.
        weight_decay: L2 penalty, applied at specified entries only.
        nesterov: Use Nesterov momentum.
        maximize: Ascend instead of descend.
        fast: Use the gathered fast path; ``False`` runs the reference path.

    Example:
        >>> p = torch.zeros(3)
        >>> sgd([p], [torch.ones(3)], [torch.tensor([True, False, True])], [None], [None],
        ...     lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False)
        >>> p
        tensor([-0.1000,  0.0000, -0.1000])
    """
    n = _check_lists(
        params, grads, masks, momentum_buffers=momentum_buffers, momentum_started=momentum_started
    )
    hp = _SgdHyper(lr, momentum, dampening, weight_decay, nesterov, maximize)
    for i in range(n):
        param = params[i]
        if momentum == 0:
            tensors = [param]
        else:
            if momentum_buffers[i] is None:
                momentum_buffers[i] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if momentum_started[i] is None:
                momentum_started[i] = torch.zeros_like(param, dtype=torch.bool)
            tensors = [param, momentum_buffers[i], momentum_started[i]]  # type: ignore[list-item]
        update = _sgd_fast if _use_fast(fast, tensors) else _sgd_reference
        update(grads[i], masks[i], tensors, hp)


def _sgd_reference(grad: Tensor, mask: Tensor | None, tensors: list[Tensor], hp: _SgdHyper) -> None:
    param, momentum = tensors[0], hp.momentum
    specified, grad = _reference_grad(
        param, grad, mask, weight_decay=hp.weight_decay, maximize=hp.maximize
    )
    if momentum != 0:
        buf, started = tensors[1], tensors[2]
        new_buf = torch.where(started, momentum * buf + (1 - hp.dampening) * grad, grad)
        grad = grad + momentum * new_buf if hp.nesterov else new_buf
        buf.copy_(torch.where(specified, new_buf, buf))
        started.logical_or_(specified)
    param.copy_(torch.where(specified, param - hp.lr * grad, param))


def _sgd_fast(grad: Tensor, mask: Tensor | None, tensors: list[Tensor], hp: _SgdHyper) -> None:
    lr, momentum, dampening, nesterov = hp.lr, hp.momentum, hp.dampening, hp.nesterov
    weight_decay, maximize = hp.weight_decay, hp.maximize

    def kernel(g: Tensor, p: Tensor, *momentum_state: Tensor) -> None:
        g = _prepare_grad(g, p, weight_decay=weight_decay, maximize=maximize)
        if momentum_state:
            buf, started = momentum_state
            buf.mul_(momentum).add_(g, alpha=1 - dampening)
            torch.where(started, buf, g, out=buf)
            started.fill_(True)
            g = g.add(buf, alpha=momentum) if nesterov else buf
        p.add_(g, alpha=-lr)

    _apply(kernel, resolve(tensors[0], grad, mask), tensors)
