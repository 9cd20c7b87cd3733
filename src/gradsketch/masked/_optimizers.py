"""Masked optimizers: torch.optim classes that update only specified entries.

Where the specified entries of a parameter come from, intersected when
several apply:

1. ``step(masks=...)``: a mapping parameter -> boolean tensor, or a
   :class:`~gradsketch.masked.ParamMask` when the optimizer was built from
   ``model.named_parameters()``; it restricts this step only.
2. The param group's ``"mask"`` entry: a static restriction, one boolean
   tensor per parameter of the group (or ``None``), a single tensor for a
   one-parameter group, or a ParamMask (named parameters needed). Its
   boolean masks are converted to flat indices once and reused while the
   mask tensor is unchanged, so a static restriction costs nothing per step.
3. The gradient: a sparse COO gradient specifies its stored indices
   (explicitly stored zeros included), a :class:`torch.masked.MaskedTensor`
   its mask, a dense gradient every entry.

Unspecified entries keep their parameter value and optimizer state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.optim import Optimizer

from . import _functional as F
from . import _specified as specified
from ._errors import MaskError, describe
from ._parammask import ParamMask
from ._specified import dense_mask_index, validate_mask

__all__ = ["MaskedAdagrad", "MaskedAdam", "MaskedSGD"]

Masks = Mapping[Tensor, Tensor] | ParamMask | None


def _check_hyper(name: str, value: float, *, low: float = 0.0, high: float | None = None) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= low
    ok = ok and (high is None or value < high)
    if not ok:
        allowed = f"a float >= {low}" if high is None else f"a float in [{low}, {high})"
        raise ValueError(f"`{name}` must be {allowed}; received {value!r}.")


def _checked(**hypers: float) -> dict[str, Any]:
    """The hyperparameters, each checked to be a float >= 0, in the order given."""
    for name, value in hypers.items():
        _check_hyper(name, value)
    return hypers


def _intersect(a: Tensor | None, b: Tensor | None, param: Tensor) -> Tensor | None:
    if a is None or b is None:
        return b if a is None else a

    def as_bool(m: Tensor) -> Tensor:
        if m.dtype == torch.bool:
            return m
        out = torch.zeros(param.numel(), dtype=torch.bool, device=param.device)
        out[m] = True
        return out.view(param.shape)

    return as_bool(a) & as_bool(b)


class _MaskedOptimizer(Optimizer):
    """Shared mask handling and step; a subclass names its update and its state.

    Every subclass steps the same way: gather each parameter's state slots
    (:attr:`_SLOTS`, started by :meth:`_init_state` on the first step) into
    one list per slot, call its functional update (:attr:`_update`) with the
    group's hyperparameters (:attr:`_HYPERS`), and keep any slot the update
    started (SGD's momentum buffers start on their first use).
    """

    #: The functional update in :mod:`._functional`, called as
    #: ``update(params, grads, masks, *slot_lists, **hyperparameters)``.
    _update: ClassVar[Callable[..., None]]
    #: The group entries the update takes by name, besides ``maximize`` and ``fast``.
    _HYPERS: ClassVar[tuple[str, ...]] = ()
    #: The per-parameter state entries passed to the update, one list each, in order.
    _SLOTS: ClassVar[tuple[str, ...]] = ()

    # State entries that are not floating point. torch's `load_state_dict`
    # casts every state tensor except "step" to the parameter's dtype, so
    # these are cast back after loading.
    _STATE_DTYPES: ClassVar[dict[str, torch.dtype]] = {}
    # Name of the `_specified` threshold above which a mask takes the masked
    # dense pass (looked up at call time).
    _DENSE_OCCUPANCY: ClassVar[str] = "_DENSE_WORD_OCCUPANCY"

    def __init__(
        self, params: Iterable[Any], hypers: dict[str, Any], *, maximize: bool, fast: bool
    ) -> None:
        super().__init__(params, {**hypers, "maximize": maximize, "fast": fast, "mask": None})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load optimizer state, keeping boolean and integer state entries exact."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key, dtype in self._STATE_DTYPES.items():
                if key in state and state[key].dtype != dtype:
                    state[key] = state[key].to(dtype)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group; its ``"mask"`` entry is validated and normalised.

        Args:
            param_group: As for :meth:`torch.optim.Optimizer.add_param_group`,
                optionally with ``"mask"``: ``None``, a boolean tensor (for a
                one-parameter group), a sequence with one boolean tensor or
                ``None`` per parameter, or a :class:`ParamMask` (the group must
                come from ``named_parameters()``).
        """
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        group["mask"] = self._group_masks(group)

    @staticmethod
    def _group_masks(group: dict[str, Any]) -> list[Tensor | None]:
        params: list[Tensor] = group["params"]
        spec = group.get("mask")
        if spec is None:
            return [None] * len(params)
        if isinstance(spec, ParamMask):
            names = group.get("param_names")
            if names is None:
                raise MaskError(
                    "a ParamMask as the group's `mask` needs parameter names; received a "
                    "group built from unnamed parameters. Fix: build the optimizer from "
                    "`model.named_parameters()`, or pass `mask.by_parameter(model)` "
                    "to `step(masks=...)`."
                )
            masks: list[Tensor | None] = [spec.get(name, p) for name, p in zip(names, params)]
        elif isinstance(spec, Tensor):
            if len(params) != 1:
                raise MaskError(
                    f"the group's `mask` is a single tensor but the group holds "
                    f"{len(params)} parameters. Fix: pass a list with one mask (or None) "
                    "per parameter."
                )
            masks = [spec]
        elif isinstance(spec, Sequence) and not isinstance(spec, str):
            masks = list(spec)
            if len(masks) != len(params):
                raise MaskError(
                    f"the group's `mask` list has {len(masks)} entries but the group holds "
                    f"{len(params)} parameters. Fix: pass one mask (or None) per parameter."
                )
        else:
            raise MaskError(
                f"the group's `mask` must be None, a boolean tensor, a list of them or a "
                f"ParamMask; received {describe(spec)}."
            )
        for i, (mask, param) in enumerate(zip(masks, params)):
            if mask is not None:
                validate_mask(mask, param, f"the group's `mask[{i}]`")
        return masks

    def _step_masks(self, masks: Masks) -> dict[int, Tensor]:
        """Validate ``step(masks=...)``; return masks keyed by ``id(param)``."""
        if masks is None:
            return {}
        held = {id(p): p for group in self.param_groups for p in group["params"]}
        if isinstance(masks, ParamMask):
            named = {
                name: p
                for group in self.param_groups
                for name, p in zip(group.get("param_names") or (), group["params"])
            }
            if not named:
                raise MaskError(
                    "`masks` is a ParamMask but this optimizer holds unnamed parameters. "
                    "Fix: build the optimizer from `model.named_parameters()`, or pass "
                    "`masks=mask.by_parameter(model)`."
                )
            unknown = [n for n in masks.names if n not in named]
            if unknown:
                raise MaskError(
                    f"`masks` names parameters this optimizer does not hold: {unknown[:5]}; "
                    f"it holds {sorted(named)[:12]}."
                )
            return {id(p): masks.get(name, p) for name, p in named.items()}
        if not isinstance(masks, Mapping):
            raise MaskError(
                f"`masks` must be a mapping parameter -> boolean tensor, a ParamMask or "
                f"None; received {describe(masks)}."
            )
        out: dict[int, Tensor] = {}
        for key, mask in masks.items():
            if not isinstance(key, Tensor) or id(key) not in held:
                raise MaskError(
                    f"`masks` has a key this optimizer does not hold: {describe(key)}. "
                    "Masks are keyed by the parameter tensors given to the optimizer "
                    "(not copies, `.data` or names). Fix: use `{param: mask}` with the "
                    "same parameter objects."
                )
            validate_mask(mask, key, f"`masks[param of shape {tuple(key.shape)}]`")
            out[id(key)] = mask
        return out

    def _indexed(self, p: Tensor, mask: Tensor | None, slot: str) -> Tensor | None:
        """A boolean mask converted to flat indices once per mask version.

        The scan of a boolean mask costs a pass over it, as much as the
        update itself at low density. Masks are usually reused step after
        step (a group's static ``"mask"``, or the same tensor passed to
        :meth:`step` each time), so from its second use on a mask is scanned
        once and its indices are kept per parameter and ``slot``, reused
        while the mask tensor is the same object with the same ``_version``.
        Any in-place torch operation on the mask bumps its version; writes
        through ``.data``, ``.numpy()`` or other foreign views do not, so
        replace the tensor instead of writing into it that way.
        """
        if mask is None or mask.dtype != torch.bool:
            return mask
        cache: dict[tuple[int, str], tuple[Tensor, int, Tensor | None]] = self.__dict__.setdefault(
            "_index_cache", {}
        )
        key = (id(p), slot)
        hit = cache.get(key)
        if hit is None or hit[0] is not mask or hit[1] != mask._version:
            # First sight: the update scans the mask window by window (cheaper
            # than a whole scan up front), and only a mask seen again is indexed.
            cache[key] = (mask, mask._version, None)
            return mask
        if hit[2] is None:
            index = dense_mask_index(
                mask, dense_occupancy=getattr(specified, self._DENSE_OCCUPANCY)
            )
            cache[key] = (mask, mask._version, index)
            return index
        return hit[2]

    def _gather(
        self, group: dict[str, Any], step_masks: dict[int, Tensor]
    ) -> tuple[list[Tensor], list[Tensor], list[Tensor | None]]:
        params, grads, masks = [], [], []
        for p, static in zip(group["params"], group["mask"]):
            if p.grad is None:
                continue
            params.append(p)
            grads.append(p.grad)
            step_mask = step_masks.get(id(p))
            if step_mask is None:
                masks.append(self._indexed(p, static, "group"))
            elif static is None:
                masks.append(self._indexed(p, step_mask, "step"))
            else:
                masks.append(_intersect(static, step_mask, p))
        return params, grads, masks

    @torch.no_grad()
    def step(  # type: ignore[override]
        self, closure: Callable[[], float] | None = None, *, masks: Masks = None
    ) -> float | None:
        """Update the specified entries of every parameter that has a gradient.

        Args:
            closure: Re-evaluates the model and returns the loss.
            masks: Restriction for this step only: a mapping parameter ->
                boolean tensor shaped like it (parameters not in the mapping
                are unrestricted), or a :class:`ParamMask` when the optimizer
                holds named parameters (parameters it does not name are not
                updated). Intersected with the group's ``"mask"`` and with
                what the gradient specifies. A boolean mask passed again (the
                same tensor with the same ``_version``) reuses the indices
                found the previous time; edit masks in place with torch ops
                or pass a new tensor, not through ``.numpy()`` or ``.data``.

        Returns:
            The closure's loss, or ``None``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        step_masks = self._step_masks(masks)
        for group in self.param_groups:
            params, grads, group_masks = self._gather(group, step_masks)
            if params:
                self._step_group(group, params, grads, group_masks)
        return loss

    def _step_group(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        masks: list[Tensor | None],
    ) -> None:
        for p in params:
            state = self.state[p]
            if not state:
                self._init_state(group, p, state)
        slots = [[self.state[p].get(name) for p in params] for name in self._SLOTS]
        self._update(params, grads, masks, *slots, **self._hypers(group))
        for name, values in zip(self._SLOTS, slots):
            for p, value in zip(params, values):
                if value is not None:
                    self.state[p][name] = value

    def _init_state(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> None:
        """Start a parameter's state at its first step (default: nothing to start)."""

    def _hypers(self, group: dict[str, Any]) -> dict[str, Any]:
        """The update's keyword arguments, read from the group."""
        return {name: group[name] for name in (*self._HYPERS, "maximize", "fast")}


class MaskedAdagrad(_MaskedOptimizer):
    r"""Adagrad that updates only the specified entries.

    Equal to :class:`torch.optim.Adagrad` fed the specified entries as a
    sparse COO gradient (see :func:`gradsketch.masked.adagrad` for the
    maths), without building one: masks may be boolean tensors, and the
    gradient may be dense, sparse COO or a :class:`torch.masked.MaskedTensor`.
    Unlike torch's sparse path, weight decay is supported: it is added to the
    gradient at specified entries only. The step count (for ``lr_decay``) is
    per parameter and advances at every step in which the parameter has a
    gradient, as in torch.

    Args:
        params: Parameters or param groups (named parameters allowed). A
            group may carry a static ``"mask"``.
        lr: Learning rate.
        lr_decay: Learning-rate decay.
        weight_decay: L2 penalty, at specified entries only.
        initial_accumulator_value: Starting value of the squared-gradient sum.
        eps: Added to the denominator.
        maximize: Ascend instead of descend.
        fast: Use the gathered fast path (``False``: the reference path).

    Example:
        >>> p = torch.nn.Parameter(torch.arange(8.0).reshape(2, 4))
        >>> opt = MaskedAdagrad([p], lr=0.1, initial_accumulator_value=0.5)
        >>> p.grad = torch.tensor([[0.0, 0.0, 3.0, 0.0], [4.0, 0.0, 5.0, 0.0]])
        >>> _ = opt.step(masks={p: p.grad != 0})
        >>> p.detach()
        tensor([[0.0000, 1.0000, 1.9027, 3.0000],
                [3.9015, 5.0000, 5.9010, 7.0000]])
    """

    _DENSE_OCCUPANCY = "_ADAGRAD_DENSE_WORD_OCCUPANCY"
    _update = staticmethod(F.adagrad)
    _HYPERS = ("lr", "lr_decay", "weight_decay", "eps")
    _SLOTS = ("sum", "step")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-2,
        lr_decay: float = 0,
        weight_decay: float = 0,
        initial_accumulator_value: float = 0,
        eps: float = 1e-10,
        *,
        maximize: bool = False,
        fast: bool = True,
    ) -> None:
        hypers = _checked(
            lr=lr,
            lr_decay=lr_decay,
            weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value,
            eps=eps,
        )
        super().__init__(params, hypers, maximize=maximize, fast=fast)

    def _init_state(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> None:
        state["step"] = torch.tensor(0.0)
        state["sum"] = torch.full_like(
            p, group["initial_accumulator_value"], memory_format=torch.preserve_format
        )


class MaskedAdam(_MaskedOptimizer):
    r"""Lazy Adam that updates moments and step counts only where specified.

    Like :class:`torch.optim.SparseAdam`, an entry's moments change only in
    steps where the entry is specified. By default each entry also keeps its
    own step count, so the bias correction of an entry first specified late
    in training is that of its first update (SparseAdam keeps one count per
    parameter, which under-corrects such entries); ``step_counts=
    "parameter"`` reproduces SparseAdam's counting. With an all-True mask
    this equals :class:`torch.optim.Adam`. See
    :func:`gradsketch.masked.adam` for the maths and the placement of ``eps``.

    Args:
        params: Parameters or param groups (named parameters allowed).
        lr: Learning rate.
        betas: Moment decays ``(beta1, beta2)``.
        eps: Added to the denominator.
        weight_decay: L2 penalty (added to the gradient), at specified
            entries only.
        step_counts: ``"entry"`` (default) or ``"parameter"``.
        maximize: Ascend instead of descend.
        fast: Use the gathered fast path (``False``: the reference path).

    Example:
        >>> p = torch.nn.Parameter(torch.zeros(3))
        >>> opt = MaskedAdam([p], lr=0.1)
        >>> p.grad = torch.ones(3)
        >>> _ = opt.step(masks={p: torch.tensor([True, False, True])})
        >>> p.detach(), opt.state[p]["step"]
        (tensor([-0.1000,  0.0000, -0.1000]), tensor([1, 0, 1], dtype=torch.int32))
    """

    _update = staticmethod(F.adam)
    _HYPERS = ("lr", "eps", "weight_decay", "step_counts")
    _SLOTS = ("exp_avg", "exp_avg_sq", "step")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        *,
        step_counts: F.StepCounts = "entry",
        maximize: bool = False,
        fast: bool = True,
    ) -> None:
        _check_hyper("lr", lr)
        _check_hyper("eps", eps)
        _check_hyper("weight_decay", weight_decay)
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"`betas` must be a pair (beta1, beta2); received {betas!r}.")
        _check_hyper("betas[0]", betas[0], high=1.0)
        _check_hyper("betas[1]", betas[1], high=1.0)
        F.check_step_counts(step_counts)
        hypers = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, step_counts=step_counts
        )
        super().__init__(params, hypers, maximize=maximize, fast=fast)

    def _init_state(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> None:
        if group["step_counts"] == "entry":
            state["step"] = torch.zeros_like(p, dtype=torch.int32)
        else:
            state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _hypers(self, group: dict[str, Any]) -> dict[str, Any]:
        # The group keeps torch's `betas` pair; the update takes the two decays by name.
        hypers = super()._hypers(group)
        hypers["beta1"], hypers["beta2"] = group["betas"]
        return hypers


class MaskedSGD(_MaskedOptimizer):
    r"""SGD with momentum acting only at the specified entries.

    An unspecified entry keeps its parameter value and its momentum buffer;
    a specified entry is updated as by :class:`torch.optim.SGD`, its buffer
    starting from the gradient the first time it is specified. With an
    all-True mask this equals :class:`torch.optim.SGD`. See
    :func:`gradsketch.masked.sgd` for the maths.

    Args:
        params: Parameters or param groups (named parameters allowed).
        lr: Learning rate.
        momentum: Momentum factor.
        dampening: Dampening for momentum.
        weight_decay: L2 penalty, at specified entries only.
        nesterov: Nesterov momentum (needs ``momentum > 0`` and
            ``dampening == 0``).
        maximize: Ascend instead of descend.
        fast: Use the gathered fast path (``False``: the reference path).

    Example:
        >>> p = torch.nn.Parameter(torch.zeros(3))
        >>> opt = MaskedSGD([p], lr=0.1, momentum=0.9)
        >>> p.grad = torch.ones(3)
        >>> for _ in range(2):
        ...     _ = opt.step(masks={p: torch.tensor([True, False, True])})
        >>> p.detach()
        tensor([-0.2900,  0.0000, -0.2900])
    """

    _STATE_DTYPES: ClassVar[dict[str, torch.dtype]] = {"momentum_started": torch.bool}
    _update = staticmethod(F.sgd)
    _HYPERS = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
    # Both start on a parameter's first step with momentum (the update creates them).
    _SLOTS = ("momentum_buffer", "momentum_started")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        momentum: float = 0,
        dampening: float = 0,
        weight_decay: float = 0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        fast: bool = True,
    ) -> None:
        hypers = _checked(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError(
                f"`nesterov=True` needs momentum > 0 and dampening == 0; received "
                f"momentum={momentum!r}, dampening={dampening!r}."
            )
        hypers["nesterov"] = nesterov
        super().__init__(params, hypers, maximize=maximize, fast=fast)
