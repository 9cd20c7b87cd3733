"""Step-size calibration of SGLD for LLC estimation, from the chain's own gradients.

SGLD's update ``w <- w - (eps / 2) grad U + sqrt(eps) xi`` with
``U = nbeta L + gamma |w - w*|^2 / 2`` samples a distribution that differs
from ``exp(-U)`` at first order in ``eps``. For a quadratic mode of curvature
``c`` the chain is ``w' = (1 - eps c / 2) w + sqrt(eps) xi``, whose stationary
variance is ``1 / (c (1 - eps c / 4))``: the mode's share of ``E[nbeta L]``
grows by ``eps c / 8`` (absolute), and since ``E|c w|^2 = c`` at equilibrium,
summing over modes gives the absolute bias of the LLC estimate::

    bias ~= eps * E|nbeta grad L|^2 / 8

which the chain measures for free (the gradient is already computed). Its
ratio to the estimate, ``rho = bias / LLC``, is the relative discretization
bias; :func:`calibrate_step_size` picks the ``eps`` that makes ``rho`` a
chosen target, since ``rho`` is proportional to ``eps``. On deep linear
networks, reduced-rank regressions and normal crossings the measured bias
is 0.5-1.1 times ``rho`` (``benchmarks/llc_calibration.py``).

:func:`estimate_learning_coeff_calibrated` is the recipe that study
settled on. Pilots from ``w*`` at half the target give a first step (short
pilots see 2-5 times less bias than the spread chain on singular models). A
burn-in then runs at 4 times that step for a fixed *diffusion time*
``lr * steps = 0.02``: the calibrated step falls with width (minibatch
gradient noise grows with the input dimension over the batch size), so a
fixed step count covers less and less of the shallow singular directions;
a fixed 2000 + 2000 steps left a 650k-parameter network 8% low and still
rising. Over the burn-in's last quarter the chain, now spread, measures
``rho`` itself, which sets the draws' step for ``target_bias``; the draws'
``rho`` is checked and the run repeated with a rescaled step when it
exceeds 1.5 times the target. With ``nbeta = 1000``, ``gamma = 1`` this put
deep linear networks of 1k-1M parameters within 5% of Aoyagi's lambda and
reduced-rank regression at the zero map within 2%
(``benchmarks/llc_calibration.py``). :func:`calibrated_lr` is the pilot
step alone, for samplers that take a fixed ``lr``.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gradsketch._checks import nonnegative_int, positive_int
from gradsketch.sampling._divergence import ChainDivergenceWarning
from gradsketch.sampling._llc import (
    Evaluate,
    _initial_loss,
    _summary,
    estimate_learning_coeff_with_summary,
    evaluate_ce,
)

__all__ = [
    "StepSizeCalibration",
    "StepSizeDiagnostic",
    "calibrate_step_size",
    "calibrated_lr",
    "estimate_learning_coeff_calibrated",
]


class StepSizeDiagnostic:
    """Callback measuring SGLD's first-order discretization bias ``eps E|nbeta grad L|^2 / 8``.

    Pass it in ``callbacks=`` of
    :func:`~gradsketch.sampling.estimate_learning_coeff_with_summary`; after
    each draw it reads the gradient the step used (still in ``.grad``) and
    the step size. ``get_results()`` adds ``llc/step_bias`` (absolute, in LLC
    units, averaged over draws and chains). Identity-preconditioned SGLD only:
    a preconditioner changes the step per coordinate and the formula with it.

    Example:
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> from gradsketch.sampling import estimate_learning_coeff_with_summary
        >>> model = torch.nn.Linear(2, 1, bias=False)
        >>> loader = DataLoader(TensorDataset(torch.randn(32, 2), torch.zeros(32, 1)), 8)
        >>> diag = StepSizeDiagnostic()
        >>> out = estimate_learning_coeff_with_summary(
        ...     model, loader, evaluate=lambda m, b: (m(b[0]) - b[1]).square().mean(),
        ...     optimizer_kwargs=dict(lr=1e-3, nbeta=10.0), num_draws=20, num_chains=1,
        ...     seed=0, callbacks=[diag], verbose=False)
        >>> out["llc/step_bias"] > 0
        True
    """

    def __init__(self) -> None:
        self._values: list[float] = []

    def __call__(
        self,
        *,
        chain: int,
        draw: int,
        loss: float,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
    ) -> None:
        """Record ``eps nbeta^2 |grad L|^2 / 8`` of the step just taken."""
        total = 0.0
        for group in optimizer.param_groups:
            precond = group.get("preconditioner")
            if precond is not None and not getattr(precond, "is_identity", False):
                raise ValueError(
                    f"StepSizeDiagnostic needs identity-preconditioned SGLD, got {precond!r}; "
                    "calibrate with sampling_method=SGMCMC.sgld."
                )
            sq = sum(float(p.grad.square().sum()) for p in group["params"] if p.grad is not None)
            total += group["lr"] * group["nbeta"] ** 2 * sq / 8.0
        self._values.append(total)

    def get_results(self) -> dict[str, float]:
        """``{"llc/step_bias": mean over recorded draws}`` (NaN before any draw)."""
        return {"llc/step_bias": float(np.mean(self._values)) if self._values else math.nan}


@dataclass(frozen=True)
class StepSizeCalibration:
    """Result of :func:`calibrate_step_size`.

    Attributes:
        lr: The step size to use.
        predicted_bias: ``rho`` expected at ``lr`` (relative): the last pilot's,
            or the target when the pilots did not converge.
        pilots: ``(lr, rho, llc)`` of every pilot run, in order.
        converged: Whether a pilot landed within a factor 1.5 of the target;
            if not, ``lr`` is the target over the pooled ``rho / lr`` of the
            last pilots.
    """

    lr: float
    predicted_bias: float
    pilots: list[tuple[float, float, float]] = field(default_factory=list)
    converged: bool = True


def _check_target_bias(target_bias: object) -> None:
    if not (isinstance(target_bias, float) and 0.0 < target_bias < 1.0):
        raise ValueError(
            f"`target_bias` must be a float in (0, 1), got {target_bias!r}; e.g. 0.05."
        )


def _run_unwarned(
    model: torch.nn.Module,
    loader: Iterable[Any],
    evaluate: Evaluate | None,
    optimizer_kwargs: dict[str, Any] | None,
    *,
    lr: float,
    nbeta: float,
    localization: float,
    may_diverge: bool,
    **estimator_kwargs: Any,
) -> dict[str, Any] | None:
    """The estimator at step ``lr`` without divergence warnings; None if it diverged and may.

    A run of the calibration may diverge: judging that is the caller's job,
    not a warning's. ``may_diverge=False`` lets the estimator's
    non-finite-loss error through.
    """
    kwargs = dict(optimizer_kwargs or {})
    kwargs.update(lr=lr, nbeta=float(nbeta), localization=float(localization))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ChainDivergenceWarning)
            return estimate_learning_coeff_with_summary(
                model, loader, evaluate=evaluate, optimizer_kwargs=kwargs, **estimator_kwargs
            )
    except RuntimeError as err:  # the estimator's non-finite-loss error
        if "non-finite loss" not in str(err) or not may_diverge:
            raise
        return None


def calibrate_step_size(
    model: torch.nn.Module,
    loader: Iterable[Any],
    evaluate: Evaluate | None = None,
    *,
    nbeta: float,
    localization: float = 0.0,
    target_bias: float = 0.05,
    lr: float = 1e-4,
    pilot_steps: int = 200,
    max_pilots: int = 6,
    init_loss: float | None = None,
    seed: int = 0,
    optimizer_kwargs: dict[str, Any] | None = None,
    device: str | torch.device = "cpu",
) -> StepSizeCalibration:
    """The SGLD step size whose first-order discretization bias is ``target_bias`` of the LLC.

    Runs short pilot chains from ``model``'s weights (half burn-in, half
    draws), measures ``rho = eps E|nbeta grad L|^2 / (8 LLC)`` with
    :class:`StepSizeDiagnostic` and rescales ``eps`` by ``target_bias / rho``
    (``rho`` is proportional to ``eps``; the ratio ``rho / eps`` is pooled
    over the last three pilots), until a pilot lands within a factor 1.5 of
    the target or ``max_pilots`` ran. A pilot whose loss diverges divides
    ``eps`` by 10.

    Args:
        model: The trained network (not modified).
        loader: Batches, as for the estimator.
        evaluate: ``evaluate(model, batch)``; default cross-entropy.
        nbeta: The inverse temperature the estimate will use.
        localization: ``gamma`` the estimate will use.
        target_bias: Relative bias wanted, in ``(0, 1)``; 0.05 by default.
        lr: First pilot's step size.
        pilot_steps: Steps per pilot (>= 20).
        max_pilots: Pilots at most.
        init_loss: ``L(w*)``; default as in the estimator.
        seed: Seed of the pilots.
        optimizer_kwargs: Further SGLD keywords (``bounding_box_size`` ...).
        device: Where the pilots run.

    Returns:
        A :class:`StepSizeCalibration`.

    Example:
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> model = torch.nn.Linear(3, 2, bias=False)
        >>> x = torch.randn(64, 3)
        >>> loader = DataLoader(TensorDataset(x, model(x).detach()), batch_size=16)
        >>> cal = calibrate_step_size(
        ...     model, loader, lambda m, b: 0.5 * (m(b[0]) - b[1]).square().sum(1).mean(),
        ...     nbeta=100.0, localization=1.0, lr=1e-3, pilot_steps=100)
        >>> 0.05 / 1.5 <= cal.predicted_bias <= 0.05 * 1.5
        True
    """
    _check_target_bias(target_bias)
    if isinstance(pilot_steps, bool) or not isinstance(pilot_steps, int) or pilot_steps < 20:
        raise ValueError(f"`pilot_steps` must be an int >= 20, got {pilot_steps!r}.")
    if isinstance(max_pilots, bool) or not isinstance(max_pilots, int) or max_pilots < 1:
        raise ValueError(f"`max_pilots` must be a positive int, got {max_pilots!r}.")
    if not (isinstance(lr, (int, float)) and lr > 0 and math.isfinite(lr)):
        raise ValueError(f"`lr` must be a positive float, got {lr!r}.")
    pilots: list[tuple[float, float, float]] = []
    eps = float(lr)
    rho = math.nan
    for pilot in range(max_pilots):
        out = _run_unwarned(
            model,
            loader,
            evaluate,
            optimizer_kwargs,
            lr=eps,
            nbeta=nbeta,
            localization=localization,
            may_diverge=True,
            num_draws=pilot_steps - pilot_steps // 2,
            num_burnin_steps=pilot_steps // 2,
            num_chains=1,
            init_loss=init_loss,
            seed=seed + pilot,
            device=device,
            callbacks=[StepSizeDiagnostic()],
            verbose=False,
        )
        if out is None:
            pilots.append((eps, math.inf, math.nan))
            eps /= 10.0
            continue
        llc, bias = float(out["llc/mean"]), float(out["llc/step_bias"])
        if not llc > 0:
            raise RuntimeError(
                f"pilot {pilot} at lr={eps:g} estimated LLC={llc:g} <= 0, so the relative bias "
                "is undefined; raise `pilot_steps` (the loss must rise above L(w*))."
            )
        rho = bias / llc
        pilots.append((eps, rho, llc))
        if 1 / 1.5 <= target_bias / rho <= 1.5:
            return StepSizeCalibration(lr=eps, predicted_bias=rho, pilots=pilots)
        eps = _next_step(pilots, target_bias)
    return StepSizeCalibration(lr=eps, predicted_bias=target_bias, pilots=pilots, converged=False)


def calibrated_lr(
    model: torch.nn.Module,
    loader: Iterable[Any],
    evaluate: Evaluate | None = None,
    *,
    nbeta: float,
    localization: float = 0.0,
    target_bias: float = 0.05,
    lr: float = 1e-5,
    init_loss: float | None = None,
    seed: int = 0,
    optimizer_kwargs: dict[str, Any] | None = None,
    device: str | torch.device = "cpu",
) -> float:
    """An SGLD step size for ``lr="auto"``: the calibrated estimator's pilot step.

    :func:`calibrate_step_size` aiming at ``target_bias / 2``, because short
    pilots from ``w*`` see 2-5 times less bias than a spread chain on
    singular models. Use it where a sampler takes a fixed ``lr`` (e.g.
    :func:`gradsketch.slt.sample`); :func:`estimate_learning_coeff_calibrated`
    goes further and re-measures the bias on its spread chain. Warns when the
    pilots did not converge.

    Args:
        model: The trained network (not modified).
        loader: Batches, as for the estimator.
        evaluate: ``evaluate(model, batch)``; default cross-entropy.
        nbeta: Inverse temperature the chains will use.
        localization: ``gamma`` the chains will use.
        target_bias: Relative discretization bias allowed, in ``(0, 1)``.
        lr: First pilot's step size.
        init_loss: ``L(w*)``; default as in the estimator.
        seed: Seed of the pilots.
        optimizer_kwargs: Further SGLD keywords.
        device: Where the pilots run.

    Returns:
        The step size.

    Example:
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> model = torch.nn.Linear(3, 2, bias=False)
        >>> x = torch.randn(64, 3, generator=torch.Generator().manual_seed(0))
        >>> step = calibrated_lr(
        ...     model, DataLoader(TensorDataset(x, model(x).detach()), batch_size=16),
        ...     lambda m, b: 0.5 * (m(b[0]) - b[1]).square().sum(1).mean(),
        ...     nbeta=100.0, localization=1.0, lr=1e-3)
        >>> 0 < step < 1e-2
        True
    """
    _check_target_bias(target_bias)
    calibration = calibrate_step_size(
        model,
        loader,
        evaluate,
        nbeta=nbeta,
        localization=localization,
        target_bias=target_bias / 2,
        lr=lr,
        init_loss=init_loss,
        seed=seed,
        optimizer_kwargs=optimizer_kwargs,
        device=device,
    )
    if not calibration.converged:
        warnings.warn(
            f"step-size pilots did not converge (pilots (lr, rho, llc): {calibration.pilots}); "
            f"using lr={calibration.lr:.3g}; raise `lr` toward the pilots' last step or "
            "check that the loss rises above L(w*).",
            stacklevel=2,
        )
    return calibration.lr


def _next_step(pilots: list[tuple[float, float, float]], target: float) -> float:
    """``target / k`` with ``k = rho / eps`` pooled (median) over the last three finite pilots.

    ``rho`` is proportional to ``eps``; pooling damps the noise of short
    pilots on low-dimensional models, where one pilot's ``rho`` can be off by
    a factor 2. A step changes by at most a factor 10 per pilot.
    """
    finite = [(e, r) for e, r, _ in pilots if math.isfinite(r) and r > 0][-3:]
    k = float(np.median([r / e for e, r in finite]))
    last = pilots[-1][0]
    return min(10 * last, max(last / 10, target / k))


class _BurninSchedule:
    """Callback running the calibrated estimator's step schedule on every chain.

    The estimator records every step as a draw (no burn-in of its own), so
    draw ``d``'s callback runs after step ``d``. Steps ``0 .. boosted - 1``
    use the boosted step; over their last quarter the callback measures
    ``rho`` of the spread chain, and at draw ``boosted - 1`` it sets the step
    to ``target / (rho / boosted_lr)`` (at most ``max_lr``). The first chain
    sets it, later chains reuse it, so every chain draws at one step; a
    given ``lr`` (a rerun's step, from the draws' own ``rho``) skips the
    measurement. The diagnostic of the draws starts at ``skip``.
    """

    def __init__(
        self,
        *,
        boosted: int,
        skip: int,
        target: float,
        max_lr: float,
        nbeta: float,
        init_loss: float,
        lr: float | None = None,
    ) -> None:
        self.boosted, self.skip, self.target, self.max_lr = boosted, skip, target, max_lr
        self.nbeta, self.init_loss = nbeta, init_loss
        self.lr: float | None = lr if boosted else max_lr
        self.burnin_rho = math.nan
        self._bias = StepSizeDiagnostic()
        self._llc: list[float] = []
        self.diagnostic = StepSizeDiagnostic()

    def __call__(
        self,
        *,
        chain: int,
        draw: int,
        loss: float,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
    ) -> None:
        if self.lr is None and draw >= self.boosted - max(1, self.boosted // 4):
            self._bias(chain=chain, draw=draw, loss=loss, model=model, optimizer=optimizer)
            self._llc.append(self.nbeta * (loss - self.init_loss))
        if draw == self.boosted - 1:
            if self.lr is None:
                boosted_lr = optimizer.param_groups[0]["lr"]
                llc = float(np.mean(self._llc))
                self.burnin_rho = self._bias.get_results()["llc/step_bias"] / llc
                self.lr = self.max_lr
                if llc > 0 and math.isfinite(self.burnin_rho) and self.burnin_rho > 0:
                    self.lr = min(self.max_lr, self.target * boosted_lr / self.burnin_rho)
            for group in optimizer.param_groups:
                group["lr"] = self.lr
        if draw >= self.skip:
            self.diagnostic(chain=chain, draw=draw, loss=loss, model=model, optimizer=optimizer)

    def get_results(self) -> dict[str, float]:
        return self.diagnostic.get_results()


#: Boosted burn-in steps at least: the last quarter measures the draws' step,
#: and a few steps from ``w*`` have not spread yet (they see the pilots' bias).
_MIN_BOOSTED_STEPS = 200


def estimate_learning_coeff_calibrated(
    model: torch.nn.Module,
    loader: Iterable[Any],
    evaluate: Evaluate | None = None,
    *,
    nbeta: float,
    localization: float = 1.0,
    target_bias: float = 0.05,
    lr: float = 1e-5,
    burnin_time: float = 0.02,
    burnin_boost: float = 4.0,
    num_burnin_steps: int = 500,
    num_draws: int = 2000,
    num_chains: int = 1,
    max_runs: int = 2,
    max_steps: int = 200_000,
    init_loss: float | None = None,
    seed: int = 0,
    optimizer_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """LLC estimate with an SGLD step size chosen and verified by the bias diagnostic.

    1. :func:`calibrate_step_size` with ``target_bias / 2``: short pilots
       start at ``w*`` and see the bias of a chain that has not spread yet,
       which on singular models is 2-5 times below what the full chain
       reaches (deep linear networks, reduced-rank regression at 0).
    2. A boosted burn-in: ``ceil(burnin_time / (burnin_boost * eps))`` steps
       (at least 200) at ``burnin_boost * eps``. What the chain needs before its draws mean
       anything is *diffusion time* ``eps * steps`` (how far the noise has
       carried it along the shallow, singular directions), not a step count:
       a fixed 2000 steps stops being enough once the calibrated ``eps``
       falls with width. The discretization bias of the burn-in never enters
       the estimate, so its step is raised; the stiff directions it
       over-spreads relax within tens of steps at ``eps``.
       Over its last quarter the spread chain measures ``rho / eps`` and
       sets the draws' step ``eps`` for ``target_bias`` (at most the
       boosted step).
    3. ``num_burnin_steps`` more at ``eps``, then ``num_draws`` draws with
       :class:`StepSizeDiagnostic` on every draw.
    4. If the draws' ``rho`` exceeds ``1.5 target_bias``, the run is
       repeated with the draws' step rescaled by ``target_bias / rho`` (at
       most ``max_runs`` estimates in all).

    Args:
        model: The trained network.
        loader: Batches.
        evaluate: ``evaluate(model, batch)``; default cross-entropy.
        nbeta: Inverse temperature.
        localization: ``gamma``.
        target_bias: Relative discretization bias allowed (``rho`` of the draws).
        lr: First pilot's step size.
        burnin_time: Diffusion time ``lr * steps`` of the boosted burn-in
            (0: none). 0.02 was measured to equilibrate deep linear networks
            of 1k-1M parameters at ``nbeta = 1000``, ``gamma = 1``; a smaller
            ``nbeta`` widens the posterior and needs more (at 100, 0.02 left
            the 1k network 9% low).
        burnin_boost: Step factor of the boosted burn-in (>= 1).
        num_burnin_steps: Steps at the calibrated step between the boosted
            burn-in and the first draw.
        num_draws: Draws per chain.
        num_chains: Chains.
        max_runs: Estimates at most (1: no verification rerun).
        max_steps: Refuse to run chains longer than this (boosted burn-in,
            burn-in and draws together): a calibrated step so small that
            ``burnin_time`` needs more steps signals a problem to look at.
        init_loss: ``L(w*)``; default as in the estimator.
        seed: Seed of pilots and chains.
        optimizer_kwargs: Further SGLD keywords.
        **kwargs: Passed on to
            :func:`~gradsketch.sampling.estimate_learning_coeff_with_summary`
            (not ``num_steps_bw_draws``, ``callbacks`` or ``store``).

    Returns:
        The estimator's summary of the draws, plus ``llc/lr`` (the step
        used), ``llc/step_bias`` (absolute) and ``llc/step_bias_rel``
        (``rho``) of the run returned, ``llc/burnin_lr`` and
        ``llc/burnin_steps`` (the boosted burn-in), ``llc/steps`` (per
        chain, all phases) and ``llc/runs`` (estimates made).

    Example:
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> model = torch.nn.Linear(3, 2, bias=False)
        >>> x = torch.randn(64, 3)
        >>> out = estimate_learning_coeff_calibrated(
        ...     model, DataLoader(TensorDataset(x, model(x).detach()), batch_size=16),
        ...     lambda m, b: 0.5 * (m(b[0]) - b[1]).square().sum(1).mean(),
        ...     nbeta=100.0, lr=1e-3, burnin_time=0.0, num_burnin_steps=50, num_draws=100,
        ...     verbose=False)
        >>> out["llc/step_bias_rel"] < 0.075
        True
    """
    if isinstance(max_runs, bool) or not isinstance(max_runs, int) or max_runs < 1:
        raise ValueError(f"`max_runs` must be a positive int, got {max_runs!r}.")
    if not (isinstance(burnin_time, (int, float)) and 0.0 <= burnin_time < math.inf):
        raise ValueError(
            f"`burnin_time` must be a finite float >= 0, got {burnin_time!r}; e.g. 0.02 "
            "(0 turns the boosted burn-in off)."
        )
    if not (isinstance(burnin_boost, (int, float)) and 1.0 <= burnin_boost < math.inf):
        raise ValueError(
            f"`burnin_boost` must be a float >= 1, got {burnin_boost!r}; e.g. 4.0 "
            "(1 burns in at the calibrated step)."
        )
    nonnegative_int("num_burnin_steps", num_burnin_steps)
    positive_int("num_draws", num_draws)
    positive_int("max_steps", max_steps)
    for name in ("callbacks", "num_steps_bw_draws", "store"):
        if name in kwargs:
            raise ValueError(
                f"`{name}` is set by estimate_learning_coeff_calibrated (it runs its burn-in "
                "schedule and StepSizeDiagnostic as callbacks on every step); call "
                "estimate_learning_coeff_with_summary at the returned `llc/lr` to use it."
            )
    online = bool(kwargs.pop("online", False))
    calibration = calibrate_step_size(
        model,
        loader,
        evaluate,
        nbeta=nbeta,
        localization=localization,
        target_bias=target_bias / 2,
        lr=lr,
        init_loss=init_loss,
        seed=seed + 1_000_003,
        optimizer_kwargs=optimizer_kwargs,
        device=kwargs.get("device", "cpu"),
    )
    if init_loss is None:
        device = torch.device(kwargs.get("device", "cpu"))
        init_loss = _initial_loss(
            copy.deepcopy(model).to(device).eval(),
            loader,
            evaluate or evaluate_ce,
            device,
            seed,
        )
    eps = calibration.lr
    boost = float(burnin_boost)
    rerun_lr: float | None = None
    run = 0
    while True:
        boosted_lr = boost * eps
        boosted = 0
        if burnin_time > 0:
            boosted = max(_MIN_BOOSTED_STEPS, math.ceil(burnin_time / boosted_lr))
        skip = boosted + num_burnin_steps
        if skip + num_draws > max_steps:
            raise RuntimeError(
                f"the calibrated step lr={eps:.3g} needs {boosted} boosted burn-in steps for "
                f"burnin_time={burnin_time:g}, so {skip + num_draws} steps per chain, over "
                f"max_steps={max_steps}; raise `max_steps`, or lower `nbeta` or the "
                "gradient noise (a larger batch) so that a larger step passes the calibration."
            )
        schedule = _BurninSchedule(
            boosted=boosted,
            skip=skip,
            target=target_bias,
            max_lr=boosted_lr if boosted else eps,
            nbeta=float(nbeta),
            init_loss=float(init_loss),
            lr=rerun_lr,
        )
        # Unwarned: the trace holds the boosted burn-in, which the estimate below skips.
        out = _run_unwarned(
            model,
            loader,
            evaluate,
            optimizer_kwargs,
            lr=boosted_lr if boosted else eps,
            nbeta=nbeta,
            localization=localization,
            may_diverge=boost > 1.0,
            num_draws=skip + num_draws,
            num_burnin_steps=0,
            num_chains=num_chains,
            init_loss=init_loss,
            seed=seed,
            callbacks=[schedule],
            **kwargs,
        )
        if out is None:
            boost = max(1.0, boost / 2)  # the boosted burn-in diverged: halve its step
            continue
        run += 1
        assert schedule.lr is not None
        out.update(_summary(out["loss/trace"][:, skip:], out["init_loss"], out["nbeta"], online))
        llc = float(out["llc/mean"])
        rho = float(out["llc/step_bias"]) / llc if llc > 0 else math.inf
        out.update(
            {
                "llc/lr": schedule.lr,
                "llc/step_bias_rel": rho,
                "llc/burnin_lr": boosted_lr if boosted else math.nan,
                "llc/burnin_steps": boosted,
                "llc/burnin_step_bias_rel": schedule.burnin_rho,
                "llc/steps": skip + num_draws,
                "llc/runs": run,
            }
        )
        if rho <= 1.5 * target_bias or not math.isfinite(rho) or run >= max_runs:
            return out
        # The draws' rho is the spread chain's own: rerun at the step it asks for.
        eps = rerun_lr = schedule.lr * target_bias / rho
