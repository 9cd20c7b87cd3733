"""Count sketch (feature hashing) and the per-step buffers samplers fill."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, TypedDict

import torch

from gradsketch._checks import integer, positive_int
from gradsketch._device import exact_device
from gradsketch.masked import MaskLike
from gradsketch.sketch import _backend
from gradsketch.sketch._fingerprint import Fingerprint
from gradsketch.sketch._ordered import scatter_components_
from gradsketch.sketch._tables import sparse_key
from gradsketch.sketch._validate import (
    check_device,
    check_float_tensor,
    check_range,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

#: The sampler update components that get one sketch each.
SKETCH_QUANTITIES: tuple[str, ...] = (
    "scaled_grad",
    "unscaled_grad",
    "localization",
    "weight_decay",
    "noise",
)

#: Coordinates hashed at a time when tables are computed on the fly.
DEFAULT_CHUNK = 1 << 18

#: Fewest columns per range when :func:`scatter_folded_` splits a scatter.
SPLIT_MIN_COLUMNS = 1 << 14


def split_parts(rows: int, n: int) -> int:
    """Column ranges :func:`scatter_folded_` uses for ``rows`` rows of ``n`` columns.

    One per torch thread while there are fewer than two rows per thread
    (measured on two threads, per million columns: 1, 2 and 3 rows gain
    0.2 ms each; 4, 6 and 8 rows lose 0.1-0.2 ms and 5 rows is even),
    unless the ranges would be shorter than :data:`SPLIT_MIN_COLUMNS`.

    Example:
        >>> split_parts(3, 100)
        1
    """
    threads = torch.get_num_threads()
    if rows >= 2 * threads:
        return 1
    return max(1, min(threads, n // SPLIT_MIN_COLUMNS))


def scatter_folded_(
    scratch: torch.Tensor, folded: torch.Tensor, block: torch.Tensor, parts: int | None = None
) -> None:
    """``scratch.index_add_(1, folded, block)``, balanced over torch's threads.

    On CPU the native kernel (chosen by :mod:`gradsketch.sketch._backend`) does it
    when available; ``parts`` given explicitly always takes torch's path below.
    torch parallelises this scatter over the rows of ``block``, each thread
    walking whole rows: one row runs on one thread, and three rows on two
    threads leave one thread with two of them. Viewing the columns as
    ``parts`` ranges (``[parts, rows, n // parts]``, no copy) gives every
    thread the same share, each range scattered into its own partial row;
    the partials are then summed. Measured on two threads, per million
    columns: one row 0.77 -> 0.57 ms (a 1-D ``index_add_`` takes 1.2 ms),
    three rows 1.4 -> 1.0-1.25 ms. Only the order of the float additions
    changes.

    Args:
        scratch: ``[rows, width]`` accumulator (added into).
        folded: int64 ``[n]`` column of every value (see :func:`accumulate_folded`).
        block: ``[rows, n]`` values, same dtype as ``scratch``.
        parts: column ranges of torch's path; default :func:`split_parts` on CPU, 1 elsewhere.

    Example:
        >>> out = torch.zeros(1, 2)
        >>> scatter_folded_(out, torch.tensor([0, 1, 1, 0]), torch.ones(1, 4), parts=2)
        >>> out
        tensor([[2., 2.]])
    """
    if parts is None and _backend.reduce_(scratch, folded, block):
        return
    rows, n = block.shape
    if parts is None:
        # GPU scatters are parallel over elements already.
        parts = split_parts(rows, n) if scratch.device.type == "cpu" else 1
    width = n // parts if parts > 1 else 0
    if width == 0:
        scratch.index_add_(1, folded, block)
        return
    head = parts * width
    partial = scratch.new_zeros(parts, rows, scratch.shape[1])
    ranges = block[:, :head].unflatten(1, (parts, width)).transpose(0, 1)
    index = folded[:head].view(parts, 1, width).expand(parts, rows, width)
    partial.scatter_add_(2, index, ranges)
    scratch += partial.sum(0)
    if head < n:
        scratch.index_add_(1, folded[head:], block[:, head:])


def accumulate_folded(
    out: torch.Tensor, block: torch.Tensor, folded: torch.Tensor, num_buckets: int, scale: float
) -> None:
    """``out += scale * S block`` for a count-sketch block given its folded table.

    ``folded[i] = bucket(i) + num_buckets * [sign(i) < 0]``: positive and
    negative contributions are summed into the two halves of a scratch row by
    one scatter (:func:`scatter_folded_`; no elementwise multiply, no copy of
    ``block`` unless its dtype differs), then subtracted.

    Args:
        out: ``[..., num_buckets]`` accumulator (float32 or float64).
        block: ``[..., n]`` values for ``n`` consecutive coordinates.
        folded: int64 ``[n]`` table from :func:`~gradsketch.sketch._backend.buckets_and_signs`.
        num_buckets: k.
        scale: factor applied to the contribution.
    """
    scratch = out.new_zeros(*out.shape[:-1], 2 * num_buckets)
    values = block.to(out.dtype)
    scatter_folded_(scratch.view(-1, 2 * num_buckets), folded, values.reshape(-1, values.shape[-1]))
    out.add_(scratch[..., :num_buckets] - scratch[..., num_buckets:], alpha=scale)


class SketchOptions(TypedDict, total=False):
    """The keyword options of :class:`CountSketch` and :meth:`CountSketch.create`.

    ``materialize`` keeps the int64 table (else hashed per call, same
    results), ``device`` is where it lives, ``chunk_size`` the coordinates
    hashed per step without a table, ``mask`` a
    :class:`gradsketch.masked.ParamMask` whose entries are the coordinates.
    """

    materialize: bool
    device: torch.device | str
    chunk_size: int
    mask: MaskLike | None


class CountSketch:
    """Single-row count sketch ``S: R^d -> R^k`` (feature hashing).

    ``S(v)[j] = sum_{i: h(i) = j} s(i) v[i]`` with bucket ``h(i)`` and sign
    ``s(i)`` taken from a counter-based hash of ``(seed, i)``. Normalisation:
    ``E<Sv, Sw> = <v, w>`` over seeds (Weinberger et al., ICML 2009;
    Charikar, Chen & Farach-Colton, ICALP 2002), with
    ``Var<Sv, Sw> = (<v,v><w,w> + <v,w>^2 - 2 sum_i v_i^2 w_i^2) / k``.

    API-compatible with devinterp 2.0's ``CountSketch`` (``create``,
    ``sketch``, ``scatter_into_``, ``to``, ``hash_indices``, ``hash_signs``),
    but the map depends only on the fingerprint, not on torch's generator,
    and the tables may be computed on the fly: ``materialize=False`` needs
    ``O(k + chunk)`` memory instead of 8 bytes per coordinate, with
    bit-identical results.

    NaN or inf in a coordinate propagates to that coordinate's bucket only.

    Example:
        >>> cs = CountSketch.create(input_dim=6, output_dim=3, seed=0)
        >>> v = torch.arange(6.0)
        >>> buf = torch.zeros(3)
        >>> cs.scatter_into_(buf, v[:4], offset=0)
        >>> cs.scatter_into_(buf, v[4:], offset=4)
        >>> torch.allclose(buf, cs.sketch(v))
        True
    """

    def __init__(
        self,
        input_dim: int,
        output_dim: int,
        seed: int = 0,
        *,
        materialize: bool = True,
        device: torch.device | str = "cpu",
        chunk_size: int = DEFAULT_CHUNK,
        mask: MaskLike | None = None,
    ) -> None:
        self._input_dim = positive_int("input_dim", input_dim)
        if mask is not None and mask.numel != self._input_dim:
            raise ValueError(
                f"`input_dim`={input_dim} but the mask selects {mask.numel} entries; with a "
                "mask, pass input_dim=mask.numel."
            )
        self.mask = mask
        self._output_dim = positive_int("output_dim", output_dim)
        self.seed = integer("seed", seed)
        self.chunk_size = positive_int("chunk_size", chunk_size)
        self.materialize = bool(materialize)
        self._device = torch.device(device)
        self._key = sparse_key(self.seed, 0, 0)
        self._table: torch.Tensor | None = None
        # The signs as assigned to `hash_signs` (devinterp's attribute), when they were.
        self._assigned_signs: torch.Tensor | None = None
        if self.materialize:
            self._table = self._folded(0, self._input_dim)

    @classmethod
    def create(
        cls, input_dim: int, output_dim: int, seed: int = 0, **options: Unpack[SketchOptions]
    ) -> CountSketch:
        """Build the sketch for ``input_dim`` coordinates into ``output_dim`` buckets.

        With ``mask`` (a :class:`gradsketch.masked.ParamMask`), only the
        selected entries are coordinates: ``input_dim`` must be ``mask.numel``
        and the fingerprint carries the mask's, so sketches made under
        different masks are refused as incompatible.
        """
        return cls(input_dim, output_dim, seed, **options)

    @property
    def input_dim(self) -> int:
        """d, the number of coordinates."""
        return self._input_dim

    @property
    def output_dim(self) -> int:
        """k, the number of buckets."""
        return self._output_dim

    @property
    def device(self) -> torch.device:
        """Device of the tables and of the tensors it accepts.

        Raises:
            RuntimeError: ``hash_signs`` was assigned a tensor on another device.
        """
        signs = self._assigned_signs
        if signs is not None and signs.device != exact_device(self._device):
            # devinterp's phrase first: its users' tests match it.
            raise RuntimeError(
                f"Inconsistent devices: hash_indices on {self._device}, hash_signs on "
                f"{signs.device}. Move the sketch with `.to(device)` instead of assigning "
                "`hash_signs` on another device."
            )
        return self._device

    @property
    def fingerprint(self) -> Fingerprint:
        """The map's identity; equal fingerprints mean equal sketches."""
        return Fingerprint(
            "count_sketch",
            self.seed,
            self._input_dim,
            self._output_dim,
            mask=None if self.mask is None else self.mask.fingerprint,
        )

    def _folded(self, offset: int, length: int) -> torch.Tensor:
        if self._table is not None:
            return self._table[offset : offset + length]
        return _backend.buckets_and_signs(self._key, offset, length, self._output_dim, self._device)

    def folded_table(self, offset: int, length: int) -> torch.Tensor:
        """Folded bucket/sign table of coordinates ``offset : offset + length``.

        ``table[i] = bucket + output_dim * [sign < 0]``: the index of
        coordinate ``offset + i`` in a ``2 * output_dim`` scratch row, as used
        by :func:`accumulate_folded`. Callers that sketch several vectors of
        the same coordinates at once (a ``[rows, n]`` block) use it to do all
        of them in one ``index_add_``.

        Returns:
            int64 ``[length]`` on :attr:`device`.
        """
        check_range(offset, length, self._input_dim)
        return self._folded(offset, length)

    @property
    def hash_indices(self) -> torch.Tensor:
        """Bucket of every coordinate, int64 ``[input_dim]`` (devinterp name)."""
        return self._folded(0, self._input_dim) % self._output_dim

    @property
    def hash_signs(self) -> torch.Tensor:
        """Sign of every coordinate, float32 ``[input_dim]`` (devinterp name)."""
        if self._assigned_signs is not None:
            return self._assigned_signs
        neg = self._folded(0, self._input_dim) >= self._output_dim
        return 1.0 - 2.0 * neg.float()

    @hash_signs.setter
    def hash_signs(self, signs: torch.Tensor) -> None:
        # devinterp's CountSketch is a dataclass whose tables can be reassigned (to move
        # them, say). Here the fingerprint fixes the map, so only the same signs are taken,
        # on any device; one other than the sketch's makes `device` raise, as in devinterp.
        if not isinstance(signs, torch.Tensor) or tuple(signs.shape) != (self._input_dim,):
            got = (
                f"a tensor of shape {tuple(signs.shape)}"
                if isinstance(signs, torch.Tensor)
                else repr(signs)
            )
            raise ValueError(
                f"`hash_signs` must be a tensor of shape ({self._input_dim},), got {got}; "
                "assign the sketch's own signs, e.g. `cs.hash_signs = cs.hash_signs.to(device)`."
            )
        if signs.device.type != "meta":
            own = self._folded(0, self._input_dim).cpu() >= self._output_dim
            if not torch.equal(signs.detach().cpu() < 0, own) or not bool(
                (signs.detach().cpu().abs() == 1).all()
            ):
                raise ValueError(
                    f"`hash_signs` differ from this sketch's signs, which its fingerprint (seed="
                    f"{self.seed}, input_dim={self._input_dim}) fixes; assign the same signs "
                    "(e.g. moved with `.to(device)`), or create a CountSketch with another seed "
                    "for another map."
                )
        self._assigned_signs = signs

    def to(self, device: torch.device | str | int) -> CountSketch:
        """The same map on another device (tables moved, never regenerated)."""
        target = exact_device(device)
        if target == exact_device(self._device):
            return self
        moved = CountSketch.__new__(CountSketch)
        moved.__dict__.update(self.__dict__)
        moved._device = target
        moved._table = None if self._table is None else self._table.to(target)
        moved._assigned_signs = None
        return moved

    def sketch(self, v: torch.Tensor) -> torch.Tensor:
        """Sketch a whole vector (any shape, flattened): float32 ``[output_dim]``."""
        result = torch.zeros(self._output_dim, dtype=torch.float32, device=self._device)
        self.scatter_into_(result, v, 0)
        return result

    def sketch_named(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Sketch the mask's selected entries of named tensors (e.g. a model's gradients).

        Equals ``sketch(mask.select(tensors))``: float32 ``[output_dim]``.

        Raises:
            ValueError: if the sketch was created without a ``mask``.
        """
        if self.mask is None:
            raise ValueError(
                "`sketch_named` needs a CountSketch created with `mask=ParamMask(...)`; for "
                "unmasked vectors use `sketch(torch.cat([t.reshape(-1) for t in tensors]))`."
            )
        return self.sketch(self.mask.select(tensors))

    def scatter_into_(self, result: torch.Tensor, v: torch.Tensor, offset: int) -> None:
        """Accumulate ``v`` (flattened) as coordinates ``offset, offset+1, ...`` into ``result``.

        Linearity makes ``sketch(cat(p1, p2))`` equal to scattering ``p1`` at
        offset 0 and ``p2`` at ``len(p1)``: this is how a model is sketched
        one parameter at a time. As devinterp does it, each value times its
        sign is added into its bucket in order (on the CPU, bit-equal to its
        ``result.scatter_add_(0, idx, signs * v)``).

        Args:
            result: float32 or float64 ``[output_dim]`` buffer, modified in place.
            v: values of any floating dtype and shape (flattened, detached).
            offset: index of ``v``'s first coordinate.
        """
        check_float_tensor("v", v)
        check_float_tensor("result", result)
        if result.shape != (self._output_dim,):
            raise ValueError(
                f"`result` must have shape ({self._output_dim},) to hold this sketch, got "
                f"{tuple(result.shape)}; allocate it with SketchBuffer.create(output_dim) or "
                "torch.zeros(output_dim)."
            )
        check_device("v", v, self.device)
        check_device("result", result, self.device)
        flat = v.detach().reshape(-1)
        check_range(offset, flat.numel(), self._input_dim)
        if _backend.default_backend(result, kernel="hashed") == "triton":
            _backend.triton().triton_count_sketch(
                flat.unsqueeze(0), self._key, offset, self._output_dim, 1.0, result.unsqueeze(0)
            )
            return
        # With tables there is nothing to bound: one pass. On the fly, hash a
        # chunk at a time so memory stays O(k + chunk).
        step = self.chunk_size if self._table is None else max(flat.numel(), 1)
        for start in range(0, flat.numel(), step):
            part = flat[start : start + step]
            folded = self._folded(offset + start, part.numel())
            # devinterp's order: each value times its sign, added into its bucket in
            # order (its tests compare a sampler's sketch with this at atol=0).
            if result.dtype == torch.float32:
                scatter_components_(
                    result.unsqueeze(0), folded, part.unsqueeze(0), [(0, 0, 1.0, 1.0)]
                )
            else:
                neg = folded >= self._output_dim
                values = part.to(result.dtype)
                result.scatter_add_(
                    0, folded - self._output_dim * neg.long(), torch.where(neg, -values, values)
                )

    def __repr__(self) -> str:
        mode = "tables" if self._table is not None else "on the fly"
        return (
            f"CountSketch(input_dim={self._input_dim}, output_dim={self._output_dim}, "
            f"seed={self.seed}, {mode}, device={self._device})"
        )


@dataclass
class SketchBuffer:
    """One float32 ``[output_dim]`` count-sketch buffer per update component.

    Lifecycle in a sampler step: :meth:`zero_` at the start, accumulate each
    parameter's contribution with :meth:`CountSketch.scatter_into_`, then read.

    Example:
        >>> buf = SketchBuffer.create(8)
        >>> buf.noise.shape
        torch.Size([8])
        >>> SketchBuffer.QUANTITIES[0]
        'scaled_grad'
    """

    QUANTITIES: ClassVar[tuple[str, ...]] = SKETCH_QUANTITIES

    scaled_grad: torch.Tensor
    unscaled_grad: torch.Tensor
    localization: torch.Tensor
    weight_decay: torch.Tensor
    noise: torch.Tensor
    fingerprint: Fingerprint | None = field(default=None, compare=False)

    @classmethod
    def create(
        cls,
        output_dim: int,
        device: torch.device | str = "cpu",
        fingerprint: Fingerprint | None = None,
    ) -> SketchBuffer:
        """Zeroed buffers of size ``output_dim`` on ``device``."""
        positive_int("output_dim", output_dim)
        zeros = {
            q: torch.zeros(output_dim, dtype=torch.float32, device=device) for q in cls.QUANTITIES
        }
        return cls(**zeros, fingerprint=fingerprint)

    @property
    def device(self) -> torch.device:
        """The buffers' common device (an error if they disagree)."""
        devices = {q: getattr(self, q).device for q in self.QUANTITIES}
        if len(set(devices.values())) != 1:
            # devinterp's phrase first: its users' tests match it.
            raise RuntimeError(
                f"Inconsistent devices across buffers: {devices}. SketchBuffer buffers are on "
                "different devices; move them with `.to(device)`."
            )
        return next(iter(devices.values()))

    def zero_(self) -> None:
        """Zero every buffer in place."""
        for q in self.QUANTITIES:
            getattr(self, q).zero_()

    def to(self, device: torch.device | str | int) -> SketchBuffer:
        """Copy to ``device`` (returns ``self`` if already there)."""
        if self.device == exact_device(device):
            return self
        moved = {q: getattr(self, q).to(device) for q in self.QUANTITIES}
        return SketchBuffer(**moved, fingerprint=self.fingerprint)

    def clone(self) -> SketchBuffer:
        """An independent copy."""
        copied = {q: getattr(self, q).clone() for q in self.QUANTITIES}
        return SketchBuffer(**copied, fingerprint=self.fingerprint)

    def as_dict(self) -> dict[str, torch.Tensor]:
        """``{quantity: tensor}`` in :data:`SKETCH_QUANTITIES` order."""
        return {q: getattr(self, q) for q in self.QUANTITIES}
