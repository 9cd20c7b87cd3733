"""Diagonal preconditioners of the SGMCMC update and their registry.

A preconditioner turns one parameter's gradient (and its running state) into
the per-coordinate coefficients ``(g_c, p_c, n_c, o)`` of the update in
:mod:`gradsketch.sampling._sgmcmc`; :func:`register_preconditioner` adds one
under a name that ``SGMCMC(preconditioner=name)`` accepts.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

__all__ = [
    "PRECONDITIONERS",
    "AdamPreconditioner",
    "IdentityPreconditioner",
    "NoseHooverThermostat",
    "Preconditioner",
    "PreconditionerCoefs",
    "RMSpropPreconditioner",
    "Scalar",
    "register_preconditioner",
    "resolve_preconditioner",
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
        v = _square_average(state, "square_avg", grad, self.alpha)
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
        b1, b2 = self.betas
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(grad)
        state["exp_avg"].mul_(b1).add_(grad, alpha=1.0 - b1)
        v = _square_average(state, "exp_avg_sq", grad, b2)
        state["adam_step"] = t = state.get("adam_step", 0) + 1
        # 1 / (sqrt(V / (1 - b2^t)) + eps), one allocation.
        g = v.div(1.0 - b2**t).sqrt_().add_(self.eps).reciprocal_()
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
        _check_positive("diffusion_factor", diffusion_factor, allow_zero=True)
        self.diffusion_factor = float(diffusion_factor)

    def coefficients(
        self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any]
    ) -> PreconditionerCoefs:
        """Scalar coefficients; the thermostat lives in the sampler's group state."""
        return PreconditionerCoefs(noise_coef=math.sqrt(2.0 * self.diffusion_factor))

    def __repr__(self) -> str:
        return f"NoseHooverThermostat(diffusion_factor={self.diffusion_factor})"


def _square_average(
    state: dict[str, Any], key: str, grad: torch.Tensor, decay: float
) -> torch.Tensor:
    """``state[key] <- decay * state[key] + (1 - decay) * grad²`` in place (zeros at first).

    The second moment of RMSprop (``decay = alpha``) and Adam (``decay = b2``).
    """
    if key not in state:
        state[key] = torch.zeros_like(grad)
    return state[key].mul_(decay).addcmul_(grad, grad, value=1.0 - decay)


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


def resolve_preconditioner(spec: object, kwargs: dict[str, Any]) -> Preconditioner:
    """The preconditioner ``spec`` names (built with ``kwargs``), or ``spec`` itself.

    Example:
        >>> resolve_preconditioner("rmsprop", {"alpha": 0.9})
        RMSpropPreconditioner(alpha=0.9, eps=0.1)
    """
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
