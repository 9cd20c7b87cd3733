"""Ground-floor plotting helpers: a headless matplotlib and one way to save a figure.

Every capability that draws (trace plots, score histograms, spectra) goes
through :func:`new_figure` and :func:`save_figure`, so figures are written the
same way everywhere and no module ever opens a window.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["new_figure", "pyplot", "save_figure"]


def pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the Agg backend, imported on first use.

    Importing a capability never imports matplotlib; only drawing does.

    Raises:
        ModuleNotFoundError: matplotlib is not installed (the message names the extra).
    """
    try:
        import matplotlib
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            "gradsketch draws its plots with matplotlib, which is not installed; "
            "pip install 'gradsketch[demo]' (or matplotlib).",
            name=error.name,
        ) from error
    # Agg before pyplot is imported anywhere through us: gradsketch runs on
    # servers and in CI where there is no display.
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def new_figure(
    *, width: float = 6.4, height: float = 4.0, **subplots_kwargs: Any
) -> tuple[Figure, Any]:
    """A figure and its axes from :func:`matplotlib.pyplot.subplots` on the Agg backend.

    Args:
        width: Width in inches.
        height: Height in inches.
        **subplots_kwargs: Passed to ``plt.subplots`` (``nrows``, ``ncols``, ...).

    Returns:
        ``(figure, axes)``.

    Example:
        >>> fig, ax = new_figure()
        >>> _ = ax.plot([0, 1], [1, 0])
        >>> pyplot().close(fig)
    """
    return pyplot().subplots(figsize=(width, height), **subplots_kwargs)


def save_figure(fig: Figure, path: str | os.PathLike[str], *, dpi: int = 120) -> Path:
    """Write ``fig`` as a PNG to ``path`` (parents created) and close it.

    Closing matters: pyplot keeps every open figure alive, and loops that plot
    per chain or per checkpoint would otherwise grow without bound.

    Args:
        fig: The figure to write.
        path: Destination; a missing ``.png`` suffix is added.
        dpi: Resolution.

    Returns:
        The path written.

    Example:
        >>> import tempfile
        >>> fig, ax = new_figure()
        >>> with tempfile.TemporaryDirectory() as d:
        ...     save_figure(fig, Path(d) / "plot").suffix
        '.png'
    """
    out = Path(path)
    if out.suffix.lower() != ".png":
        out = out.with_name(out.name + ".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi, bbox_inches="tight")
    pyplot().close(fig)
    return out
