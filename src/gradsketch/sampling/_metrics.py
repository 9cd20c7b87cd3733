"""Exact per-step norms and inner products of the SGMCMC update components."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import ClassVar

import torch

#: Norm fields, in the order of the rows of :attr:`Metrics.from_gram`'s matrix.
NORM_FIELDS: tuple[str, ...] = (
    "scaled_grad",
    "unscaled_grad",
    "localization",
    "weight_decay",
    "noise",
    "distance",
)

#: Inner-product fields (prior = localization + weight decay).
DOT_FIELDS: tuple[str, ...] = ("dot_grad_prior", "dot_grad_noise", "dot_prior_noise")


def _zero() -> torch.Tensor:
    return torch.zeros((), dtype=torch.float64)


@dataclass
class Metrics:
    """Norms and inner products of one SGMCMC step's update components.

    The step is ``w <- w - scaled_grad - localization - weight_decay + noise``
    (see :class:`~gradsketch.sampling.SGMCMC` for each component's formula).
    Norm fields hold Euclidean norms over every parameter of every group;
    dot fields hold ``<scaled_grad, prior>``, ``<scaled_grad, noise>`` and
    ``<prior, noise>`` with ``prior = localization + weight_decay``. A cosine
    is ``dot / (norm_a * norm_b)``. Values are float64 0-d CPU tensors (the
    field names and meaning match devinterp 2.0's ``Metrics``).

    Attributes:
        numel: number of coordinates that moved (the mask's selected count).

    Example:
        >>> gram = torch.eye(6, dtype=torch.float64) * 4.0
        >>> m = Metrics.from_gram(gram, numel=10)
        >>> float(m.noise), float(m.dot_grad_noise), m.numel
        (2.0, 0.0, 10)
    """

    NORM_FIELDS: ClassVar[tuple[str, ...]] = NORM_FIELDS
    DOT_FIELDS: ClassVar[tuple[str, ...]] = DOT_FIELDS

    scaled_grad: torch.Tensor = field(default_factory=_zero)
    unscaled_grad: torch.Tensor = field(default_factory=_zero)
    localization: torch.Tensor = field(default_factory=_zero)
    weight_decay: torch.Tensor = field(default_factory=_zero)
    noise: torch.Tensor = field(default_factory=_zero)
    distance: torch.Tensor = field(default_factory=_zero)
    dot_grad_prior: torch.Tensor = field(default_factory=_zero)
    dot_grad_noise: torch.Tensor = field(default_factory=_zero)
    dot_prior_noise: torch.Tensor = field(default_factory=_zero)
    numel: int = 0

    @classmethod
    def from_gram(cls, gram: torch.Tensor, numel: int) -> Metrics:
        """Metrics from the 6x6 Gram matrix of the component vectors.

        Args:
            gram: ``[6, 6]`` matrix ``G[i, j] = <c_i, c_j>`` with components in
                :data:`NORM_FIELDS` order.
            numel: Number of coordinates that moved.

        Returns:
            The norms ``sqrt(G[i, i])`` and the three inner products.
        """
        g = gram.detach().to("cpu", torch.float64)
        norms = {name: g[i, i].clamp_min(0.0).sqrt() for i, name in enumerate(NORM_FIELDS)}
        sg, loc, wd, nz = 0, 2, 3, 4
        return cls(
            **norms,
            dot_grad_prior=g[sg, loc] + g[sg, wd],
            dot_grad_noise=g[sg, nz],
            dot_prior_noise=g[loc, nz] + g[wd, nz],
            numel=int(numel),
        )

    @property
    def prior(self) -> torch.Tensor:
        """Norm of ``localization + weight_decay`` stacked: ``sqrt(|loc|^2 + |wd|^2)``."""
        return (self.localization.square() + self.weight_decay.square()).sqrt()

    def to(self, device: torch.device | str | int) -> Metrics:
        """A copy with every tensor on ``device``."""
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in (*NORM_FIELDS, *DOT_FIELDS):
            moved[name] = moved[name].to(device)
        return Metrics(**moved)

    def as_dict(self) -> dict[str, float]:
        """``{field: float}`` for logging and JSON (``numel`` included)."""
        out: dict[str, float] = {n: float(getattr(self, n)) for n in (*NORM_FIELDS, *DOT_FIELDS)}
        out["numel"] = float(self.numel)
        return out

    def cosine(self, a: str, b: str) -> float:
        """Cosine between two of ``scaled_grad``, ``prior``, ``noise`` (nan if a norm is 0).

        Example:
            >>> m = Metrics.from_gram(torch.eye(6, dtype=torch.float64), 6)
            >>> m.cosine("scaled_grad", "noise")
            0.0
        """
        names = {"scaled_grad": "grad", "prior": "prior", "noise": "noise"}
        if a not in names or b not in names or a == b:
            raise ValueError(
                f"`a`, `b` must be two different names out of {sorted(names)}, got {a!r}, "
                f"{b!r}; pick e.g. cosine('scaled_grad', 'noise')."
            )
        order = ["grad", "prior", "noise"]
        x, y = sorted((names[a], names[b]), key=order.index)
        dot = float(getattr(self, f"dot_{x}_{y}"))
        denom = float(getattr(self, a)) * float(getattr(self, b))
        return dot / denom if denom > 0 else math.nan
