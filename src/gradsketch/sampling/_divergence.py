"""Diverged SGMCMC chains: a loss that blows up, or an LLC no model can have.

The local learning coefficient lies in ``[0, d/2]`` for ``d`` sampled
weights (Watanabe 2009; Lau et al. 2023), and a chain near a local minimum
settles at ``E[L] ~ L(w*) + llc / nbeta``. A step size too large for the
loss's curvature instead makes the loss grow from draw to draw by orders of
magnitude, to ``inf`` or ``NaN``, and the estimate with it (``lr=1e3`` on a
2-layer GPT-2 gives an "LLC" of 1e12). :func:`divergence_report` names such
chains from their loss trace, and :func:`warn_if_diverged` warns with the
step size to try; the estimators call it once per estimate.

Example:
    >>> import numpy as np
    >>> trace = np.array([[1.0, 1.1, 1.0, 1.05], [1.0, 30.0, 4e3, 9e5]])
    >>> report = divergence_report(trace, 1.0, nbeta=10.0, numel=50, lr=1e-3)
    >>> print(report.split(";")[0])
    chain 1: the loss grew from 1 to 9e+05 by the last draws (LLC 2.3e+06, far above d/2 = 25)
    >>> print(report.split(";")[1])
     the chain diverged: lower the step size (try `lr`=0.0001) or raise `localization`.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np

__all__ = ["ChainDivergenceWarning", "divergence_report", "warn_if_diverged"]

#: Growth of the loss in excess of ``L(w*)`` from the first to the last tenth of
#: the draws counted as "orders of magnitude".
GROWTH = 100.0
#: An LLC beyond ``FAR * d/2`` above, or ``FAR * d/2`` below zero, is "far outside".
FAR = 2.0


class ChainDivergenceWarning(RuntimeWarning):
    """An SGMCMC chain diverged (or left ``w*``'s basin); its LLC estimate means nothing."""


def _fmt(x: float) -> str:
    return f"{x:.2g}"


def divergence_report(
    loss_trace: np.ndarray,
    init_loss: float | np.ndarray,
    *,
    nbeta: float,
    numel: int | None,
    lr: float | None = None,
    lr_name: str = "lr",
) -> str | None:
    """One line per diverged chain of a ``[chains, draws]`` loss trace, or None.

    A chain is named when its loss is NaN or infinite; when its mean loss
    gives an LLC ``nbeta * (mean - L(w*))`` above ``FAR * numel / 2`` (with
    ``numel`` known); or when its excess loss over ``L(w*)`` grew
    ``GROWTH``-fold from the first to the last tenth of the draws and ends
    above ``numel / 2`` in LLC units. An LLC below ``-FAR * numel / 2`` is
    named too: ``w*`` is then no local minimum of the sampled loss.

    Args:
        loss_trace: ``[chains, draws]`` mean loss per draw.
        init_loss: ``L(w*)``, a scalar or one per chain.
        nbeta: Inverse temperature times sample size.
        numel: Number of sampled weights ``d`` (None: skip the bounds).
        lr: The step size used, for the suggestion (a tenth of it).
        lr_name: How the caller spells the step size.
    """
    trace = np.asarray(loss_trace, dtype=np.float64)
    if trace.ndim == 1:
        trace = trace[None]
    chains, draws = trace.shape
    init = np.broadcast_to(np.asarray(init_loss, dtype=np.float64), (chains,))
    half = None if not numel else numel / 2.0
    advice = (
        f"lower the step size (try `{lr_name}`={_fmt(lr / 10)})"
        if lr is not None and lr > 0
        else f"lower the step size `{lr_name}`"
    )
    lines = []
    for c in range(chains):
        row, w0 = trace[c], float(init[c])
        if not math.isfinite(w0):
            lines.append(f"chain {c}: L(w*) = {w0}; the weights or the loss are not finite.")
            continue
        bad = np.flatnonzero(~np.isfinite(row))
        if bad.size:
            lines.append(
                f"chain {c}: the loss is {row[bad[0]]} from draw {int(bad[0])}; the chain "
                f"diverged: {advice} or raise `localization`."
            )
            continue
        if draws == 0:
            continue
        llc = nbeta * (float(row.mean()) - w0)
        k = max(1, draws // 10)
        head, tail = float(row[:k].mean()) - w0, float(row[-k:].mean()) - w0
        grew = draws >= 2 and tail > GROWTH * max(abs(head), 1e-12)
        above = half is not None and llc > FAR * half
        if above or (grew and (half is None or nbeta * tail > half)):
            bound = "" if half is None else f", far above d/2 = {_fmt(half)}"
            what = (
                f"the loss grew from {_fmt(w0 + head)} to {_fmt(w0 + tail)} by the last draws"
                if grew
                else f"the mean loss {_fmt(float(row.mean()))} is far above L(w*) = {_fmt(w0)}"
            )
            lines.append(
                f"chain {c}: {what} (LLC {_fmt(llc)}{bound}); the chain diverged: {advice} or "
                "raise `localization`."
            )
        elif half is not None and llc < -FAR * half:
            lines.append(
                f"chain {c}: the loss fell from L(w*) = {_fmt(w0)} to {_fmt(w0 + tail)} (LLC "
                f"{_fmt(llc)}, far below 0): w* is no local minimum of the sampled loss; train "
                "it to convergence or raise `localization`."
            )
    return "\n".join(lines) if lines else None


def warn_if_diverged(
    loss_trace: np.ndarray,
    init_loss: float | np.ndarray,
    *,
    stacklevel: int = 2,
    **settings: Any,
) -> bool:
    """Warn (:class:`ChainDivergenceWarning`) with :func:`divergence_report`; True when it did.

    ``settings`` are :func:`divergence_report`'s keywords (``nbeta``,
    ``numel``, ``lr``, ``lr_name``).
    """
    report = divergence_report(loss_trace, init_loss, **settings)
    if report is None:
        return False
    warnings.warn(
        f"the LLC estimate is not trustworthy:\n{report}",
        ChainDivergenceWarning,
        stacklevel=stacklevel + 1,
    )
    return True
