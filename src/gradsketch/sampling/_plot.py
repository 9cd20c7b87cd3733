"""Trace plots of LLC runs."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from gradsketch._plotting import new_figure, save_figure

__all__ = ["plot_trace"]


def plot_trace(results: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """PNG of every chain's loss trace, the initial loss and the LLC estimate.

    A flat, overlapping set of traces above the initial loss is what a
    healthy localized run looks like; a drifting or diverging chain shows up
    at once.

    Args:
        results: Output of :func:`~gradsketch.sampling.estimate_learning_coeff_with_summary`
            (needs ``loss/trace`` ``[chains, draws]``; uses ``init_loss``,
            ``llc/mean``, ``llc/std`` when present).
        path: Destination PNG.

    Returns:
        The path written.

    Example:
        >>> import tempfile
        >>> res = {"loss/trace": np.ones((2, 5)), "init_loss": 0.9, "llc/mean": 1.0, "llc/std": 0.1}
        >>> with tempfile.TemporaryDirectory() as d:
        ...     plot_trace(res, Path(d) / "trace.png").exists()
        True
    """
    if "loss/trace" not in results:
        raise ValueError(
            f"`results` has no 'loss/trace' (keys: {sorted(results)}); pass the dict returned "
            "by estimate_learning_coeff_with_summary."
        )
    trace = np.asarray(results["loss/trace"], dtype=float)
    if trace.ndim != 2:
        raise ValueError(
            f"`results['loss/trace']` must be [chains, draws], got shape {trace.shape}."
        )
    fig, ax = new_figure()
    draws = np.arange(trace.shape[1])
    for chain, row in enumerate(trace):
        ax.plot(
            draws, row, lw=0.8, alpha=0.8, label=f"chain {chain}" if trace.shape[0] <= 10 else None
        )
    if "init_loss" in results:
        ax.axhline(float(results["init_loss"]), color="k", ls="--", lw=1.0, label="initial loss")
    title = "SGMCMC loss trace"
    if "llc/mean" in results:
        title += f"  LLC = {float(results['llc/mean']):.4g}"
        if "llc/std" in results:
            title += f" ± {float(results['llc/std']):.2g}"
    ax.set_title(title)
    ax.set_xlabel("draw")
    ax.set_ylabel("loss")
    if trace.shape[0] <= 10 or "init_loss" in results:
        ax.legend(fontsize="small", loc="best")
    return save_figure(fig, path)
