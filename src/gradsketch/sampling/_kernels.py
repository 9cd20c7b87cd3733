"""The SGMCMC update as free functions, one parameter at a time.

The functional core of :class:`~gradsketch.sampling.SGMCMC`, in the shape of
``torch.optim``'s ``_single_tensor_*`` functions: tensors in, keyword-only
hyperparameters, everything in place. :func:`update_group_` runs a parameter
group through them; the sampler class only plans the workspace and reduces it.

* :func:`_single_tensor_identity`: the identity preconditioner without a
  mask, whose components are scalar multiples of a few raw vectors
  (gradient, noise, ``w - w0``, the weights), so recording writes only those.
* :func:`_single_tensor_general`: any preconditioner, mask or the Nosé-Hoover
  thermostat; recording writes the five components themselves.

There is no ``_multi_tensor_*`` twin: every parameter draws its own noise from
the generator in order (the stream devinterp's samplers draw), which leaves a
``torch._foreach_*`` path only the three ``add_`` calls of the identity update.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from gradsketch.sampling._preconditioners import Preconditioner, PreconditionerCoefs, Scalar

__all__ = ["update_group_"]


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


class _Hyper(NamedTuple):
    """A group's step hyperparameters, shared by both single-tensor updates."""

    lr: float  # eps
    nbeta: float
    noise_level: float  # sigma
    localization: float  # gamma
    weight_decay: float  # lambda


class _GeneralStep(NamedTuple):
    """What one parameter's non-identity update needs, besides where it writes."""

    coefs: PreconditionerCoefs
    overall: Scalar  # o, times the mask when there is one
    drive: torch.Tensor  # grad L, or the preconditioner's drift
    center: torch.Tensor  # c of the prior
    state: dict[str, Any]
    gen: torch.Generator | None
    half: float  # eps / 2 (eps under Nosé-Hoover)
    root: float  # sqrt(eps)
    nbeta: float
    sigma: float  # noise level
    gamma: float  # localization
    lam: float  # weight decay
    thermostat: float | None  # xi under Nosé-Hoover, else None


def _times_(row: torch.Tensor, coef: Scalar) -> None:
    """``row <- coef * row`` (a multiplication by the scalar 1 is exact, so it is skipped)."""
    if isinstance(coef, torch.Tensor):
        row.mul_(coef)
    elif coef != 1.0:
        row.mul_(float(coef))


def _factor(scalar: float, coef: Scalar, out: torch.Tensor) -> Scalar:
    """``scalar * coef`` as Python evaluates it: a float, or a tensor written to ``out``."""
    if isinstance(coef, torch.Tensor):
        return torch.mul(coef, scalar, out=out)
    return scalar * float(coef)


def _apply_general_recorded(
    p: torch.Tensor, rows: dict[str, torch.Tensor] | None, step: _GeneralStep
) -> None:
    """The update component by component, each written to its row, then applied.

    Each component is computed with devinterp 2.0.1's operations in its order
    (``_decompose_update``): ``(eps/2) * (o * (g_c * (nbeta * drive)))``,
    ``((eps/2) * p_c * o) * (gamma * (w - c))``, ``(sqrt(eps) * n_c) * (o * xi)``,
    each product rounded where devinterp's is, so every element and its
    float32 sketch are bit-equal to devinterp's. Without ``rows`` (no scratch
    could hold this parameter) the components are fresh tensors.
    """
    coefs, overall, drive, center, state, gen, half, root = step[:8]
    nbeta, sigma, gamma, lam, thermostat = step[8:]
    grad = p.grad
    assert grad is not None

    def out(name: str) -> torch.Tensor:
        return rows[name] if rows is not None else torch.empty_like(p)

    # `distance` is written last: until then it holds a tensor factor.
    tmp = out("distance")
    scaled = torch.mul(drive, nbeta, out=out("scaled_grad"))
    _times_(scaled, coefs.grad_coef)
    _times_(scaled, overall)
    scaled.mul_(half)
    if rows is not None:
        torch.mul(grad, nbeta, out=rows["unscaled_grad"]).mul_(half)
    loc, wd = out("localization"), out("weight_decay")
    prior_scale: Scalar = 0.0
    if gamma or lam:
        # devinterp's `_half_lr * prior_coef * _precond`, left to right.
        prior_scale = _factor(half, coefs.prior_coef, tmp)
        if isinstance(prior_scale, torch.Tensor):
            _times_(prior_scale, overall)
        else:
            prior_scale = _factor(prior_scale, overall, tmp)
    for row, weight, src in ((loc, gamma, None), (wd, lam, p)):
        if not weight:
            row.zero_()
            continue
        if src is None:
            torch.sub(p, center, out=row).mul_(weight)
        else:
            torch.mul(src, weight, out=row)
        _times_(row, prior_scale)
    noise = out("noise").normal_(0.0, sigma, generator=gen)
    _times_(noise, overall)
    _times_(noise, _factor(root, coefs.noise_coef, tmp))
    if rows is not None:
        torch.sub(p, state["initial_param"], out=rows["distance"])
    target = p
    if thermostat is not None:
        target = state["momentum"]
        target.mul_(1.0 - thermostat)
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
    coefs, overall, drive, center, state, gen, half, root = step[:8]
    nbeta, sigma, gamma, lam, thermostat = step[8:]
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
    if thermostat is not None:
        target = state["momentum"]
        target.mul_(1.0 - thermostat)
    target.add_(a, alpha=grad_scale)
    if prior_scale:
        target.add_(b, alpha=prior_scale)
    a.normal_(0.0, sigma, generator=gen)
    noise_scale = root * _scaled_into(a, a, coefs.noise_coef, overall)
    target.add_(a, alpha=noise_scale)
    if target is not p:
        p.add_(target)


def _single_tensor_identity(
    p: torch.Tensor,
    state: dict[str, Any],
    rows: dict[str, torch.Tensor] | None,
    gen: torch.Generator | None,
    scratch: torch.Tensor | None,
    hp: _Hyper,
) -> None:
    """The identity update; with ``rows``, records into them first.

    The rows are written before ``p`` moves. Without ``rows``, the noise
    and ``w - c`` go to ``scratch`` (``[2, *p.shape]``) when given (same
    values: one ``normal_`` call draws what ``torch.normal`` would).
    """
    lr, nbeta = hp.lr, hp.nbeta
    sigma, gamma, lam = hp.noise_level, hp.localization, hp.weight_decay
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
    p.add_(noise, alpha=lr**0.5)


def _single_tensor_general(
    p: torch.Tensor,
    state: dict[str, Any],
    preconditioner: Preconditioner,
    rows: dict[str, torch.Tensor] | None,
    gen: torch.Generator | None,
    scratch: torch.Tensor | None,
    hp: _Hyper,
    *,
    mask: torch.Tensor | None,
    thermostat: float | None,
) -> int:
    """Any preconditioner, mask or the thermostat; returns the coordinates it moves.

    Recording, it writes each component to its row and applies them as
    written. Otherwise, with ``scratch`` (``[2, *p.shape]``), it applies
    the same update with two reused buffers and no other temporary
    (:func:`_apply_general`); the sum's rounding order differs, so the
    two trajectories may differ in the last bit. ``thermostat`` is the
    Nosé-Hoover ``xi`` (None for Langevin dynamics).
    """
    lr = hp.lr
    grad = p.grad
    assert grad is not None
    coefs = preconditioner.coefficients(p, grad, state)
    overall: Scalar = coefs.overall_coef
    if mask is not None:
        overall = mask.to(p.dtype) * overall
    center = state.get("prior_center", state["initial_param"])
    drive = coefs.drift if coefs.drift is not None else grad
    nose_hoover = thermostat is not None
    if nose_hoover and "momentum" not in state:
        state["momentum"] = math.sqrt(lr) * torch.normal(
            0.0, 1.0, size=p.shape, generator=gen, device=p.device, dtype=p.dtype
        )
    half = lr if nose_hoover else 0.5 * lr
    step = _GeneralStep(
        coefs,
        overall,
        drive,
        center,
        state,
        gen,
        half,
        lr**0.5,  # devinterp's sqrt(eps) (`lr ** 0.5`, not always math.sqrt's last bit)
        hp.nbeta,
        hp.noise_level,
        hp.localization,
        hp.weight_decay,
        thermostat,
    )
    if rows is None and scratch is not None:
        _apply_general(p, scratch, step)
    else:
        _apply_general_recorded(p, rows, step)
    if isinstance(overall, torch.Tensor):
        return int(torch.count_nonzero(overall.expand_as(p)))
    return p.numel()


def _clamp_to_box_(
    p: torch.Tensor, state: dict[str, Any], size: float, *, nose_hoover: bool
) -> None:
    """``w <- clamp(w, w0 - b, w0 + b)``; the momentum of a coordinate that hit a wall reflects."""
    w0 = state["initial_param"]
    if nose_hoover:
        hit = (p - w0).abs() > size
        state["momentum"].mul_(1.0 - 2.0 * hit.to(p.dtype))
    torch.clamp_(p, min=w0 - size, max=w0 + size)


def update_group_(
    params: Sequence[torch.Tensor],
    states: Sequence[dict[str, Any]],
    *,
    preconditioner: Preconditioner,
    fast: bool,
    views: Sequence[dict[str, torch.Tensor]] | None,
    scratch_for: Callable[[torch.Tensor], torch.Tensor | None],
    gen: torch.Generator | None,
    lr: float,
    nbeta: float,
    noise_level: float,
    localization: float,
    weight_decay: float,
    masks: Sequence[torch.Tensor] | None,
    thermostat: float | None,
    bounding_box_size: float | None,
) -> tuple[int, torch.Tensor]:
    """One step of every parameter of a group, in order; returns (coordinates moved, energy).

    ``fast`` takes :func:`_single_tensor_identity` (identity, no mask, Langevin),
    else :func:`_single_tensor_general`. ``views[i]`` are parameter ``i``'s
    workspace rows when recording (zeroed for a parameter without a
    gradient, which does not move); otherwise ``scratch_for(p)`` lends two
    reusable ``p``-shaped buffers (or None). ``energy`` is ``sum |v|^2`` of
    the Nosé-Hoover momenta (float64; zero otherwise).

    Example:
        >>> from gradsketch.sampling import IdentityPreconditioner
        >>> w = torch.zeros(3, requires_grad=True)
        >>> w.grad = torch.ones(3)
        >>> states = [{"initial_param": w.detach().clone()}]
        >>> with torch.no_grad():
        ...     moved, _ = update_group_(
        ...         [w], states, preconditioner=IdentityPreconditioner(), fast=True,
        ...         views=None, scratch_for=lambda p: None, gen=None, lr=0.1, nbeta=2.0,
        ...         noise_level=0.0, localization=0.0, weight_decay=0.0, masks=None,
        ...         thermostat=None, bounding_box_size=None,
        ...     )
        >>> moved, w.detach()  # w - (eps / 2) nbeta grad
        (3, tensor([-0.1000, -0.1000, -0.1000]))
    """
    hp = _Hyper(lr, nbeta, noise_level, localization, weight_decay)
    nose_hoover = thermostat is not None
    numel = 0
    energy = torch.zeros((), dtype=torch.float64)
    for i, p in enumerate(params):
        if p.grad is None:
            if views is not None:
                for view in views[i].values():
                    view.zero_()
            continue
        state = states[i]
        rows = None if views is None else views[i]
        scratch = None if rows is not None else scratch_for(p)
        if fast:
            numel += p.numel()
            _single_tensor_identity(p, state, rows, gen, scratch, hp)
        else:
            mask = None if masks is None else masks[i]
            numel += _single_tensor_general(
                p,
                state,
                preconditioner,
                rows,
                gen,
                scratch,
                hp,
                mask=mask,
                thermostat=thermostat,
            )
            if nose_hoover:
                energy += state["momentum"].double().square().sum()
        if bounding_box_size is not None:
            _clamp_to_box_(p, state, bounding_box_size, nose_hoover=nose_hoover)
    return numel, energy
