"""What the rest of gradsketch needs from a parameter mask: one protocol for every entry point."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol, runtime_checkable

from torch import Tensor, nn

__all__ = ["MaskLike"]


@runtime_checkable
class MaskLike(Protocol):
    """A named boolean mask over a model's parameters (:class:`ParamMask` is the one we ship).

    Sketches and projectors (``mask=``) select the specified entries of each
    gradient and carry the mask's fingerprint; samplers (``mask=``) read the
    per-parameter masks with :meth:`items`; :class:`~gradsketch.attribution.TRAKer`
    hands the mask to its projector.

    Example:
        >>> from gradsketch.masked import ParamMask
        >>> isinstance(ParamMask.from_patterns(nn.Linear(2, 2), ["weight"]), MaskLike)
        True
    """

    @property
    def numel(self) -> int:
        """Number of selected entries over all parameters."""
        ...

    @property
    def fingerprint(self) -> str:
        """A digest of the names, shapes and bits; equal masks have equal fingerprints."""
        ...

    def items(self) -> Iterator[tuple[str, Tensor]]:
        """``(name, bool mask)`` per parameter, in order."""
        ...

    def select(
        self, source: Mapping[str, Tensor] | nn.Module | Tensor, name: str | None = None
    ) -> Tensor:
        """The selected entries of one tensor or of every tensor, concatenated."""
        ...

    def select_batched(self, source: Mapping[str, Tensor]) -> Tensor:
        """``[batch, numel]``: the selected entries of per-example tensors ``[batch, ...]``."""
        ...
