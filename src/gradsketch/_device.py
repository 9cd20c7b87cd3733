"""Devices: moving a user's batch there, whatever its nesting, and naming one exactly."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["exact_device", "to_device"]


def to_device(batch: Any, device: torch.device | str) -> Any:
    """``batch`` with every tensor moved to ``device``; other leaves are kept.

    Mappings, lists, tuples and named tuples are rebuilt with the same type;
    a tensor already on ``device`` is returned as it is (``Tensor.to``).

    Example:
        >>> from collections import namedtuple
        >>> Pair = namedtuple("Pair", "x y")
        >>> moved = to_device({"a": [torch.ones(1)], "b": Pair(torch.zeros(1), "label")}, "cpu")
        >>> type(moved["b"]).__name__, moved["b"].y, moved["a"][0].device.type
        ('Pair', 'label', 'cpu')
    """
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return type(batch)({k: to_device(v, device) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def exact_device(device: torch.device | str | int) -> torch.device:
    """``device`` with its index filled in, so that it compares equal to a tensor's.

    ``torch.device("cuda") != torch.device("cuda:0")``, yet a tensor moved to
    ``"cuda"`` reports ``cuda:0`` (the current device); this names that one.

    Example:
        >>> exact_device("cpu") == torch.zeros(1).device
        True
    """
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return d
