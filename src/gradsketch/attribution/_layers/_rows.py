"""Which rows of a hooked call belong to which example.

Layer hooks split what a module saw by example. Two layouts are read:

* the batch on dim 0, ``[B, ...]`` (one "row" per example, of any shape);
* the batch flattened with a sequence, batch-major, ``[B * T, ...]``: OPT
  runs its MLP and final norm on ``hidden.reshape(-1, d)``, and the router
  and experts of a mixture-of-experts layer see every token of every
  example as one row. ``T`` must be a length of the batch's own tensors
  (a dim of ``input_ids``, ``labels``, images...), which keeps a
  sequence-first ``[T, B, ...]`` layout (``T = k B``) or a gathered subset of
  the tokens of some other size from passing for it.

A leading dim that is neither does not map to the examples; the hook
computer hands such a module to its parent (see
:class:`~gradsketch.attribution.HookGradientComputer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor
from torch.utils._pytree import tree_flatten


def batch_lengths(batch: Sequence[Any], batch_size: int) -> frozenset[int]:
    """The sizes (above 1) of the non-leading dims of the batch's ``[B, ...]`` tensors.

    Example:
        >>> import torch
        >>> sorted(batch_lengths((torch.zeros(2, 16, dtype=torch.long), torch.zeros(2)), 2))
        [16]
    """
    lengths: set[int] = set()
    for t in tree_flatten(list(batch))[0]:
        if isinstance(t, Tensor) and t.dim() >= 2 and t.shape[0] == batch_size:
            lengths.update(int(d) for d in t.shape[1:] if d > 1)
    return frozenset(lengths)


@dataclass(frozen=True)
class RowLayout:
    """The batch size and the lengths a module may flatten with it.

    Example:
        >>> layout = RowLayout(4, frozenset({16}))
        >>> layout.rows(4), layout.rows(64), layout.rows(8)
        (1, 16, None)
    """

    batch_size: int
    lengths: frozenset[int]

    def rows(self, n: int) -> int | None:
        """Rows per example of a leading dim ``n``: 1 (batch first), ``T`` (flattened) or None."""
        b = self.batch_size
        if n == b:
            return 1
        if n > b and n % b == 0 and n // b in self.lengths:
            return n // b
        return None

    def call_rows(self, inputs: Any, output: Any) -> dict[int, int] | None:
        """``{leading dim: rows per example}`` of one call's tensors; ``None`` if they do not map.

        Every floating output must map. A call that reads no floating input
        (an index lookup) maps a flattened output only when one of its inputs
        is the matching 1-D index vector: a lookup of positions shared by
        every example (T5's relative position buckets, ``[T, T]``) does not.
        Floating inputs that map add their leading dims; the others
        (``[1, T, d]`` rotary tables, ``[T, T]`` masks) are constants.
        """
        ins = [t for t in tree_flatten(inputs)[0] if isinstance(t, Tensor)]
        outs = [
            t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.is_floating_point()
        ]
        rows = {self.batch_size: 1}
        floating_in = [t for t in ins if t.is_floating_point() or t.is_complex()]
        index_vectors = {int(t.shape[0]) for t in ins if t.dim() == 1}
        for t in outs:
            r = self.rows(int(t.shape[0])) if t.dim() else None
            if r is None:
                return None
            if r > 1 and not floating_in and int(t.shape[0]) not in index_vectors:
                return None
            rows[int(t.shape[0])] = r
        for t in floating_in:
            r = self.rows(int(t.shape[0])) if t.dim() else None
            if r is not None:
                rows[int(t.shape[0])] = r
        return rows


def leaf_rows(t: Any, rows: dict[int, int]) -> int | None:
    """Rows per example of one input of a call (``None``: shared by every example).

    A 1-D integer vector counting up by one (``cache_position``, ``arange``)
    holds positions, not one entry per example, whatever its length.
    """
    if not isinstance(t, Tensor) or t.dim() == 0:
        return None
    r = rows.get(int(t.shape[0]))
    if r is None:
        return None
    if t.dim() == 1 and not t.is_floating_point() and t.numel() > 1:
        if bool((t[1:] - t[:-1] == 1).all()):
            return None
    return r


def by_example(t: Tensor, batch_size: int, r: int) -> Tensor:
    """``[B * r, ...]`` viewed as ``[B, r, ...]`` (``r = 1`` adds an axis of 1)."""
    return t.reshape(batch_size, r, *t.shape[1:])


def unflatten(t: Any, batch_size: int, rows: dict[int, int]) -> Any:
    """A flattened ``[B * T, ...]`` tensor as ``[B, T, ...]``; anything else unchanged.

    This is the layout the per-layer rules read (``[B, positions..., d]``).
    """
    r = leaf_rows(t, rows)
    return by_example(t, batch_size, r) if r is not None and r > 1 else t
