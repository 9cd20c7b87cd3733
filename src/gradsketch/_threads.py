"""Torch's intra-op thread count, set for a block and restored after it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["torch_threads"]


@contextmanager
def torch_threads(n: int = 1) -> Iterator[None]:
    """Run the block on ``n`` intra-op threads, then restore the caller's setting.

    Small matrix work (layer factors of a few hundred, a digits MLP) gains
    nothing from threads, and threads that synchronise stall on shared cores.

    Example:
        >>> before = torch.get_num_threads()
        >>> with torch_threads(1):
        ...     torch.get_num_threads()
        1
        >>> torch.get_num_threads() == before
        True
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
