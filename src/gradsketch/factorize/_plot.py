"""Rank curves: how the output error of a factorized layer falls with its rank."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path

from torch import Tensor, nn

from gradsketch._checks import check_int
from gradsketch.factorize._core import factorize_matrix
from gradsketch.factorize._modules import lookup_factorized_class, max_rank_with_possible_speedup

__all__ = ["RankCurve", "plot_rank_curve"]


@dataclasses.dataclass
class RankCurve:
    """nmse of the best rank-``r`` factorization of one layer, for each ``r``.

    Attributes:
        ranks: latent sizes, increasing.
        nmse: true nmse on the calibration input, one per rank.
        max_rank: largest rank that still saves multiply-adds.
        path: the PNG written, or ``None``.
    """

    ranks: list[int]
    nmse: list[float]
    max_rank: int
    path: Path | None = None


def _default_ranks(limit: int, count: int = 16) -> list[int]:
    if limit <= count:
        return list(range(1, limit + 1))
    return sorted({max(1, round(limit * (i + 1) / count)) for i in range(count)})


def plot_rank_curve(
    module: nn.Module,
    calibration_input: Tensor,
    path: str | Path | None = None,
    *,
    ranks: Sequence[int] | None = None,
    n_iters: int = 3,
    seed: int = 0,
    title: str | None = None,
) -> RankCurve:
    """Fit ``module`` at several ranks and plot nmse against rank to a PNG.

    The vertical line marks the speed-up limit (the largest rank that still
    saves multiply-adds), so the useful range is to its left.

    Args:
        module: a registered layer type (``nn.Linear``, ``nn.Conv2d``).
        calibration_input: inputs the layer sees.
        path: PNG to write (matplotlib, Agg backend), or ``None`` for no plot.
        ranks: ranks to fit; default 16 ranks up to ``min(fan_in, out) - 1``.
        n_iters: alternating least-squares sweeps per fit.
        seed: seed of the randomized SVDs.
        title: plot title; defaults to the module's repr.

    Returns:
        The :class:`RankCurve`.

    Raises:
        TypeError: if no factorized class is registered for ``module``.
        ValueError: if a rank is not a positive int below ``min(in, out)``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> curve = plot_rank_curve(nn.Linear(32, 16), torch.randn(200, 32), ranks=[2, 8])
        >>> curve.ranks, curve.nmse[0] > curve.nmse[1], curve.max_rank
        ([2, 8], True, 10)
    """
    cls = lookup_factorized_class(type(module))
    if cls is None:
        raise TypeError(
            f"`module` must be one of the registered types; got {type(module).__name__}."
        )
    n_in, n_out, kernel = cls.sizes_of(module)
    limit = max_rank_with_possible_speedup(n_in, n_out, kernel or None)
    top = min(n_in * math.prod(kernel), n_out) - 1
    chosen = sorted(set(ranks)) if ranks is not None else _default_ranks(max(1, top))
    for r in chosen:
        fix = f"ranks lie below min(fan_in, out) = {top + 1}"
        check_int("ranks[...]", r, low=1, high=max(1, top) + 1, fix=fix)
    x, y = cls.regression_data(module, calibration_input)
    w = x.new_zeros(x.shape[1], y.shape[1])  # only its shape matters: the fit uses (x, y)
    errors = [factorize_matrix(x, y, w, rank=r, n_iters=n_iters, seed=seed).nmse for r in chosen]
    curve = RankCurve(ranks=list(chosen), nmse=errors, max_rank=limit)
    if path is not None:
        curve.path = _write_png(curve, Path(path), title or repr(module))
    return curve


def _write_png(curve: RankCurve, path: Path, title: str) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.5, 3.8))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(curve.ranks, curve.nmse, marker="o")
    ax.axvline(
        curve.max_rank, color="tab:red", linestyle="--", label=f"speed-up limit ({curve.max_rank})"
    )
    ax.set_xlabel("rank (latent size)")
    ax.set_ylabel("nmse on calibration input")
    ax.set_title(title, fontsize=9)
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
