"""Exact per-step norms and inner products of the SGMCMC update components."""

from __future__ import annotations

import math
from collections.abc import Iterable
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
    # devinterp 2.0's field: float32, shape [1], so `torch.cat` over fields works.
    return torch.zeros(1, dtype=torch.float32)


def _field(value: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A float64 scalar as a metrics field: ``[1]`` on the CPU (float32 by default)."""
    return value.detach().to("cpu", dtype).reshape(1)


def _sum_squares(t: torch.Tensor) -> torch.Tensor:
    # Summed in float64: a float32 sum of n squares loses ~n 2^-24 relative.
    return t.detach().double().square().sum()


@dataclass
class Metrics:
    """Norms and inner products of one SGMCMC step's update components.

    The step is ``w <- w - scaled_grad - localization - weight_decay + noise``
    (see :class:`~gradsketch.sampling.SGMCMC` for each component's formula).
    Norm fields hold Euclidean norms over every parameter of every group;
    dot fields hold ``<scaled_grad, prior>``, ``<scaled_grad, noise>`` and
    ``<prior, noise>`` with ``prior = localization + weight_decay``. A cosine
    is ``dot / (norm_a * norm_b)``. Field names, meaning, dtype and shape are
    devinterp 2.0's: float32 tensors of shape ``[1]`` (on the CPU from
    :meth:`~gradsketch.sampling.SGMCMC.get_metrics`), so ``torch.cat`` over
    fields works. The sampler accumulates them in float64 (one Gram matrix of
    the components) and rounds each value to float32 once, at the end; the
    accumulators below (devinterp's :meth:`add_sum_squared_`,
    :meth:`add_dot_products_`, :meth:`sqrt_norms_`, :meth:`zero_`,
    :meth:`aggregate`) sum each tensor in float64 too before adding it.

    Lifecycle of the accumulators (devinterp's): :meth:`zero_`, then per
    parameter :meth:`add_sum_squared_` and :meth:`add_dot_products_`, then
    :meth:`sqrt_norms_`; :meth:`aggregate` combines groups or ranks.

    Attributes:
        numel: number of coordinates that moved (the mask's selected count).

    Example:
        >>> gram = torch.eye(6, dtype=torch.float64) * 4.0
        >>> m = Metrics.from_gram(gram, numel=10)
        >>> float(m.noise), float(m.dot_grad_noise), m.numel
        (2.0, 0.0, 10)
        >>> m.noise.dtype, tuple(m.noise.shape)
        (torch.float32, (1,))
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
    def from_gram(
        cls, gram: torch.Tensor, numel: int, *, dtype: torch.dtype = torch.float32
    ) -> Metrics:
        """Metrics from the 6x6 Gram matrix of the component vectors.

        Args:
            gram: ``[6, 6]`` matrix ``G[i, j] = <c_i, c_j>`` with components in
                :data:`NORM_FIELDS` order.
            numel: Number of coordinates that moved.
            dtype: dtype of the ``[1]`` fields; float32 is devinterp's, float64
                keeps every digit of the Gram matrix.

        Returns:
            The norms ``sqrt(G[i, i])`` and the three inner products, computed
            in float64 and rounded once to ``dtype``.
        """
        g = gram.detach().to("cpu", torch.float64)
        norms = {
            name: _field(g[i, i].clamp_min(0.0).sqrt(), dtype) for i, name in enumerate(NORM_FIELDS)
        }
        sg, loc, wd, nz = 0, 2, 3, 4
        return cls(
            **norms,
            dot_grad_prior=_field(g[sg, loc] + g[sg, wd], dtype),
            dot_grad_noise=_field(g[sg, nz], dtype),
            dot_prior_noise=_field(g[loc, nz] + g[wd, nz], dtype),
            numel=int(numel),
        )

    def astype(self, dtype: torch.dtype) -> Metrics:
        """A copy with every field converted to ``dtype`` (``numel`` kept)."""
        return Metrics(
            **{n: getattr(self, n).detach().to(dtype).clone() for n in (*NORM_FIELDS, *DOT_FIELDS)},
            numel=self.numel,
        )

    # -- devinterp 2.0's accumulators ---------------------------------------------
    def zero_(self) -> None:
        """Set every field to zero in place, and ``numel`` to 0."""
        for name in (*NORM_FIELDS, *DOT_FIELDS):
            getattr(self, name).zero_()
        self.numel = 0

    def add_sum_squared_(
        self,
        scaled_grad: torch.Tensor,
        unscaled_grad: torch.Tensor,
        localization: torch.Tensor,
        weight_decay: torch.Tensor,
        noise: torch.Tensor,
        distance: torch.Tensor,
    ) -> None:
        """Add each component's sum of squares ``sum(c^2)`` to its norm field, in place.

        Each sum is taken in float64 and added once (any input dtype).
        Follow with :meth:`sqrt_norms_` once every parameter is in.

        Example:
            >>> m = Metrics()
            >>> z = torch.zeros(2)
            >>> m.add_sum_squared_(torch.tensor([3.0, 4.0]), z, z, z, z, z)
            >>> m.sqrt_norms_()
            >>> m.scaled_grad
            tensor([5.])
        """
        parts = (scaled_grad, unscaled_grad, localization, weight_decay, noise, distance)
        for name, part in zip(NORM_FIELDS, parts):
            acc = getattr(self, name)
            acc += _sum_squares(part).to(acc.device, acc.dtype)

    def add_dot_products_(
        self, scaled_grad: torch.Tensor, prior: torch.Tensor, noise: torch.Tensor
    ) -> None:
        """Add ``<scaled_grad, prior>``, ``<scaled_grad, noise>``, ``<prior, noise>`` in place.

        Args:
            scaled_grad: the preconditioned gradient component.
            prior: ``localization + weight_decay``.
            noise: the noise component.
        """
        sg, pr, nz = (t.detach().double() for t in (scaled_grad, prior, noise))
        for name, dot in zip(DOT_FIELDS, ((sg * pr).sum(), (sg * nz).sum(), (pr * nz).sum())):
            acc = getattr(self, name)
            acc += dot.to(acc.device, acc.dtype)

    def sqrt_norms_(self) -> None:
        """Turn the norm fields from sums of squares into norms (dot fields unchanged)."""
        for name in NORM_FIELDS:
            setattr(self, name, getattr(self, name).sqrt())

    @staticmethod
    def aggregate(group_metrics: Iterable[Metrics]) -> Metrics:
        """One CPU :class:`Metrics` for disjoint parameter sets (groups or ranks).

        Norms combine as ``|[a; b]| = sqrt(|a|^2 + |b|^2)``, dot products and
        ``numel`` add; the sums are taken in float64.

        Example:
            >>> a = Metrics.from_gram(torch.eye(6, dtype=torch.float64) * 9.0, numel=3)
            >>> b = Metrics.from_gram(torch.eye(6, dtype=torch.float64) * 16.0, numel=4)
            >>> m = Metrics.aggregate([a, b])
            >>> m.noise, m.numel
            (tensor([5.]), 7)
        """
        norms = {name: torch.zeros((), dtype=torch.float64) for name in NORM_FIELDS}
        dots = {name: torch.zeros((), dtype=torch.float64) for name in DOT_FIELDS}
        numel = 0
        for m in group_metrics:
            for name in NORM_FIELDS:
                norms[name] += getattr(m, name).detach().to("cpu", torch.float64).square().sum()
            for name in DOT_FIELDS:
                dots[name] += getattr(m, name).detach().to("cpu", torch.float64).sum()
            numel += int(m.numel)
        return Metrics(
            **{name: _field(value.sqrt()) for name, value in norms.items()},
            **{name: _field(value) for name, value in dots.items()},
            numel=numel,
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
