"""What TRAKer checks so that a bad input or a damaged store never becomes a silent score.

* **Finite or named.** Weights are checked when a checkpoint is loaded, and
  each batch's features, out-to-loss terms and stored rows before they are
  accumulated or written: a NaN or inf is refused at the batch where it
  appears, naming the training rows (or parameters) and the likely cause,
  instead of turning every score into NaN later.
* **Rows as the caller says.** ``num_samples`` / ``inds`` must count the
  batch's rows, checked at the call that gets them.
* **Damaged rows named.** by the store's own integrity layer
  (:meth:`gradsketch._store.RowStore.damage` on :mod:`gradsketch._integrity`):
  each array, chunk, file and the rows it held, then the fix.
* **Side files checked.** :func:`load_npz` reads an ``.npz`` written
  atomically, verifying every member's CRC-32 (``zipfile`` checks it on
  read); a missing, truncated or garbled file reads as ``None`` with the
  reason, for the caller to recompute.
"""

from __future__ import annotations

import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gradsketch._integrity import rows_text
from gradsketch.errors import NonFiniteFeaturesError


def check_weights(state: Mapping[str, Any], model_id: int) -> None:
    """Refuse a checkpoint with non-finite floating-point entries, naming the parameters.

    Raises:
        NonFiniteFeaturesError: some entries are NaN or inf.
    """
    bad = []
    for name, value in state.items():
        if isinstance(value, Tensor) and value.is_floating_point():
            count = int((~torch.isfinite(value.detach())).sum())
            if count:
                bad.append(f"{name} ({count} of {value.numel()} entries)")
    if bad:
        raise NonFiniteFeaturesError(
            f"checkpoint of model id {model_id} has NaN or inf weights in {bad[:10]}"
            f"{' ...' if len(bad) > 10 else ''}: every gradient, and so every score, would be "
            "NaN. The training run that saved it diverged (lower its learning rate, or use an "
            "earlier checkpoint)."
        )


def check_batch_rows(batch: Sequence[Tensor], idx: np.ndarray, given: str, what: str) -> None:
    """Refuse a batch whose row count differs from the rows named by ``inds`` / ``num_samples``.

    Raises:
        ValueError: naming the argument, its value and the batch's rows.
    """
    rows = {int(t.shape[0]) for t in batch if isinstance(t, Tensor) and t.dim() > 0}
    if rows and rows != {int(idx.size)}:
        raise ValueError(
            f"{what}: `{given}` names {idx.size} row(s) but the batch has "
            f"{sorted(rows)[0] if len(rows) == 1 else sorted(rows)} row(s). Pass "
            f"{given}= with one entry per batch row (num_samples=len(batch) or "
            "inds of the same length)."
        )


def check_finite_rows(
    values: Mapping[str, Tensor | None], idx: np.ndarray, batch: Sequence[Tensor], what: str
) -> None:
    """Refuse a batch whose computed rows are not finite, naming the rows and the likely cause.

    A row is refused when it holds NaN or inf, or when its squared norm
    overflows (it would make XᵀX or the curvature statistics inf).

    Args:
        values: ``{name: [B, ...] tensor}`` computed for the batch's rows ``idx``
            (``None`` entries skipped).
        idx: ``[B]`` row indices (training rows or targets).
        batch: the batch they were computed from (to tell bad inputs from an overflow).
        what: ``"featurize"`` or ``"score"``.

    Raises:
        NonFiniteFeaturesError: some rows are not finite.
    """
    bad = np.zeros(idx.size, dtype=bool)
    names = []
    for name, t in values.items():
        if t is None or t.numel() == 0 or not t.is_floating_point():
            continue
        # A row whose squared norm overflows poisons XᵀX / the curvature sums as
        # surely as a NaN: refuse both (NaN and inf entries make the sum non-finite).
        rows = ~torch.isfinite(t.detach().reshape(t.shape[0], -1).square().sum(dim=1))
        if bool(rows.any()):
            bad |= rows.cpu().numpy()[: idx.size]
            names.append(name)
    if not bad.any():
        return
    inputs = np.zeros(idx.size, dtype=bool)
    for t in batch:
        if isinstance(t, Tensor) and t.is_floating_point() and t.dim() > 0:
            inputs |= ~torch.isfinite(t.detach()).reshape(t.shape[0], -1).all(dim=1).cpu().numpy()
    where = idx[bad].tolist()
    if (inputs & bad).any():
        cause = (
            f"the inputs of rows {rows_text(idx[inputs & bad].tolist())} hold NaN or inf: clean "
            "or drop them"
        )
    else:
        cause = (
            "the inputs are finite, so the forward or backward pass overflowed at these rows "
            "(huge inputs or logits, or float16 weights): rescale those inputs or featurize in "
            "float32"
        )
    raise NonFiniteFeaturesError(
        f"{what}: {', '.join(names)} of rows {rows_text(where)} are NaN or inf (or so large "
        f"that their squares overflow); nothing of this batch was stored. Likely cause: {cause}."
    )


def load_npz(path: Path) -> tuple[dict[str, np.ndarray] | None, str | None]:
    """The arrays of an ``.npz`` side file, or ``(None, reason)`` when it is absent or damaged.

    Every member's CRC-32 is verified (``zipfile`` checks it when a member is
    read in full), so a truncated, garbled or bit-flipped file is caught here.
    """
    if not path.is_file():
        return None, "missing"
    try:
        # Our own handle: closed even when np.load fails on a damaged file.
        with open(path, "rb") as f, np.load(f, allow_pickle=False) as z:
            return {k: np.array(z[k]) for k in z.files}, None
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError) as exc:
        return None, f"{type(exc).__name__}: {exc}"
