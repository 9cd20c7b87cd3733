"""The one exception type of :mod:`gradsketch.masked` and message helpers."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from gradsketch.errors import MaskError

__all__ = ["MaskError", "describe", "name_list"]


def describe(obj: object) -> str:
    """Say what ``obj`` is in a few words, for error messages."""
    if isinstance(obj, Tensor):
        layout = "" if obj.layout == torch.strided else f", layout={obj.layout}"
        return (
            f"{type(obj).__name__}(shape={tuple(obj.shape)}, dtype={obj.dtype}, "
            f"device={obj.device}{layout})"
        )
    text = repr(obj)
    return text if len(text) <= 80 else text[:77] + "..."


def name_list(names: Iterable[str], limit: int = 12) -> str:
    """Format names for a message, eliding all but the first ``limit``."""
    names = list(names)
    shown = ", ".join(repr(n) for n in names[:limit])
    if len(names) > limit:
        shown += f", ... ({len(names) - limit} more)"
    return f"[{shown}]"
