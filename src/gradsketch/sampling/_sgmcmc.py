"""SGMCMC samplers with exact per-step metrics and count-sketches of every update component.

The update (Welling & Teh 2011; localization as in Lau et al. 2023;
RMSprop preconditioning as in Li et al. 2016), per coordinate::

    d  = o * (g_c * nbeta * grad L + p_c * (gamma * (w - c) + lambda * w))
    w <- w - (eps / 2) * d + sqrt(eps) * n_c * o * xi,     xi ~ N(0, sigma^2)

then optionally ``w <- clamp(w, w0 - b, w0 + b)``. ``c`` is the prior centre
(``w0``, the weights at construction, unless given). Preconditioner
coefficients ``(g_c, p_c, n_c, o)``: identity ``(1, 1, 1, 1)``; mask
``(1, 1, 1, mask)``; RMSprop ``(G, G, sqrt(G), 1)`` with
``V <- alpha V + (1 - alpha) g^2`` and ``G = 1 / (sqrt(V) + eps)``.
"""

from __future__ import annotations

import logging
import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, NamedTuple

import torch
from torch.optim import Optimizer

from gradsketch._checks import integer, positive_int
from gradsketch._hash import TensorDigest
from gradsketch.masked import MaskLike
from gradsketch.sampling import _reduce
from gradsketch.sampling._metrics import Metrics
from gradsketch.sketch import CountSketch, Fingerprint, SketchBuffer, _native

logger = logging.getLogger(__name__)

__all__ = [
    "SGLD",
    "SGMCMC",
    "PRECONDITIONERS",
    "AdamPreconditioner",
    "IdentityPreconditioner",
    "NoseHooverThermostat",
    "Preconditioner",
    "PreconditionerCoefs",
    "RMSpropPreconditioner",
    "register_preconditioner",
]

Scalar = float | torch.Tensor


@dataclass(frozen=True)
class PreconditionerCoefs:
    """Per-coordinate coefficients of the update (floats or tensors shaped like the parameter).

    Attributes:
        grad_coef: ``g_c``, multiplies ``nbeta * grad L``.
        prior_coef: ``p_c``, multiplies the prior gradient.
        noise_coef: ``n_c``, multiplies the injected noise.
        overall_coef: ``o``, multiplies everything (masks live here).
        drift: replaces ``grad L`` in the scaled gradient when not None (Adam's
            first moment); the unscaled gradient always records ``grad L``.
    """

    grad_coef: Scalar = 1.0
    prior_coef: Scalar = 1.0
    noise_coef: Scalar = 1.0
    overall_coef: Scalar = 1.0
    drift: torch.Tensor | None = None


class Preconditioner(ABC):
    """Diagonal preconditioner: subclasses implement :meth:`coefficients`.

    ``dynamics`` is ``"langevin"`` (the update in the module docstring) or
    ``"nose_hoover"`` (momentum with a thermostat, see
    :class:`NoseHooverThermostat`).
    """

    dynamics: ClassVar[str] = "langevin"
    #: True when every coefficient is the scalar 1 (enables the fused fast path).
    is_identity: ClassVar[bool] = False

    @abstractmethod
    def coefficients(
        self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any]
    ) -> PreconditionerCoefs:
        """Coefficients for one parameter; may update ``state`` (running moments)."""


#: Registry of preconditioners by name; ``SGMCMC(preconditioner=name)`` looks names up here.
PRECONDITIONERS: dict[str, type[Preconditioner]] = {}


def register_preconditioner(
    name: str,
) -> Callable[[type[Preconditioner]], type[Preconditioner]]:
    """Class decorator adding a :class:`Preconditioner` to :data:`PRECONDITIONERS`.

    Example:
        >>> @register_preconditioner("half")
        ... class Half(Preconditioner):
        ...     def coefficients(self, param, grad, state):
        ...         return PreconditionerCoefs(grad_coef=0.5)
        >>> "half" in PRECONDITIONERS
        True
        >>> del PRECONDITIONERS["half"]
    """

    def decorate(cls: type[Preconditioner]) -> type[Preconditioner]:
        if name in PRECONDITIONERS:
            raise ValueError(
                f"preconditioner name {name!r} is already registered to "
                f"{PRECONDITIONERS[name].__name__}; choose another name."
            )
        PRECONDITIONERS[name] = cls
        return cls

    return decorate


_IDENTITY_COEFS = PreconditionerCoefs()


@register_preconditioner("identity")
class IdentityPreconditioner(Preconditioner):
    """No preconditioning: ``(g_c, p_c, n_c, o) = (1, 1, 1, 1)``."""

    is_identity = True

    def coefficients(
        self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any]
    ) -> PreconditionerCoefs:
        """All ones."""
        return _IDENTITY_COEFS

    def __repr__(self) -> str:
        return "IdentityPreconditioner()"


@register_preconditioner("rmsprop")
class RMSpropPreconditioner(Preconditioner):
    """RMSprop preconditioning: coefs ``(G, G, sqrt(G), 1)``.

    ``V <- alpha V + (1 - alpha) g^2`` and ``G = 1 / (sqrt(V) + eps)``.

    Li, Chen, Carlson & Carin, "Preconditioned Stochastic Gradient Langevin
    Dynamics for Deep Neural Networks" (AAAI 2016).
    """

    def __init__(self, alpha: float = 0.99, eps: float = 0.1) -> None:
        _check_range("alpha", alpha, 0.0, 1.0, "a decay in [0, 1), e.g. 0.99")
        _check_positive("eps", eps)
        self.alpha = float(alpha)
        self.eps = float(eps)

    def coefficients(
        self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any]
    ) -> PreconditionerCoefs:
        """Update the running square average and return ``(G, G, sqrt(G), 1)``."""
        if "square_avg" not in state:
            state["square_avg"] = torch.zeros_like(grad)
        v = state["square_avg"]
        v.mul_(self.alpha).addcmul_(grad, grad, value=1.0 - self.alpha)
        g = v.sqrt().add_(self.eps).reciprocal_()  # 1 / (sqrt(V) + eps), one allocation
        return PreconditionerCoefs(grad_coef=g, prior_coef=g, noise_coef=g.sqrt())

    def __repr__(self) -> str:
        return f"RMSpropPreconditioner(alpha={self.alpha}, eps={self.eps})"


@register_preconditioner("adam")
class AdamPreconditioner(Preconditioner):
    """Adam-style SGLD: bias-corrected moments, drift ``m_hat``, coefs ``(G, G, sqrt(G), 1)``.

    ``m <- b1 m + (1 - b1) g``, ``V <- b2 V + (1 - b2) g^2``,
    ``G = 1 / (sqrt(V / (1 - b2^t)) + eps)``; the scaled gradient uses
    ``m / (1 - b1^t)`` in place of ``g`` (Kim, Song & Liang, "Stochastic
    gradient Langevin dynamics with adaptive drifts", 2022).
    """

    def __init__(self, betas: tuple[float, float] = (0.9, 0.999), eps: float = 0.1) -> None:
        if not (isinstance(betas, Sequence) and len(betas) == 2):
            raise ValueError(f"`betas` must be a pair (b1, b2), got {betas!r}; e.g. (0.9, 0.999).")
        _check_range("betas[0]", betas[0], 0.0, 1.0, "a decay in [0, 1), e.g. 0.9")
        _check_range("betas[1]", betas[1], 0.0, 1.0, "a decay in [0, 1), e.g. 0.999")
        _check_positive("eps", eps)
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)

    def coefficients(
        self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any]
    ) -> PreconditionerCoefs:
        """Update both moments and return the bias-corrected coefficients and drift."""
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(grad)
            state["exp_avg_sq"] = torch.zeros_like(grad)
            state["adam_step"] = 0
        b1, b2 = self.betas
        state["adam_step"] += 1
        t = state["adam_step"]
        state["exp_avg"].mul_(b1).add_(grad, alpha=1.0 - b1)
        state["exp_avg_sq"].mul_(b2).addcmul_(grad, grad, value=1.0 - b2)
        # 1 / (sqrt(V / (1 - b2^t)) + eps), one allocation.
        g = state["exp_avg_sq"].div(1.0 - b2**t).sqrt_().add_(self.eps).reciprocal_()
        drift = state["exp_avg"] / (1.0 - b1**t)
        return PreconditionerCoefs(grad_coef=g, prior_coef=g, noise_coef=g.sqrt(), drift=drift)

    def __repr__(self) -> str:
        return f"AdamPreconditioner(betas={self.betas}, eps={self.eps})"


@register_preconditioner("nht")
class NoseHooverThermostat(Preconditioner):
    """Nosé-Hoover thermostat dynamics (SGNHT; Ding et al., NeurIPS 2014).

    Per parameter group, with momentum ``v`` (initially ``sqrt(eps) N(0, 1)``
    from the noise generator) and thermostat ``xi`` (initially ``A``)::

        f  =  nbeta grad L + gamma (w - c) + lambda w
        v  <- v - eps * f - xi * v + sqrt(2 A eps) * N(0, sigma^2)
        w  <- w + v
        xi <- xi + |v|^2 / n - eps

    The thermostat really acts: ``xi`` rises while the kinetic energy is above
    its target and damps the momentum. Recorded components are the terms of
    the momentum change (``eps`` in place of ``eps / 2``; ``noise`` is
    ``sqrt(2 A eps) N``).
    """

    dynamics = "nose_hoover"

    def __init__(self, diffusion_factor: float = 0.01) -> None:
        _check_positive("diffusion_factor", diffusion_factor)
        self.diffusion_factor = float(diffusion_factor)

    def coefficients(
        self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any]
    ) -> PreconditionerCoefs:
        """Scalar coefficients; the thermostat lives in the sampler's group state."""
        return PreconditionerCoefs(noise_coef=math.sqrt(2.0 * self.diffusion_factor))

    def __repr__(self) -> str:
        return f"NoseHooverThermostat(diffusion_factor={self.diffusion_factor})"


def _check_positive(name: str, value: object, *, allow_zero: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):  # type: ignore[operator]
        kind = "a non-negative" if allow_zero else "a positive"
        raise ValueError(f"`{name}` must be {kind} finite number, got {value!r}.")
    return float(value)  # type: ignore[arg-type]


def _check_range(name: str, value: object, low: float, high: float, hint: str) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not (low <= value < high):  # type: ignore[operator]
        raise ValueError(f"`{name}` must be in [{low}, {high}), got {value!r}; use {hint}.")


def _resolve_preconditioner(spec: object, kwargs: dict[str, Any]) -> Preconditioner:
    if isinstance(spec, Preconditioner):
        if kwargs:
            raise ValueError(
                "`preconditioner_kwargs` only apply to a preconditioner given by name, got "
                f"{kwargs!r} with the instance {spec!r}; pass the options to its constructor."
            )
        return spec
    if spec is None:
        spec = "identity"
    if not isinstance(spec, str) or spec not in PRECONDITIONERS:
        raise ValueError(
            f"`preconditioner` must be one of {sorted(PRECONDITIONERS)} or a Preconditioner "
            f"instance, got {spec!r}; register new ones with @register_preconditioner(name)."
        )
    try:
        return PRECONDITIONERS[spec](**kwargs)
    except TypeError as err:
        raise ValueError(
            f"`preconditioner_kwargs` {kwargs!r} do not fit preconditioner {spec!r}: {err}"
        ) from err


def _mask_fingerprint(masks: Sequence[torch.Tensor | None]) -> str:
    digest = TensorDigest()
    for m in masks:
        if m is None:
            digest.text("all")
        else:
            digest.text(str(tuple(m.shape))).tensor(m.bool())
    return digest.hexdigest()


_PRIOR_FORMS = (
    "None",
    "'initial' (centre w0, gamma = 1)",
    "a float gamma (centre w0)",
    "an iterable of centre tensors aligned with the parameters (gamma = 1)",
)


@dataclass
class _GroupPlan:
    """What a parameter group's step needs; fixed at construction or cached between steps."""

    numel: int
    offset: int  # first coordinate of the group in the sketch's index space
    folded: torch.Tensor | None = None  # [numel] int16/32/64 count-sketch table (2k = trash)
    # Workspace [r, numel] and, per parameter, its rows as views shaped like the parameter.
    workspace: torch.Tensor | None = None
    workspace_names: tuple[str, ...] = ()
    views: list[dict[str, torch.Tensor]] | None = None
    # Coefficients C[6, r] turning the workspace rows into the six components,
    # valid while `coef_key` (the hyperparameters) is unchanged.
    coef_key: tuple[Any, ...] | None = None
    coef: torch.Tensor | None = None
    sketch_rows: int = 0  # leading workspace rows that feed a sketched component
    sketch_coef: torch.Tensor | None = None  # C[:5, :sketch_rows] in float32
    scratch: torch.Tensor | None = None  # [sketch_rows, 2k + 1] scatter target
    index_buffer: torch.Tensor | None = None  # int64 [REDUCE_TILE]: a widened table tile
    # [2, largest numel] noise and (w - c) of the unrecorded identity step, reused:
    # fresh megabyte temporaries cost page faults in a loop with backward passes.
    step_scratch: torch.Tensor | None = None
    # Zeros standing in for the gradient of a parameter that has none, when the
    # native kernels read gradients in place (see SGMCMC._direct_grads).
    zeros: torch.Tensor | None = None


#: Largest group (coordinates) whose count-sketch table is kept in int64 (128 MB).
WIDE_TABLE_MAX = 1 << 24


def _step_scratch(
    plan: _GroupPlan, params: list[torch.Tensor], p: torch.Tensor
) -> torch.Tensor | None:
    """Two reusable ``p``-shaped buffers (noise, w - c); None for a parameter they cannot hold."""
    buf = plan.step_scratch
    if buf is None or buf.dtype != p.dtype or buf.device != p.device:
        largest = max(q.numel() for q in params if q.dtype == p.dtype and q.device == p.device)
        buf = plan.step_scratch = torch.empty(2, largest, dtype=p.dtype, device=p.device)
    if buf.shape[1] < p.numel():
        return None
    return buf[:, : p.numel()].view(2, *p.shape)


def _scaled_into(out: torch.Tensor, src: torch.Tensor, *coefs: Scalar) -> float:
    """``out = src * (tensor coefs)``; returns the product of the scalar ones."""
    scalar = 1.0
    first = True
    for c in coefs:
        if isinstance(c, torch.Tensor):
            if first:
                torch.mul(src, c, out=out)
                first = False
            else:
                out.mul_(c)
        else:
            scalar *= float(c)
    if first:
        out.copy_(src)
    return scalar


class _GeneralStep(NamedTuple):
    """What one parameter's non-identity update needs, besides where it writes."""

    coefs: PreconditionerCoefs
    overall: Scalar  # o, times the mask when there is one
    drive: torch.Tensor  # grad L, or the preconditioner's drift
    center: torch.Tensor  # c of the prior
    state: dict[str, Any]
    group: dict[str, Any]
    gen: torch.Generator | None
    half: float  # eps / 2 (eps under Nosé-Hoover)
    root: float  # sqrt(eps)
    nose_hoover: bool


def _apply_general_recorded(
    p: torch.Tensor, rows: dict[str, torch.Tensor] | None, step: _GeneralStep
) -> None:
    """The update component by component, each written to its row, then applied.

    Without ``rows`` (no scratch could hold this parameter) the components
    are fresh tensors.
    """
    coefs, overall, drive, center, state, group, gen, half, root, nose_hoover = step
    nbeta, sigma = group["nbeta"], group["noise_level"]
    gamma, lam = group["localization"], group["weight_decay"]
    grad = p.grad
    assert grad is not None

    def out(name: str) -> torch.Tensor:
        return rows[name] if rows is not None else torch.empty_like(p)

    noise = out("noise").normal_(0.0, sigma, generator=gen)
    scaled = out("scaled_grad")
    scaled.mul_(half * nbeta * _scaled_into(scaled, drive, overall, coefs.grad_coef))
    loc, wd = out("localization"), out("weight_decay")
    for row, weight, src in ((loc, gamma, None), (wd, lam, p)):
        if not weight:
            row.zero_()
            continue
        if src is None:
            torch.sub(p, center, out=row)
        else:
            row.copy_(src)
        row.mul_(half * weight * _scaled_into(row, row, coefs.prior_coef, overall))
    noise.mul_(root * _scaled_into(noise, noise, coefs.noise_coef, overall))
    if rows is not None:
        rows["unscaled_grad"].copy_(grad).mul_(half * nbeta)
        torch.sub(p, state["initial_param"], out=rows["distance"])
    target = p
    if nose_hoover:
        target = state["momentum"]
        target.mul_(1.0 - float(group["thermostat"]))
    target.sub_(scaled).sub_(loc).sub_(wd).add_(noise)
    if target is not p:
        p.add_(target)


def _apply_general(p: torch.Tensor, scratch: torch.Tensor, step: _GeneralStep) -> None:
    """The unrecorded general update with two buffers, in place.

    ``delta = -(eps/2) o g_c nbeta drive - (eps/2) o p_c (gamma (w - c) + lambda w)
    + sqrt(eps) o n_c xi``, added to ``w`` (Langevin) or to the momentum
    (Nosé-Hoover, then ``w += v``); ``xi`` is drawn from ``gen`` exactly as
    the recorded path draws it.
    """
    coefs, overall, drive, center, state, group, gen, half, root, nose_hoover = step
    nbeta, sigma = group["nbeta"], group["noise_level"]
    gamma, lam = group["localization"], group["weight_decay"]
    a, b = scratch[0], scratch[1]
    # The prior gradient first, while w is unchanged.
    prior_scale = 0.0
    if gamma or lam:
        if gamma:
            torch.sub(p, center, out=b).mul_(gamma)
            if lam:
                b.add_(p, alpha=lam)
        else:
            torch.mul(p, lam, out=b)
        prior_scale = -half * _scaled_into(b, b, coefs.prior_coef, overall)
    grad_scale = -half * nbeta * _scaled_into(a, drive, coefs.grad_coef, overall)
    target = p
    if nose_hoover:
        target = state["momentum"]
        target.mul_(1.0 - float(group["thermostat"]))
    target.add_(a, alpha=grad_scale)
    if prior_scale:
        target.add_(b, alpha=prior_scale)
    a.normal_(0.0, sigma, generator=gen)
    noise_scale = root * _scaled_into(a, a, coefs.noise_coef, overall)
    target.add_(a, alpha=noise_scale)
    if target is not p:
        p.add_(target)


class SGMCMC(Optimizer):
    r"""SGMCMC sampler with exact metrics and count-sketches of each update component.

    The update, per coordinate (``eps`` = ``lr``, ``o`` = overall coefficient
    including the mask)::

        d  = o * (g_c * nbeta * grad L + p_c * (gamma * (w - c) + lambda * w))
        w <- w - (eps / 2) * d + sqrt(eps) * n_c * o * xi,    xi ~ N(0, sigma^2)

    followed by the optional clamp ``w0 - b <= w <= w0 + b``. ``xi`` is drawn
    once per parameter with ``noise_generator`` (``torch.normal`` with the
    same arguments as devinterp 2.0, so equal generators give equal noise).
    Recorded components (all ``[numel]`` vectors over every parameter):

    * ``scaled_grad = (eps/2) o g_c nbeta grad L``
    * ``unscaled_grad = (eps/2) nbeta grad L``
    * ``localization = (eps/2) p_c o gamma (w - c)``
    * ``weight_decay = (eps/2) p_c o lambda w``
    * ``noise = sqrt(eps) n_c o xi``
    * ``distance = w - w0`` before the update.

    With ``save_metrics=True`` :meth:`get_metrics` returns their norms and the
    dot products ``<scaled_grad, prior>``, ``<scaled_grad, noise>``,
    ``<prior, noise>`` (prior = localization + weight decay). With
    ``sketch_dim=k`` :meth:`get_sketches` returns ``S(component)`` for the
    first five, where ``S`` is one :class:`~gradsketch.sketch.CountSketch`
    over all parameters of all groups in order (under a mask, over the
    selected coordinates only; the fingerprint then carries the mask), so
    ``E<S a, S b> = <a, b>``. Both come from one preallocated ``[r, n]`` block
    per group into which the update writes the ``r`` distinct vectors
    (identity preconditioner: gradient, noise, distance and, when used, the
    weights; otherwise the five components). After the update, one pass
    over the rows gives the Gram matrix (every norm and inner product,
    accumulated in float64) and, through :meth:`CountSketch.folded_table`,
    the sketch of every row; a ``[6, r]`` coefficient matrix maps both to
    the components. On CPU with the native kernels
    (:mod:`gradsketch.sketch._native`) that pass is one fused kernel that
    reads the gradients where autograd left them; otherwise it is a batched
    matmul and a torch scatter over a copy of them.

    Recording reads each gradient once, in one pass after the update (see
    :mod:`gradsketch.sampling._reduce`); ``benchmarks/bench_sampling.py``
    measures what it adds to a plain step.

    Args:
        params: Parameters or parameter-group dicts, as for any optimizer.
        lr: Step size ``eps``.
        noise_level: ``sigma``; 1 for posterior sampling.
        nbeta: Inverse temperature times sample size, ``nbeta`` (see
            :func:`~gradsketch.sampling.default_nbeta`).
        prior: Localization prior: None, ``"initial"``, a float ``gamma`` or
            centre tensors. The factories set ``localization`` / ``weight_decay``.
        preconditioner: A name in :data:`PRECONDITIONERS` or an instance.
        preconditioner_kwargs: Options for a preconditioner given by name.
        bounding_box_size: ``b``; clamp to ``w0 +- b`` when set.
        mask: Per-parameter bool tensors aligned with the parameters (None
            entries move freely) or a ``gradsketch.masked.ParamMask``.
        save_metrics: Record :class:`Metrics` each step.
        sketch_dim: Record count-sketches of size ``k`` each step.
        sketch_seed: Seed of the count sketch.

    References:
        Welling & Teh, "Bayesian Learning via Stochastic Gradient Langevin
        Dynamics" (ICML 2011); Lau, Furman, Wang, Murfet & Wei, "The Local
        Learning Coefficient: A Singularity-Aware Complexity Measure" (2023).

    Example:
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> w = torch.nn.Parameter(torch.ones(3))
        >>> opt = SGMCMC.sgld(
        ...     [w], lr=0.1, nbeta=10.0, localization=1.0, save_metrics=True, sketch_dim=4
        ... )
        >>> (w**2).sum().backward()
        >>> opt.step(noise_generator=torch.Generator().manual_seed(0))
        >>> round(float(opt.get_metrics().unscaled_grad), 4)  # 0.05 * 10 * |2w| = 0.5 * sqrt(12)
        1.7321
        >>> opt.get_sketches().noise.shape
        torch.Size([4])
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        *,
        lr: float = 0.01,
        noise_level: float = 1.0,
        nbeta: float = 1.0,
        prior: object = None,
        preconditioner: str | Preconditioner = "identity",
        preconditioner_kwargs: dict[str, Any] | None = None,
        bounding_box_size: float | None = None,
        mask: MaskLike | Sequence[torch.Tensor | None] | torch.Tensor | None = None,
        save_metrics: bool = False,
        sketch_dim: int | None = None,
        sketch_seed: int = 0,
        localization: float = 0.0,
        weight_decay: float = 0.0,
    ) -> None:
        if isinstance(params, (torch.Tensor, dict)):
            params = [params]  # type: ignore[list-item,assignment]
        _check_positive("lr", lr)
        _check_positive("noise_level", noise_level, allow_zero=True)
        _check_positive("nbeta", nbeta)
        _check_positive("localization", localization, allow_zero=True)
        _check_positive("weight_decay", weight_decay, allow_zero=True)
        if bounding_box_size is not None:
            _check_positive("bounding_box_size", bounding_box_size)
        positive_int("sketch_dim", sketch_dim, optional=True, fix="pass e.g. sketch_dim=1024")
        integer("sketch_seed", sketch_seed)
        defaults = dict(
            lr=float(lr),
            noise_level=float(noise_level),
            nbeta=float(nbeta),
            prior=prior,
            preconditioner=preconditioner,
            preconditioner_kwargs=dict(preconditioner_kwargs or {}),
            bounding_box_size=bounding_box_size,
            mask=mask,
            localization=float(localization),
            weight_decay=float(weight_decay),
        )
        super().__init__(params, defaults)
        self.save_metrics = bool(save_metrics)
        self.save_sketches = sketch_dim is not None
        self._last_metrics: Metrics | None = None
        self._plans: list[_GroupPlan] = []
        mask_fps: list[str] = []
        offset = 0
        for group in self.param_groups:
            self._init_group(group)
            numel = sum(p.numel() for p in group["params"])
            self._plans.append(_GroupPlan(numel=numel, offset=offset))
            if group["masks"] is not None:
                offset += int(sum(int(m.sum()) for m in group["masks"]))
                mask_fps.append(group["mask_fingerprint"])
            else:
                offset += numel
        self._sketch: CountSketch | None = None
        self._sketch_buf: SketchBuffer | None = None
        self._sketch_rows: torch.Tensor | None = None
        if sketch_dim is not None:
            self._init_sketch(sketch_dim, sketch_seed, offset, mask_fps)

    # ------------------------------------------------------------------ setup
    def _init_group(self, group: dict[str, Any]) -> None:
        params: list[torch.Tensor] = list(group["params"])
        group["preconditioner"] = _resolve_preconditioner(
            group["preconditioner"], group.pop("preconditioner_kwargs", {}) or {}
        )
        centers = self._resolve_prior(group, params)
        masks = self._resolve_mask(group.get("mask"), params)
        group["masks"] = masks
        if isinstance(group.get("mask"), MaskLike):
            # The ParamMask's own digest, so sketches name the mask users built.
            group["mask_fingerprint"] = group["mask"].fingerprint
        else:
            group["mask_fingerprint"] = _mask_fingerprint(masks) if masks is not None else None
        if masks is not None and group["preconditioner"].dynamics == "nose_hoover":
            raise ValueError(
                "`mask` is not supported with the Nose-Hoover thermostat (SGNHT): its "
                "kinetic energy is defined over all coordinates. Use SGMCMC.sgld or "
                "SGMCMC.rmsprop_sgld with a mask, or restrict `params` instead."
            )
        for i, p in enumerate(params):
            state = self.state[p]
            state["param_idx"] = i
            state["initial_param"] = p.detach().clone()
            if centers is not None:
                state["prior_center"] = centers[i]
        if group["preconditioner"].dynamics == "nose_hoover":
            group["thermostat"] = torch.tensor(
                group["preconditioner"].diffusion_factor, dtype=torch.float64
            )

    @staticmethod
    def _resolve_prior(
        group: dict[str, Any], params: list[torch.Tensor]
    ) -> list[torch.Tensor] | None:
        prior = group["prior"]
        if prior is None:
            return None
        if isinstance(prior, str):
            if prior != "initial":
                raise ValueError(
                    f"`prior` must be one of: {', '.join(_PRIOR_FORMS)}; got {prior!r}."
                )
            group["localization"] = group["localization"] or 1.0
            return None
        if isinstance(prior, (int, float)) and not isinstance(prior, bool):
            group["localization"] = _check_positive("prior", prior, allow_zero=True)
            return None
        if isinstance(prior, Iterable):
            centers = [torch.as_tensor(c) for c in prior]
            if len(centers) != len(params) or any(
                c.shape != p.shape for c, p in zip(centers, params)
            ):
                raise ValueError(
                    f"`prior` centres must match the parameters one to one: got shapes "
                    f"{[tuple(c.shape) for c in centers]} for parameters "
                    f"{[tuple(p.shape) for p in params]}."
                )
            group["localization"] = group["localization"] or 1.0
            return [c.detach().to(p.device, p.dtype).clone() for c, p in zip(centers, params)]
        raise ValueError(
            f"`prior` must be one of: {', '.join(_PRIOR_FORMS)}; got {type(prior).__name__}."
        )

    @staticmethod
    def _resolve_mask(mask: Any, params: list[torch.Tensor]) -> list[torch.Tensor] | None:
        if mask is None:
            return None
        if isinstance(mask, MaskLike):
            per_param = [m for _, m in mask.items()]
            if len(per_param) != len(params):
                raise ValueError(
                    f"`mask` is a ParamMask over {len(per_param)} parameters but the group "
                    f"has {len(params)}; build it from the same model, e.g. "
                    "ParamMask.from_patterns(model, ...), and pass model.parameters()."
                )
            mask = [m != 0 for m in per_param]
        if isinstance(mask, torch.Tensor):
            mask = [mask]
        if not isinstance(mask, (list, tuple)):
            raise ValueError(
                "`mask` must be a list of bool tensors aligned with the parameters (None for "
                f"a free parameter) or a gradsketch.masked.ParamMask, got {type(mask).__name__}."
            )
        if len(mask) != len(params):
            raise ValueError(
                f"`mask` has {len(mask)} entries but the group has {len(params)} parameters; "
                "give one bool tensor (or None) per parameter, in order."
            )
        out = []
        for i, (m, p) in enumerate(zip(mask, params)):
            if m is None:
                m = torch.ones_like(p, dtype=torch.bool)
            m = torch.as_tensor(m, device=p.device)
            if m.shape != p.shape:
                raise ValueError(
                    f"`mask[{i}]` has shape {tuple(m.shape)} but its parameter has shape "
                    f"{tuple(p.shape)}; masks are per entry, the same shape as the parameter."
                )
            out.append(m.to(torch.bool))
        return out

    def _init_sketch(self, k: int, seed: int, total: int, mask_fps: list[str]) -> None:
        device = next(iter(self.param_groups[0]["params"])).device
        if total < 1:
            raise ValueError(
                "`sketch_dim` was given but no coordinate is selected (the mask selects "
                "nothing); select at least one entry or leave `sketch_dim=None`."
            )
        self._sketch = CountSketch.create(total, k, seed, device=device)
        fp = self._sketch.fingerprint
        if mask_fps:
            fp = replace(fp, mask=mask_fps[0] if len(mask_fps) == 1 else "+".join(mask_fps))
        # One [5, k] block whose rows are the buffer's fields: a step adds into
        # all five with one matmul.
        self._sketch_rows = torch.zeros(5, k, dtype=torch.float32, device=device)
        rows = dict(zip(SketchBuffer.QUANTITIES, self._sketch_rows.unbind(0)))
        self._sketch_buf = SketchBuffer(**rows, fingerprint=fp)
        trash = 2 * k
        for group, plan in zip(self.param_groups, self._plans):
            # torch's scatter takes int64 indices. Without the native kernels
            # (which read any width), up to WIDE_TABLE_MAX coordinates the table
            # is kept in int64 (8 bytes each): widening narrow tiles cost 0.7 ms
            # of a 1M-coordinate step's 2.2 ms sketch. Otherwise the table has
            # the narrowest type that holds 2k + 1 buckets (2 or 4 bytes each),
            # widened tile by tile when torch scatters (reduce_workspace).
            if plan.numel <= WIDE_TABLE_MAX and not _native.available(device):
                narrow = torch.int64
            else:
                narrow = torch.int16 if trash < 2**15 else torch.int32
            if group["masks"] is None:
                plan.folded = self._sketch.folded_table(plan.offset, plan.numel).to(narrow)
                continue
            sel = torch.cat([m.reshape(-1) for m in group["masks"]])
            table = torch.full((plan.numel,), trash, dtype=narrow, device=device)
            count = int(sel.sum())
            table[sel] = self._sketch.folded_table(plan.offset, count).to(narrow)
            plan.folded = table

    @property
    def sketch(self) -> CountSketch:
        """The count sketch applied to every component (raises without ``sketch_dim``)."""
        if self._sketch is None:
            raise RuntimeError("Sketches not enabled. Pass sketch_dim=k to the sampler.")
        return self._sketch

    @property
    def sketch_fingerprint(self) -> Fingerprint:
        """Fingerprint of the recorded sketches (carries the mask fingerprint under a mask)."""
        if self._sketch_buf is None or self._sketch_buf.fingerprint is None:
            raise RuntimeError("Sketches not enabled. Pass sketch_dim=k to the sampler.")
        return self._sketch_buf.fingerprint

    # ------------------------------------------------------------------- step
    @torch.no_grad()
    def step(  # type: ignore[override]
        self,
        closure: Callable[[], Any] | None = None,
        noise_generator: torch.Generator | None = None,
    ) -> Any:
        """One sampler step (see the class docstring for the update and what is recorded).

        Args:
            closure: Re-evaluates the model and returns the loss (run with grad enabled).
            noise_generator: Generator for ``xi``; None uses torch's global generator.

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._sketch_rows is not None:
            self._sketch_rows.zero_()
        gram = torch.zeros(6, 6, dtype=torch.float64) if self.save_metrics else None
        numel = 0
        for group, plan in zip(self.param_groups, self._plans):
            g_gram, g_numel = self._step_group(group, plan, noise_generator)
            if gram is not None and g_gram is not None:
                gram += g_gram
            numel += g_numel
        if gram is not None:
            self._last_metrics = Metrics.from_gram(gram, numel)
        return loss

    def _step_group(
        self, group: dict[str, Any], plan: _GroupPlan, gen: torch.Generator | None
    ) -> tuple[torch.Tensor | None, int]:
        params: list[torch.Tensor] = list(group["params"])
        precond: Preconditioner = group["preconditioner"]
        record = self.save_metrics or self.save_sketches
        nose_hoover = precond.dynamics == "nose_hoover"
        fast = precond.is_identity and group["masks"] is None and not nose_hoover
        lr, nbeta = group["lr"], group["nbeta"]
        gamma, lam = group["localization"], group["weight_decay"]
        half = lr if nose_hoover else 0.5 * lr
        root = math.sqrt(lr)
        explicit_center = any("prior_center" in self.state[p] for p in params)

        # Rows of the per-group block and the coefficients C[6, r] that turn
        # them into the six components. Identity: distinct raw vectors with
        # scalar coefficients. Otherwise: the components themselves (C = I).
        if fast:
            names = ["grad", "noise"]
            if lam:
                names.append("weight")
            if gamma and explicit_center:
                names.append("center_diff")
            names.append("distance")
        else:
            names = ["scaled_grad", "unscaled_grad", "localization", "weight_decay", "noise"]
            names.append("distance")
        block: torch.Tensor | None = None
        views: list[dict[str, torch.Tensor]] | None = None
        direct = record and fast and self._direct_grads(params)
        if record:
            # Reading gradients in place, the workspace holds the other rows.
            block, views = self._workspace(group, plan, names[1:] if direct else names, params)
        numel = 0
        energy = torch.zeros((), dtype=torch.float64)
        for i, p in enumerate(params):
            if p.grad is None:
                if views is not None:
                    for view in views[i].values():
                        view.zero_()
                continue
            state = self.state[p]
            rows = None if views is None else views[i]
            scratch = None if rows is not None else _step_scratch(plan, params, p)
            if fast:
                numel += p.numel()
                self._update_identity(p, state, group, rows, gen, scratch)
            else:
                numel += self._update_general(
                    p, state, group, precond, rows, gen, half, root, scratch
                )
                if nose_hoover:
                    energy += state["momentum"].double().square().sum()
            if group["bounding_box_size"] is not None:
                b = group["bounding_box_size"]
                w0 = state["initial_param"]
                if nose_hoover:
                    # Reflect the momentum of coordinates that hit a wall.
                    hit = (p - w0).abs() > b
                    state["momentum"].mul_(1.0 - 2.0 * hit.to(p.dtype))
                torch.clamp_(p, min=w0 - b, max=w0 + b)
        if nose_hoover and plan.numel:
            group["thermostat"] += energy / plan.numel - lr
        if block is None:
            return None, numel
        coef = self._coefficients(
            plan, names, fast, half=half, root=root, nbeta=nbeta, gamma=gamma, lam=lam
        )
        segments = self._segments(plan, params, views) if direct else None
        small = self._reduce(block, plan, segments)
        gram = None if small is None else coef @ small @ coef.T
        return gram, numel

    def _workspace(
        self,
        group: dict[str, Any],
        plan: _GroupPlan,
        names: list[str],
        params: list[torch.Tensor],
    ) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
        """The group's ``[r, numel]`` rows and per-parameter views, allocated once.

        The update writes every recorded vector straight into its row (no
        block copy afterwards); the views are cached because building ``r``
        views per parameter per step is measurable Python overhead.
        """
        dtype = torch.promote_types(params[0].dtype, torch.float32) if params else torch.float32
        device = params[0].device if params else torch.device("cpu")
        ws = plan.workspace
        if (
            ws is None
            or ws.shape != (len(names), plan.numel)
            or ws.dtype != dtype
            or ws.device != device
            or plan.views is None
            or plan.workspace_names != tuple(names)
        ):
            ws = torch.empty(len(names), plan.numel, dtype=dtype, device=device)
            views: list[dict[str, torch.Tensor]] = []
            offset = 0
            for p in params:
                cols = slice(offset, offset + p.numel())
                views.append({name: ws[i, cols].view(p.shape) for i, name in enumerate(names)})
                offset += p.numel()
            plan.workspace, plan.views, plan.workspace_names = ws, views, tuple(names)
        assert plan.views is not None
        return ws, plan.views

    def _coefficients(
        self,
        plan: _GroupPlan,
        names: list[str],
        fast: bool,
        *,
        half: float,
        root: float,
        nbeta: float,
        gamma: float,
        lam: float,
    ) -> torch.Tensor:
        """``C[6, r]`` (float64) with ``components = C @ rows``; cached per hyperparameters."""
        key = (fast, tuple(names), half, root, nbeta, gamma, lam)
        if plan.coef_key == key and plan.coef is not None:
            return plan.coef
        row = {n: i for i, n in enumerate(names)}
        coef = torch.zeros(6, len(names), dtype=torch.float64)
        if fast:
            coef[0, row["grad"]] = coef[1, row["grad"]] = half * nbeta
            coef[2, row.get("center_diff", row["distance"])] = half * gamma
            if lam:
                coef[3, row["weight"]] = half * lam
            coef[4, row["noise"]] = root
            coef[5, row["distance"]] = 1.0
        else:
            coef[:, :] = torch.eye(6, dtype=torch.float64)
        # Rows feeding a sketched component always form a prefix of the block
        # (distance, which no sketch needs, comes last), so one contiguous
        # slice is sketched; an unused row inside it only gets a zero coefficient.
        used = (coef[:5] != 0).any(0).nonzero().flatten().tolist()
        plan.sketch_rows = used[-1] + 1 if used else 0
        plan.coef_key, plan.coef = key, coef
        if self._sketch is not None:
            device = self._sketch.device
            plan.sketch_coef = coef[:5, : plan.sketch_rows].to(device, torch.float32)
            plan.scratch = None  # its shape follows sketch_rows and the block dtype
        return coef

    def _reduce(
        self,
        block: torch.Tensor,
        plan: _GroupPlan,
        segments: list[list[torch.Tensor]] | None = None,
    ) -> torch.Tensor | None:
        """Gram matrix of the workspace rows (returned, on CPU) and the step's sketches.

        :func:`~gradsketch.sampling._reduce.reduce_workspace` (of ``segments``
        when given: the gradients are read in place) gives the Gram
        (every norm and inner product, float64 across tiles) and, with
        one scatter into a ``[rows, 2k + 1]`` scratch, the sketch of every
        sketched row at once (signs folded into the bucket index, see
        :meth:`CountSketch.folded_table`); the sketch rows are then combined
        into the five components with one small matmul.
        """
        rows = plan.sketch_rows if self._sketch is not None else 0
        scratch = None
        if rows:
            assert self._sketch is not None and plan.folded is not None
            k = self._sketch.output_dim
            scratch = plan.scratch
            if scratch is None or scratch.dtype != block.dtype:
                scratch = torch.zeros(rows, 2 * k + 1, dtype=block.dtype, device=block.device)
                plan.scratch = scratch
            else:
                scratch.zero_()
            tile = _reduce.REDUCE_TILE
            if plan.folded.dtype != torch.int64 and (
                plan.index_buffer is None or plan.index_buffer.numel() != tile
            ):
                plan.index_buffer = torch.empty(tile, dtype=torch.int64, device=block.device)
        gram = _reduce.reduce_workspace(
            block if segments is None else segments,
            gram=self.save_metrics,
            scratch=scratch,
            folded=plan.folded,
            rows=rows,
            index_buffer=plan.index_buffer,
        )
        if scratch is not None:
            assert self._sketch_rows is not None and plan.sketch_coef is not None
            k = self._sketch.output_dim  # type: ignore[union-attr]
            sk = (scratch[:, :k] - scratch[:, k : 2 * k]).to(torch.float32)
            self._sketch_rows.add_(plan.sketch_coef @ sk)
        return None if gram is None else gram.cpu()

    @staticmethod
    def _direct_grads(params: list[torch.Tensor]) -> bool:
        """Whether the reduction can read every gradient in place (native kernels, CPU).

        It then needs no copy of the gradient into the workspace (0.3 ms of a
        1M-parameter step): each parameter's gradient is a row of its segment
        (:func:`gradsketch.sketch._native.reduce_rows_`).
        """
        if not params or not _native.available(params[0].device):
            return False
        dtype = torch.promote_types(params[0].dtype, torch.float32)
        for p in params:
            g = p.grad
            if g is not None and (
                g.dtype != dtype or g.device != p.device or not g.is_contiguous()
            ):
                return False
        return True

    @staticmethod
    def _segments(
        plan: _GroupPlan, params: list[torch.Tensor], views: list[dict[str, torch.Tensor]] | None
    ) -> list[list[torch.Tensor]]:
        """Per parameter, its rows for the reduction: the gradient, then its workspace rows."""
        assert views is not None
        segments = []
        for p, rows in zip(params, views):
            grad = p.grad
            if grad is None:
                if plan.zeros is None or plan.zeros.numel() < p.numel():
                    plan.zeros = torch.zeros(
                        plan.numel, dtype=torch.promote_types(p.dtype, torch.float32)
                    )
                grad = plan.zeros[: p.numel()]
            segments.append([grad.reshape(-1), *(v.reshape(-1) for v in rows.values())])
        return segments

    def _update_identity(
        self,
        p: torch.Tensor,
        state: dict[str, Any],
        group: dict[str, Any],
        rows: dict[str, torch.Tensor] | None,
        gen: torch.Generator | None,
        scratch: torch.Tensor | None = None,
    ) -> None:
        """The identity update; with ``rows``, records into them first.

        The rows are written before ``p`` moves. Without ``rows``, the noise
        and ``w - c`` go to ``scratch`` (``[2, *p.shape]``) when given (same
        values: one ``normal_`` call draws what ``torch.normal`` would).
        """
        lr, nbeta, sigma = group["lr"], group["nbeta"], group["noise_level"]
        gamma, lam = group["localization"], group["weight_decay"]
        half = 0.5 * lr
        grad = p.grad
        assert grad is not None
        center = state.get("prior_center", state["initial_param"])
        if rows is None:
            if scratch is None:
                noise = torch.normal(
                    0.0, sigma, size=p.shape, generator=gen, device=p.device, dtype=p.dtype
                )
                loc = (p - center) if gamma else None
            else:
                noise = scratch[0].normal_(0.0, sigma, generator=gen)
                loc = torch.sub(p, center, out=scratch[1]) if gamma else None
            if lam:
                # w - (eps/2) lambda w, before anything else moves w.
                p.mul_(1.0 - half * lam)
            if loc is not None:
                p.add_(loc, alpha=-half * gamma)
        else:
            noise = rows["noise"].normal_(0.0, sigma, generator=gen)
            if "grad" in rows:  # else the reduction reads p.grad in place
                rows["grad"].copy_(grad)
            torch.sub(p, state["initial_param"], out=rows["distance"])
            loc = rows["distance"]
            if "center_diff" in rows:
                torch.sub(p, center, out=rows["center_diff"])
                loc = rows["center_diff"]
            if "weight" in rows:
                rows["weight"].copy_(p)
                p.add_(rows["weight"], alpha=-half * lam)
            if gamma:
                p.add_(loc, alpha=-half * gamma)
        p.add_(grad, alpha=-half * nbeta)
        p.add_(noise, alpha=math.sqrt(lr))

    def _update_general(
        self,
        p: torch.Tensor,
        state: dict[str, Any],
        group: dict[str, Any],
        precond: Preconditioner,
        rows: dict[str, torch.Tensor] | None,
        gen: torch.Generator | None,
        half: float,
        root: float,
        scratch: torch.Tensor | None = None,
    ) -> int:
        """Single-tensor path for any preconditioner, mask or the thermostat.

        Recording, it writes each component to its row and applies them as
        written. Otherwise, with ``scratch`` (``[2, *p.shape]``), it applies
        the same update with two reused buffers and no other temporary
        (:func:`_apply_general`); the sum's rounding order differs, so the
        two trajectories may differ in the last bit.
        """
        grad = p.grad
        assert grad is not None
        coefs = precond.coefficients(p, grad, state)
        overall: Scalar = coefs.overall_coef
        masks = group["masks"]
        if masks is not None:
            m = masks[state["param_idx"]].to(p.dtype)
            overall = m * overall
        center = state.get("prior_center", state["initial_param"])
        drive = coefs.drift if coefs.drift is not None else grad
        nose_hoover = precond.dynamics == "nose_hoover"
        if nose_hoover and "momentum" not in state:
            state["momentum"] = math.sqrt(group["lr"]) * torch.normal(
                0.0, 1.0, size=p.shape, generator=gen, device=p.device, dtype=p.dtype
            )
        step = _GeneralStep(
            coefs, overall, drive, center, state, group, gen, half, root, nose_hoover
        )
        if rows is None and scratch is not None:
            _apply_general(p, scratch, step)
        else:
            _apply_general_recorded(p, rows, step)
        if isinstance(overall, torch.Tensor):
            return int(torch.count_nonzero(overall.expand_as(p)))
        return p.numel()

    # ---------------------------------------------------------------- results
    def get_metrics(self) -> Metrics:
        """Metrics of the last step (CPU, float64); RuntimeError without ``save_metrics``."""
        if not self.save_metrics:
            raise RuntimeError("Metrics not enabled. Pass save_metrics=True to the sampler.")
        if self._last_metrics is None:
            return Metrics()
        return self._last_metrics

    def get_sketches(self) -> SketchBuffer:
        """Float32 CPU copy of the last step's sketches; RuntimeError without ``sketch_dim``."""
        if self._sketch_buf is None:
            raise RuntimeError("Sketches not enabled. Pass sketch_dim=k to the sampler.")
        copies = {
            q: getattr(self._sketch_buf, q).detach().to("cpu", torch.float32).clone()
            for q in SketchBuffer.QUANTITIES
        }
        return SketchBuffer(**copies, fingerprint=self._sketch_buf.fingerprint)

    @property
    def thermostats(self) -> list[float]:
        """Current thermostat value of every Nose-Hoover group (empty otherwise)."""
        return [float(g["thermostat"]) for g in self.param_groups if "thermostat" in g]

    # -------------------------------------------------------------- factories
    @classmethod
    def sgld(
        cls,
        params: Iterable[Any],
        lr: float = 0.01,
        noise_level: float = 1.0,
        weight_decay: float = 0.0,
        localization: float = 0.0,
        nbeta: float = 1.0,
        bounding_box_size: float | None = None,
        mask: MaskLike | Sequence[torch.Tensor | None] | torch.Tensor | None = None,
        save_metrics: bool = False,
        sketch_dim: int | None = None,
        sketch_seed: int = 0,
    ) -> SGMCMC:
        """SGLD with localization (Lau et al. 2023): identity preconditioner.

        ``w <- w - (eps/2)(nbeta grad L + gamma (w - w0) + lambda w) + N(0, eps sigma^2)``.
        """
        _advise(noise_level, nbeta)
        return cls(
            params,
            lr=lr,
            noise_level=noise_level,
            nbeta=nbeta,
            localization=localization,
            weight_decay=weight_decay,
            bounding_box_size=bounding_box_size,
            mask=mask,
            save_metrics=save_metrics,
            sketch_dim=sketch_dim,
            sketch_seed=sketch_seed,
        )

    @classmethod
    def rmsprop_sgld(
        cls,
        params: Iterable[Any],
        lr: float = 0.01,
        noise_level: float = 1.0,
        weight_decay: float = 0.0,
        localization: float = 0.0,
        nbeta: float = 1.0,
        alpha: float = 0.99,
        eps: float = 0.1,
        add_grad_correction: bool = False,
        bounding_box_size: float | None = None,
        mask: MaskLike | Sequence[torch.Tensor | None] | torch.Tensor | None = None,
        save_metrics: bool = False,
        sketch_dim: int | None = None,
        sketch_seed: int = 0,
    ) -> SGMCMC:
        """RMSprop-preconditioned SGLD (Li et al. 2016): coefs ``(G, G, sqrt(G), 1)``."""
        if add_grad_correction:
            raise NotImplementedError(
                "`add_grad_correction=True` (the Gamma(theta) term of pSGLD) is not implemented; "
                "leave it False, as devinterp does."
            )
        _advise(noise_level, nbeta)
        return cls(
            params,
            lr=lr,
            noise_level=noise_level,
            nbeta=nbeta,
            localization=localization,
            weight_decay=weight_decay,
            preconditioner="rmsprop",
            preconditioner_kwargs={"alpha": alpha, "eps": eps},
            bounding_box_size=bounding_box_size,
            mask=mask,
            save_metrics=save_metrics,
            sketch_dim=sketch_dim,
            sketch_seed=sketch_seed,
        )

    @classmethod
    def adam_sgld(
        cls,
        params: Iterable[Any],
        lr: float = 0.01,
        noise_level: float = 1.0,
        weight_decay: float = 0.0,
        localization: float = 0.0,
        nbeta: float = 1.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 0.1,
        bounding_box_size: float | None = None,
        mask: MaskLike | Sequence[torch.Tensor | None] | torch.Tensor | None = None,
        save_metrics: bool = False,
        sketch_dim: int | None = None,
        sketch_seed: int = 0,
    ) -> SGMCMC:
        """Adam-preconditioned SGLD with adaptive drift (see :class:`AdamPreconditioner`)."""
        _advise(noise_level, nbeta)
        return cls(
            params,
            lr=lr,
            noise_level=noise_level,
            nbeta=nbeta,
            localization=localization,
            weight_decay=weight_decay,
            preconditioner="adam",
            preconditioner_kwargs={"betas": betas, "eps": eps},
            bounding_box_size=bounding_box_size,
            mask=mask,
            save_metrics=save_metrics,
            sketch_dim=sketch_dim,
            sketch_seed=sketch_seed,
        )

    @classmethod
    def sgnht(
        cls,
        params: Iterable[Any],
        lr: float = 0.01,
        diffusion_factor: float = 0.01,
        nbeta: float = 1.0,
        bounding_box_size: float | None = None,
        save_metrics: bool = False,
        sketch_dim: int | None = None,
        sketch_seed: int = 0,
        localization: float = 0.0,
        weight_decay: float = 0.0,
    ) -> SGMCMC:
        """SGNHT (Ding et al. 2014), thermostat applied (see :class:`NoseHooverThermostat`)."""
        _advise(1.0, nbeta)
        return cls(
            params,
            lr=lr,
            noise_level=1.0,
            nbeta=nbeta,
            localization=localization,
            weight_decay=weight_decay,
            preconditioner="nht",
            preconditioner_kwargs={"diffusion_factor": diffusion_factor},
            bounding_box_size=bounding_box_size,
            save_metrics=save_metrics,
            sketch_dim=sketch_dim,
            sketch_seed=sketch_seed,
        )

    METHODS: ClassVar[tuple[str, ...]] = ("sgld", "rmsprop_sgld", "adam_sgld", "sgnht")

    @classmethod
    def get_method(cls, method: str) -> Callable[..., SGMCMC]:
        """The factory named ``method`` (one of :attr:`METHODS`).

        Example:
            >>> SGMCMC.get_method("sgld") == SGMCMC.sgld
            True
        """
        if method not in cls.METHODS:
            raise ValueError(
                f"`method` must be one of {list(cls.METHODS)}, got {method!r}; "
                "e.g. SGMCMC.get_method('sgld')."
            )
        return getattr(cls, method)  # type: ignore[no-any-return]

    @property
    def device(self) -> torch.device:
        """Device of the first parameter."""
        return next(iter(self.param_groups[0]["params"])).device


def _advise(noise_level: float, nbeta: float) -> None:
    # Advice, not an error: logging keeps test runs with `-W error` quiet.
    if noise_level != 1.0:
        logger.info("noise_level=%s != 1 removes SGLD's posterior-sampling guarantee.", noise_level)
    if nbeta == 1.0:
        logger.info(
            "nbeta=1: LLC estimates will be off; use gradsketch.sampling.default_nbeta(loader)."
        )


class SGLD(SGMCMC):
    """Legacy SGLD (devinterp's ``SGLD`` keywords): :meth:`SGMCMC.sgld` as a class.

    Emits a DeprecationWarning, like devinterp's. ``step`` accepts the same
    ``closure`` / ``noise_generator`` as :class:`SGMCMC`.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore", DeprecationWarning)
        ...     opt = SGLD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, nbeta=5.0)
        >>> opt.param_groups[0]["nbeta"]
        5.0
    """

    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: float = 0.01,
        noise_level: float = 1.0,
        weight_decay: float = 0.0,
        localization: float = 0.0,
        nbeta: float = 1.0,
        bounding_box_size: float | None = None,
        mask: MaskLike | Sequence[torch.Tensor | None] | torch.Tensor | None = None,
        save_metrics: bool = False,
        sketch_dim: int | None = None,
        sketch_seed: int = 0,
    ) -> None:
        warnings.warn(
            "SGLD is kept for compatibility; use SGMCMC.sgld instead.",
            DeprecationWarning,
            stacklevel=2,
        )
        _advise(noise_level, nbeta)
        super().__init__(
            params,
            lr=lr,
            noise_level=noise_level,
            nbeta=nbeta,
            localization=localization,
            weight_decay=weight_decay,
            bounding_box_size=bounding_box_size,
            mask=mask,
            save_metrics=save_metrics,
            sketch_dim=sketch_dim,
            sketch_seed=sketch_seed,
        )
