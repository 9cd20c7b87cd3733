"""The per-layer methods' ``projection="auto"``: exact rows where they fit, LoGra where not.

A per-layer method stores, per training document, each layer's gradient
(``d_out x (d_in + 1)`` numbers, or its ``[a, g]`` factors). At GPT-2-small
shape that is ~85 M numbers a document, far beyond any disk at 10^4-10^6
documents. Where the exact rows would not fit the free disk, and the user
chose neither ``projection`` nor ``rows``, the rows are projected per layer
(LoGra, Choe et al. 2024; bergson's default): ``k`` = :data:`DEFAULT_SIDE`
per side, so ``k²`` numbers per layer. Its cost is measured in
benchmarks/RESULTS.md (inner products against the exact features at
k = 16, 64, 256 per side; LDS against exact EK-FAC on the GPT-2 protocol).

Exact scores stay one argument away: ``projection=None`` (then
``rows="auto"`` recomputes the training gradients while scoring, as
Kronfluence does) or ``rows="recompute"``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from gradsketch._store import SETTINGS_FILE
from gradsketch.attribution import _plan
from gradsketch.attribution._layer_capture import find_layers

__all__ = ["AUTO_PROJECTION", "DEFAULT_SIDE", "default_projection", "given_projection"]

#: The value of ``TRAKer(projection=...)`` that lets the run choose.
AUTO_PROJECTION = "auto"
#: ``k_in = k_out`` of the default per-layer projection (256 numbers per layer).
DEFAULT_SIDE = 16


def given_projection(projection: Any) -> Any:
    """``projection`` as the user chose it: ``None`` where it was left to the run."""
    return None if isinstance(projection, str) and projection == AUTO_PROJECTION else projection


def _stored_projection(save_dir: Path) -> tuple[bool, tuple[int, int] | None]:
    """``(found, projection)`` of the store at ``save_dir`` (a reopened store keeps its own)."""
    try:
        record = json.loads((Path(save_dir) / SETTINGS_FILE).read_text())
    except (OSError, ValueError):
        return False, None
    projector = record.get("projector") if isinstance(record, dict) else None
    if not isinstance(projector, dict) or projector.get("kind") != "per-layer":
        return False, None
    sides = projector.get("projection")
    return True, None if sides is None else (int(sides[0]), int(sides[1]))


def _row_bytes(
    model: nn.Module,
    grad_wrt: Sequence[str] | None,
    projection: tuple[int, int] | None,
    itemsize: int,
    sampled: bool,
) -> int:
    """Bytes per document of the widest stored per-layer row (the dense ``vec(G)``), and Q."""
    width = sum(layer.width for layer in find_layers(model, grad_wrt, projection))
    return width * (2 if sampled else 1) * itemsize + 8


def default_projection(
    projection: Any,
    *,
    model: nn.Module,
    grad_wrt: Sequence[str] | None,
    train_set_size: int,
    itemsize: int,
    sampled: bool,
    rows: str,
    save_dir: Path,
    logger: logging.Logger,
) -> tuple[int, int] | None:
    """The per-layer ``projection`` a TRAKer runs with (``"auto"`` decided and logged).

    An explicit ``projection`` (a pair, or ``None`` for exact rows) and an
    explicit ``rows`` are kept. ``"auto"``: a store already at ``save_dir``
    keeps its projection; otherwise the rows are exact unless the exact rows
    of all ``train_set_size`` documents exceed the free disk
    (:func:`~gradsketch.attribution._plan.free_disk`) while the rows
    projected to ``(DEFAULT_SIDE, DEFAULT_SIDE)`` per layer fit. Where
    neither fits, exact rows are recomputed at scoring
    (:func:`~gradsketch.attribution._plan.choose_rows`).

    Args:
        projection: ``TRAKer(projection=...)``.
        model: the model.
        grad_wrt: the differentiated parameters (``None``: all).
        train_set_size: documents to store.
        itemsize: bytes per stored number.
        sampled: ``curvature="sampled"`` (a second row per document).
        rows: ``TRAKer(rows=...)``.
        save_dir: the store's folder.
        logger: the TRAKer's logger.

    Returns:
        ``(k_in, k_out)`` or ``None`` (exact rows).
    """
    if not (isinstance(projection, str) and projection == AUTO_PROJECTION):
        return projection  # type: ignore[no-any-return]
    found, stored = _stored_projection(save_dir)
    if found:
        return stored
    if rows != "auto":
        return None
    free = _plan.free_disk(save_dir)
    exact = _row_bytes(model, grad_wrt, None, itemsize, sampled) * train_set_size
    if free is None or exact <= free:
        return None
    side = (DEFAULT_SIDE, DEFAULT_SIDE)
    per_row = _row_bytes(model, grad_wrt, side, itemsize, sampled)
    if per_row * train_set_size > free:
        return None  # nothing per document fits: exact rows, recomputed while scoring
    logger.info(
        "projection='auto': %r per layer (LoGra): exact per-layer rows would need ~%s on disk "
        "but %s is free; the projected rows need ~%s (%s per document). For exact scores pass "
        "projection=None (training gradients are then recomputed while scoring) or "
        "rows='recompute'.",
        side,
        _plan._gb(exact),
        _plan._gb(free),
        _plan._gb(per_row * train_set_size),
        _plan._gb(per_row),
    )
    return side
