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

This module holds the optimizer (set-up, ``step``, results) and its
factories, generated from one table of presets. The preconditioners and
their registry live in :mod:`._preconditioners`, the update of one
parameter in :mod:`._kernels`, and the recording workspace (rows,
coefficients, the Gram/sketch pass) in :mod:`._workspace`.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
from torch.optim import Optimizer

from gradsketch._checks import integer, positive_int
from gradsketch._hash import TensorDigest
from gradsketch.masked import MaskLike
from gradsketch.sampling import _workspace
from gradsketch.sampling._kernels import update_group_
from gradsketch.sampling._metrics import Metrics
from gradsketch.sampling._preconditioners import (
    PRECONDITIONERS,
    Preconditioner,
    PreconditionerCoefs,
    _check_positive,
    resolve_preconditioner,
)
from gradsketch.sampling._workspace import GroupPlan
from gradsketch.sketch import CountSketch, Fingerprint, SketchBuffer

logger = logging.getLogger(__name__)

__all__ = ["SGLD", "SGMCMC", "DevinterpSGNHTNoise"]


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
    accumulated in float64), which a ``[6, r]`` coefficient matrix maps to
    the components, and one pass gives the sketches: each element of each
    component is computed as devinterp 2.0.1 computes it (its float32
    operations in its order, e.g. ``(eps/2) * (nbeta * grad)``) and added,
    times its sign, into its bucket of the float32 sketch in parameter
    order, so on the CPU the sketches are bit-equal to devinterp's
    ``scatter_add_`` of each parameter's float32 component. On CPU with the
    native kernels (chosen by :mod:`gradsketch.sketch._backend`) both passes
    read the gradients where autograd left them; otherwise they are a
    batched matmul and torch's ``scatter_add_`` over a copy of them.

    Recording reads each gradient once, in one pass after the update (see
    :func:`gradsketch.sketch.reduce_workspace`); ``benchmarks/bench_sampling.py``
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
        self._plans: list[GroupPlan] = []
        mask_fps: list[str] = []
        offset = 0
        for group in self.param_groups:
            self._init_group(group)
            numel = sum(p.numel() for p in group["params"])
            self._plans.append(GroupPlan(numel=numel, offset=offset))
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
        options = dict(group.pop("preconditioner_kwargs", {}) or {})
        if group["preconditioner"] == "rmsprop" and "add_grad_correction" in options:
            # devinterp's rmsprop_sgld passes this to its preconditioner; only False works.
            _refuse_grad_correction(options.pop("add_grad_correction"))
        group["preconditioner"] = resolve_preconditioner(group["preconditioner"], options)
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
        devices = sorted({str(p.device) for g in self.param_groups for p in g["params"]})
        if len(devices) > 1:
            # devinterp's phrase first: its users' tests match it.
            raise RuntimeError(
                f"Inconsistent devices: the parameters are on {devices}, but one sketch of "
                "every coordinate needs them on one device; move the model there (e.g. "
                "`model.to(device)`) before building the sampler, or leave `sketch_dim=None`."
            )
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
        for group, plan in zip(self.param_groups, self._plans):
            plan.folded = _workspace.folded_table(self._sketch, plan, group["masks"])

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
            self._last_metrics = Metrics.from_gram(gram, numel, dtype=torch.float64)
        return loss

    def _step_group(
        self, group: dict[str, Any], plan: GroupPlan, gen: torch.Generator | None
    ) -> tuple[torch.Tensor | None, int]:
        params: list[torch.Tensor] = list(group["params"])
        precond: Preconditioner = group["preconditioner"]
        record = self.save_metrics or self.save_sketches
        nose_hoover = precond.dynamics == "nose_hoover"
        fast = precond.is_identity and group["masks"] is None and not nose_hoover
        lr, nbeta = group["lr"], group["nbeta"]
        gamma, lam = group["localization"], group["weight_decay"]
        half = lr if nose_hoover else 0.5 * lr
        root = lr**0.5  # as devinterp computes sqrt(eps)
        # Rows of the per-group block and the coefficients C[6, r] that turn
        # them into the six components.
        names = _workspace.row_names(
            fast,
            weight_decay=lam,
            localization=gamma,
            center=any("prior_center" in self.state[p] for p in params),
        )
        block: torch.Tensor | None = None
        views: list[dict[str, torch.Tensor]] | None = None
        direct = record and fast and self._direct_grads(params)
        if record:
            # Reading gradients in place, the workspace holds the other rows.
            block, views = _workspace.workspace(plan, names[1:] if direct else names, params)
        numel, energy = update_group_(
            params,
            [self.state[p] for p in params],
            preconditioner=precond,
            fast=fast,
            views=views,
            scratch_for=lambda p: _workspace.step_scratch(plan, params, p),
            gen=gen,
            lr=lr,
            nbeta=nbeta,
            noise_level=group["noise_level"],
            localization=gamma,
            weight_decay=lam,
            masks=group["masks"],
            thermostat=float(group["thermostat"]) if nose_hoover else None,
            bounding_box_size=group["bounding_box_size"],
        )
        if nose_hoover and plan.numel:
            group["thermostat"] += energy / plan.numel - lr
        if block is None:
            return None, numel
        coef = _workspace.coefficients(
            plan, names, fast, self._sketch, half=half, root=root, nbeta=nbeta, gamma=gamma, lam=lam
        )
        small = _workspace.reduce_plan(
            plan,
            block,
            sketch=self._sketch,
            sketches=self._sketch_rows,
            gram=self.save_metrics,
            segments=_workspace.segments(plan, params, views) if direct else None,
        )
        gram = None if small is None else coef @ small @ coef.T
        return gram, numel

    @staticmethod
    def _direct_grads(params: list[torch.Tensor]) -> bool:
        """Whether the reduction reads every gradient in place (``_workspace.direct_grads``)."""
        return _workspace.direct_grads(params)

    # ---------------------------------------------------------------- results
    def get_metrics(self, *, dtype: torch.dtype = torch.float32) -> Metrics:
        """A copy of the last step's metrics; RuntimeError without ``save_metrics``.

        Args:
            dtype: dtype of the fields. The default, float32 ``[1]`` CPU
                tensors, is devinterp 2.0's; each value is accumulated in
                float64 (one Gram matrix of the components) and rounded once.
                ``torch.float64`` returns the unrounded values.
        """
        if not self.save_metrics:
            raise RuntimeError(
                "Metrics not enabled. Set save_metrics=True (pass it to the sampler or factory)."
            )
        if self._last_metrics is None:
            return Metrics().astype(dtype)
        return self._last_metrics.astype(dtype)

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
    # Generated from the table of presets below (same signatures as devinterp's).
    sgld: ClassVar[Callable[..., SGMCMC]]
    rmsprop_sgld: ClassVar[Callable[..., SGMCMC]]
    adam_sgld: ClassVar[Callable[..., SGMCMC]]
    sgnht: ClassVar[Callable[..., SGMCMC]]

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


class DevinterpSGNHTNoise(Preconditioner):
    """devinterp 2.0.1's ``SGMCMC.sgnht`` step, kept to reproduce its numbers (not SGNHT).

    Langevin dynamics with the noise scaled by ``sqrt(2 a)``::

        w <- w - (eps / 2)(nbeta grad L + prior) + sqrt(eps) sqrt(2 a) xi

    ``sqrt(2 a)`` is rounded to float32, as devinterp computes it, and at
    every step each parameter draws one ``torch.randn_like(param)`` from the
    global generator and drops it, as devinterp does (its
    ``state.get("momentum", torch.randn_like(param))`` evaluates the default
    at each call), so a script seeded with ``torch.manual_seed`` sees the
    same global stream.
    Why this is not SGNHT: see :meth:`SGMCMC.sgnht`. Built by
    ``SGMCMC.sgnht(..., devinterp_compat=True)``.

    Args:
        diffusion_factor: ``a``; 0 injects no noise.

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
        >>> opt = SGMCMC.sgnht([w], lr=0.01, diffusion_factor=0.0, devinterp_compat=True)
        >>> w.grad = torch.ones(2, dtype=torch.float64)
        >>> opt.step()
        >>> w.detach()  # w - (eps / 2) grad, no noise
        tensor([-0.0050, -0.0050], dtype=torch.float64)
    """

    def __init__(self, diffusion_factor: float = 0.01) -> None:
        _check_positive("diffusion_factor", diffusion_factor, allow_zero=True)
        self.diffusion_factor = float(diffusion_factor)
        # devinterp: torch.sqrt(torch.tensor(2.0 * diffusion_factor)), a float32 scalar.
        self.noise_coef = float(torch.tensor(2.0 * self.diffusion_factor).sqrt())

    def coefficients(
        self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any]
    ) -> PreconditionerCoefs:
        """``(1, 1, sqrt(2 a), 1)``, after the global draw devinterp makes and drops."""
        torch.randn_like(param)
        return PreconditionerCoefs(noise_coef=self.noise_coef)

    def __repr__(self) -> str:
        return f"DevinterpSGNHTNoise(diffusion_factor={self.diffusion_factor})"


def _refuse_grad_correction(add_grad_correction: object) -> None:
    """NotImplementedError for ``add_grad_correction=True`` (devinterp's text leads it)."""
    if add_grad_correction:
        raise NotImplementedError(
            "Gradient correction not yet implemented for RMSprop: `add_grad_correction="
            f"{add_grad_correction!r}` asks for the Gamma(theta) term of pSGLD, which neither "
            "gradsketch nor devinterp implements; leave it False."
        )


def _advise(noise_level: float, nbeta: float) -> None:
    # Advice, not an error: logging keeps test runs with `-W error` quiet.
    if noise_level != 1.0:
        logger.info("noise_level=%s != 1 removes SGLD's posterior-sampling guarantee.", noise_level)
    if nbeta == 1.0:
        logger.info(
            "nbeta=1: LLC estimates will be off; use gradsketch.sampling.default_nbeta(loader)."
        )


@dataclass(frozen=True)
class _Preset:
    """One factory: its preconditioner, its keywords in signature order, its docstring.

    A keyword's annotation and default come from the preconditioner's
    constructor when it is one of its options, else from :class:`SGMCMC`'s
    (or :data:`_EXTRA_KEYWORDS`), so each is written once.
    """

    preconditioner: str
    keywords: tuple[str, ...]
    doc: str
    fixed: Mapping[str, Any] = field(default_factory=dict)  # not exposed: always this value


#: The keywords every SGLD-type factory starts and ends with (devinterp's order).
_STEP = ("lr", "noise_level", "weight_decay", "localization", "nbeta")
_REST = ("bounding_box_size", "mask", "save_metrics", "sketch_dim", "sketch_seed")

#: Factory keywords that neither the sampler nor a preconditioner takes.
_EXTRA_KEYWORDS: dict[str, tuple[str, Any]] = {
    "add_grad_correction": ("bool", False),
    "devinterp_compat": ("bool", False),
}

_SGNHT_DOC = """SGNHT (Ding et al. 2014), thermostat applied (see :class:`NoseHooverThermostat`).

        ``devinterp_compat=True`` takes devinterp 2.0.1's ``SGMCMC.sgnht`` step
        instead (:class:`DevinterpSGNHTNoise`), which is not SGNHT. Derivation:
        Ding et al.'s Algorithm 1 with step ``h``, momentum ``p``, thermostat
        ``xi`` and diffusion ``A`` is ``p <- p - xi p h - grad U h + sqrt(2 A h) N``,
        ``w <- w + p h``, ``xi <- xi + (|p|^2 / n - 1) h``. With ``v = p h``,
        ``eps = h^2``, ``alpha = xi h`` and ``a = A h`` (the SGHMC units of
        Chen et al. 2014) this is ``v <- v - alpha v - eps grad U + sqrt(2 a eps) N``,
        ``w <- w + v``, ``alpha <- alpha + |v|^2 / n - eps``, started at
        ``v = sqrt(eps) N`` and ``alpha = a``: our step, with
        ``grad U = nbeta grad L + prior`` and ``a = diffusion_factor``.
        devinterp's ``NHTPreconditioning`` returns the coefficients
        ``(1, 1, sqrt(2 a), 1)`` and a ``grad_correction = -xi v`` that
        ``SGMCMC.step`` never reads; its momentum never moves (a
        ``torch.randn_like`` draw at every step, of which the first is kept),
        and its thermostat is updated but never used. Its step is
        ``w <- w - (eps/2) grad U + sqrt(eps) sqrt(2 a) N``: Langevin dynamics
        whose stationary law is
        ``exp(-U / (2 a))`` (the posterior at temperature ``2 a``, i.e. ``nbeta``
        times ``1 / (2 a)`` = 50 at the default ``a``), with no momentum and no
        thermostat. So the default keeps the SGNHT step, and the switch is
        there to reproduce devinterp's numbers (docs/compatibility.md).
        ``diffusion_factor=0`` is allowed in both (no injected noise).
        """

#: The factories ``SGMCMC.<name>``, in the order of :attr:`SGMCMC.METHODS`.
_PRESETS: dict[str, _Preset] = {
    "sgld": _Preset(
        "identity",
        (*_STEP, *_REST),
        """SGLD with localization (Lau et al. 2023): identity preconditioner.

        ``w <- w - (eps/2)(nbeta grad L + gamma (w - w0) + lambda w) + N(0, eps sigma^2)``.
        """,
    ),
    "rmsprop_sgld": _Preset(
        "rmsprop",
        (*_STEP, "alpha", "eps", "add_grad_correction", *_REST),
        "RMSprop-preconditioned SGLD (Li et al. 2016): coefs ``(G, G, sqrt(G), 1)``.",
    ),
    "adam_sgld": _Preset(
        "adam",
        (*_STEP, "betas", "eps", *_REST),
        "Adam-preconditioned SGLD with adaptive drift (see :class:`AdamPreconditioner`).",
    ),
    "sgnht": _Preset(
        "nht",
        (
            "lr",
            "diffusion_factor",
            "nbeta",
            "bounding_box_size",
            "save_metrics",
            "sketch_dim",
            "sketch_seed",
            "localization",
            "weight_decay",
            "devinterp_compat",
        ),
        _SGNHT_DOC,
        fixed={"noise_level": 1.0},
    ),
}


def _preset_signature(
    preset: _Preset, *, first: str, keyword_only: bool = False, returns: str = "SGMCMC"
) -> inspect.Signature:
    """``(first, params, <keywords>) -> returns``; after ``params`` keyword-only if asked."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    options = inspect.signature(PRECONDITIONERS[preset.preconditioner]).parameters
    sampler = inspect.signature(SGMCMC).parameters
    params = [
        inspect.Parameter(first, kind),
        inspect.Parameter("params", kind, annotation="Iterable[Any]"),
    ]
    for name in preset.keywords:
        if name in options:
            annotation, default = options[name].annotation, options[name].default
        elif name in sampler:
            annotation, default = sampler[name].annotation, sampler[name].default
        else:
            annotation, default = _EXTRA_KEYWORDS[name]
        params.append(
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY if keyword_only else kind,
                annotation=annotation,
                default=default,
            )
        )
    return inspect.Signature(params, return_annotation=returns)


def _preset_arguments(
    preset: _Preset, signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The sampler's constructor arguments for a call of a preset's factory."""
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    values = dict(bound.arguments)
    del values[next(iter(signature.parameters))]  # cls / self
    devinterp_compat = bool(values.pop("devinterp_compat", False))
    _refuse_grad_correction(values.pop("add_grad_correction", False))
    options = inspect.signature(PRECONDITIONERS[preset.preconditioner]).parameters
    values.update(preset.fixed)
    _advise(values["noise_level"], values["nbeta"])
    values["preconditioner"] = preset.preconditioner
    values["preconditioner_kwargs"] = {n: values.pop(n) for n in options if n in values}
    if devinterp_compat:
        values["preconditioner"] = DevinterpSGNHTNoise(**values.pop("preconditioner_kwargs"))
    return values


def _make_factory(name: str, preset: _Preset) -> classmethod[Any, Any, SGMCMC]:
    signature = _preset_signature(preset, first="cls")

    def factory(*args: Any, **kwargs: Any) -> SGMCMC:
        cls = args[0]
        values = _preset_arguments(preset, signature, args, kwargs)
        return cls(values.pop("params"), **values)  # type: ignore[no-any-return]

    factory.__name__ = name
    factory.__qualname__ = f"SGMCMC.{name}"
    factory.__doc__ = preset.doc
    factory.__signature__ = signature  # type: ignore[attr-defined]
    return classmethod(factory)


for _name, _preset in _PRESETS.items():
    setattr(SGMCMC, _name, _make_factory(_name, _preset))
assert tuple(_PRESETS) == SGMCMC.METHODS


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

    _SIGNATURE = _preset_signature(
        _PRESETS["sgld"], first="self", keyword_only=True, returns="None"
    )

    def __init__(self, params: Iterable[Any], **kwargs: Any) -> None:
        warnings.warn(
            "SGLD is kept for compatibility; use SGMCMC.sgld instead.",
            DeprecationWarning,
            stacklevel=2,
        )
        values = _preset_arguments(_PRESETS["sgld"], self._SIGNATURE, (self, params), kwargs)
        super().__init__(values.pop("params"), **values)


SGLD.__init__.__signature__ = SGLD._SIGNATURE  # type: ignore[attr-defined]
