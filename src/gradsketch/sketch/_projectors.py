"""TRAK-compatible projectors built on the counter-based hash.

Every projector here is a linear map ``P: R^grad_dim -> R^proj_dim`` whose
entries are a pure function of its :class:`Fingerprint`. All share TRAK's
normalisation (unit-variance entries), so any of them can be swapped into a
TRAKer::

    E<Px, Py> = proj_dim * <x, y>

Subclasses implement one method, :meth:`AbstractProjector._accumulate`
(``out += P[:, offset:offset+n] block``); ``project`` and ``project_into_``
are derived from it, so streaming by coordinates holds by construction.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import TYPE_CHECKING, Any, TypedDict

import torch
from torch import Tensor

from gradsketch._checks import integer, positive_int
from gradsketch.masked import MaskLike
from gradsketch.sketch._backend import buckets_and_signs, default_backend, triton
from gradsketch.sketch._countsketch import DEFAULT_CHUNK, scatter_folded_
from gradsketch.sketch._fingerprint import Fingerprint
from gradsketch.sketch._tables import dense_block, dense_key, sparse_key
from gradsketch.sketch._validate import (
    batch_blocks,
    check_block,
    check_device,
    check_float_tensor,
    check_range,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

#: Entries of a dense tile generated at once (8 MiB of float32).
_TILE_ENTRIES = 1 << 21
#: Values densified at once by the generic sparse path (64 MiB of float32).
_SPARSE_SPAN_ENTRIES = 1 << 24


class ProjectionType(str, Enum):
    """Entry distribution of dense JL projectors (TRAK's names)."""

    normal = "normal"
    rademacher = "rademacher"


def parse_proj_type(value: object) -> ProjectionType:
    """Accept a :class:`ProjectionType` or its string value."""
    try:
        return ProjectionType(value)
    except ValueError:
        allowed = ", ".join(repr(p.value) for p in ProjectionType)
        raise ValueError(
            f"`proj_type` must be one of {allowed}, got {value!r}; pass e.g. "
            "proj_type=ProjectionType.rademacher."
        ) from None


class AbstractProjector(ABC):
    """A seeded linear map applied to batches of gradients.

    Args:
        grad_dim: number of gradient coordinates d.
        proj_dim: sketch size k.
        seed: the map's seed.
        proj_type: entry distribution, for the dense kinds.
        device: where the map's tables live and where inputs must be.
        model_id: checkpoint id; a different ``model_id`` gives an
            independent map (TRAK re-seeds per checkpoint).
        mask: optional :class:`gradsketch.masked.ParamMask`; then dict input
            is restricted to the selected entries first and ``grad_dim`` must
            equal ``mask.numel``.

    Inputs to :meth:`project` are ``[batch, grad_dim]`` tensors or mappings of
    per-parameter ``[batch, ...]`` tensors, flattened and concatenated in the
    mapping's order (never materialised: each entry is streamed at its
    offset). float16, bfloat16, float32 and float64 are accepted; outputs are
    float64 when the input (or the projector's ``dtype``) is float64, float32
    otherwise.
    """

    kind: str = "abstract"
    dtype: torch.dtype = torch.float32

    def __init__(
        self,
        grad_dim: int,
        proj_dim: int,
        seed: int,
        proj_type: ProjectionType | str | None,
        device: torch.device | str,
        *,
        model_id: int = 0,
        mask: MaskLike | None = None,
    ) -> None:
        self.grad_dim = positive_int("grad_dim", grad_dim)
        self.proj_dim = positive_int("proj_dim", proj_dim)
        self.seed = integer("seed", seed)
        self.proj_type = proj_type
        self.device = torch.device(device)
        self.model_id = integer("model_id", model_id)
        self.mask = mask
        if mask is not None and mask.numel != self.grad_dim:
            raise ValueError(
                f"`grad_dim`={grad_dim} but the mask selects {mask.numel} entries; with a "
                "mask, pass grad_dim=mask.numel."
            )

    # -- the one method subclasses write ---------------------------------
    @abstractmethod
    def _accumulate(self, out: Tensor, block: Tensor, offset: int) -> None:
        """``out += P[:, offset:offset + n] @ block`` for a ``[batch, n]`` block."""

    def _on_model_change(self) -> None:  # noqa: B027 - optional hook
        """Drop whatever depends on ``model_id`` (tables, matrices)."""

    # -- derived -----------------------------------------------------------
    @property
    def fingerprint(self) -> Fingerprint:
        """The map's identity (kind, seed, dims, proj_type, model_id, nnz, mask)."""
        return Fingerprint(
            kind=self.kind,
            seed=self.seed,
            input_dim=self.grad_dim,
            output_dim=self.proj_dim,
            proj_type=self._proj_type_value(),
            model_id=self.model_id,
            nnz=getattr(self, "nnz", None),
            mask=None if self.mask is None else self.mask.fingerprint,
        )

    def _proj_type_value(self) -> str | None:
        return None

    def set_model_id(self, model_id: int | None) -> None:
        """Switch to the map of checkpoint ``model_id`` (no-op if unchanged or None)."""
        if model_id is None or model_id == self.model_id:
            return
        self.model_id = integer("model_id", model_id)
        self._on_model_change()

    def _out_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float64 if torch.float64 in (dtype, self.dtype) else torch.float32

    def project(self, grads: Tensor | Mapping[str, Tensor], model_id: int | None = None) -> Tensor:
        """Project a batch of gradients.

        Args:
            grads: ``[batch, grad_dim]`` tensor, or a mapping of per-parameter
                ``[batch, ...]`` tensors (concatenated in order, after the
                mask's selection when the projector has one).
            model_id: checkpoint id; ``None`` keeps the current one.

        Returns:
            ``[batch, proj_dim]`` projections.
        """
        if self.mask is not None and isinstance(grads, Mapping):
            grads = self.mask.select_batched(grads)
        total, blocks = batch_blocks(grads)
        if total != self.grad_dim:
            raise ValueError(
                f"`grads` has {total} coordinates per example but the projector was built "
                f"with grad_dim={self.grad_dim}; build it with grad_dim={total} or pass the "
                "matching parameters."
            )
        for b in blocks:
            check_device("grads", b, self.device)
        self.set_model_id(model_id)
        out = torch.zeros(
            blocks[0].shape[0],
            self.proj_dim,
            dtype=self._out_dtype(blocks[0].dtype),
            device=self.device,
        )
        self._accumulate_blocks(out, blocks)
        return out

    def _accumulate_blocks(self, out: Tensor, blocks: Sequence[Tensor]) -> None:
        """Accumulate consecutive blocks (a flattened mapping) starting at coordinate 0."""
        offset = 0
        for b in blocks:
            self._accumulate(out, b, offset)
            offset += b.shape[1]

    def project_into_(
        self, out: Tensor, block: Tensor, offset: int, *, model_id: int | None = None
    ) -> Tensor:
        """Accumulate coordinates ``offset:offset + block.shape[1]`` into ``out``.

        Streaming by coordinates: projecting a concatenation equals
        accumulating its parts at their offsets, on one process or several.

        Args:
            out: float32/float64 ``[batch, proj_dim]`` accumulator.
            block: ``[batch, n]`` gradient coordinates.
            offset: index of the block's first coordinate.
            model_id: checkpoint id; ``None`` keeps the current one.

        Returns:
            ``out``, for chaining.
        """
        check_block(block)
        check_float_tensor("out", out)
        if out.shape != (block.shape[0], self.proj_dim):
            raise ValueError(
                f"`out` must have shape ({block.shape[0]}, {self.proj_dim}) for this block, got "
                f"{tuple(out.shape)}."
            )
        check_range(offset, block.shape[1], self.grad_dim)
        check_device("block", block, self.device)
        check_device("out", out, self.device)
        self.set_model_id(model_id)
        self._accumulate(out, block, offset)
        return out

    @property
    def streams_by_coordinates(self) -> bool:
        """Whether projecting a mapping equals accumulating its entries at their offsets.

        True unless a mask first selects entries of each parameter (then
        coordinates are those of the selection, not of the parameters).
        Gradient computers that make per-example gradients one layer at a time
        then call :meth:`project_into_` and :meth:`project_sparse_into_` at each
        parameter's offset into :meth:`new_output`, and never hold the
        ``[batch, grad_dim]`` gradient.
        """
        return self.mask is None

    def new_output(self, batch_size: int, dtype: torch.dtype) -> Tensor:
        """The zero ``[batch_size, proj_dim]`` accumulator :meth:`project` starts from.

        ``dtype`` is the gradients' dtype; the accumulator is float64 when it
        (or the projector's own dtype) is, float32 otherwise.
        """
        return torch.zeros(
            batch_size, self.proj_dim, dtype=self._out_dtype(dtype), device=self.device
        )

    def project_sparse_into_(
        self, out: Tensor, coords: Tensor, values: Tensor, *, model_id: int | None = None
    ) -> Tensor:
        """``out[b] += sum_j P[:, coords[b, j]] * values[b, j]``: a sparse gradient per example.

        Repeated coordinates add up, so this equals :meth:`project` of the
        dense ``[batch, grad_dim]`` gradient with ``values`` scatter-added at
        ``coords`` (an Embedding's per-example gradient: a few rows of a
        ``[vocab, width]`` weight), without forming it.

        Args:
            out: float32/float64 ``[batch, proj_dim]`` accumulator.
            coords: int64 ``[batch, n]`` coordinates in ``[0, grad_dim)``.
            values: ``[batch, n]`` values.
            model_id: checkpoint id; ``None`` keeps the current one.

        Returns:
            ``out``, for chaining.
        """
        check_float_tensor("out", out)
        check_float_tensor("values", values)
        if coords.dtype != torch.int64 or coords.dim() != 2 or coords.shape != values.shape:
            raise ValueError(
                f"`coords` must be int64 [batch, n] with the shape of `values` "
                f"{tuple(values.shape)}, got {coords.dtype} {tuple(coords.shape)}; pass "
                "coords.long() of the same shape."
            )
        if out.shape != (coords.shape[0], self.proj_dim):
            raise ValueError(
                f"`out` must have shape ({coords.shape[0]}, {self.proj_dim}), got "
                f"{tuple(out.shape)}."
            )
        for name, t in (("coords", coords), ("values", values), ("out", out)):
            check_device(name, t, self.device)
        if coords.numel() == 0:
            return out
        low, high = int(coords.min()), int(coords.max())
        if low < 0 or high >= self.grad_dim:
            raise ValueError(
                f"`coords` run from {low} to {high}, outside [0, grad_dim={self.grad_dim}); "
                "pass coordinates of this projector's input."
            )
        self.set_model_id(model_id)
        self._accumulate_sparse(out, coords, values, low, high + 1)
        return out

    def _accumulate_sparse(
        self, out: Tensor, coords: Tensor, values: Tensor, low: int, high: int
    ) -> None:
        """Densify the coordinates ``[low, high)`` a span at a time and :meth:`_accumulate` it.

        Memory stays at one span of :data:`_SPARSE_SPAN_ENTRIES` values, and
        spans no coordinate falls in are skipped.
        """
        batch = coords.shape[0]
        step = max(1, _SPARSE_SPAN_ENTRIES // max(1, batch))
        values = values.to(out.dtype)
        zero = values.new_zeros(())
        for start in range(low, high, step):
            stop = min(high, start + step)
            inside = (coords >= start) & (coords < stop)
            if not bool(inside.any()):
                continue
            block = values.new_zeros(batch, stop - start)
            where = torch.where(inside, coords - start, 0)
            block.scatter_add_(1, where, torch.where(inside, values, zero))
            self._accumulate(out, block, start)

    def free_memory(self) -> None:  # noqa: B027 - optional hook
        """Release cached tables or matrices (they are rebuilt on demand)."""

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(grad_dim={self.grad_dim}, proj_dim={self.proj_dim}, "
            f"seed={self.seed}, model_id={self.model_id}, device={self.device})"
        )


class NoOpProjector(AbstractProjector):
    """Identity: ``project(grads) = grads`` (concatenated if a mapping).

    Its normalisation is the identity, ``<Px, Py> = <x, y>``, not TRAK's
    ``proj_dim`` factor; use it for exact (unprojected) TRAK on small models.

    Example:
        >>> NoOpProjector(grad_dim=3, device="cpu").project(torch.ones(2, 3), 0).shape
        torch.Size([2, 3])
    """

    kind = "noop"

    def __init__(
        self,
        grad_dim: int = 0,
        proj_dim: int = 0,
        seed: int = 0,
        proj_type: ProjectionType | str | None = "na",
        device: torch.device | str = "cpu",
        *args: Any,
        **kwargs: Any,
    ) -> None:
        # TRAK allows grad_dim=0 ("unknown"): then any width passes through.
        self._any_width = grad_dim == 0
        dim = max(int(grad_dim), 1)
        super().__init__(dim, dim, seed, proj_type, device, **_projector_kwargs(kwargs))

    def project(self, grads: Tensor | Mapping[str, Tensor], model_id: int | None = None) -> Tensor:
        """Return the gradients (flattened and concatenated), float32/float64."""
        if self._any_width:
            total, _ = batch_blocks(grads)
            self.grad_dim = self.proj_dim = total
        return super().project(grads, model_id)

    @property
    def streams_by_coordinates(self) -> bool:
        """False while the width is unknown (``grad_dim=0``: set by the first projection)."""
        return not self._any_width and super().streams_by_coordinates

    def _accumulate(self, out: Tensor, block: Tensor, offset: int) -> None:
        out[:, offset : offset + block.shape[1]] += block.to(out.dtype)


# torch's CPU index_add_ along dim 1 walks each row over the whole index; with
# many rows the int64 index (8 bytes per coordinate) is re-read from memory
# once per row. Tiles of this many columns keep the index slice in L2 across
# the rows: 32 rows of 2^20 take 17.7 ms instead of 19.9 ms. With few rows
# the per-call overhead outweighs it.
_TILE_COLUMNS = 1 << 14
_TILE_MIN_ROWS = 16


class SparseOptions(TypedDict, total=False):
    """The keyword options of :class:`SparseProjector` and :class:`CountSketchProjector`.

    ``model_id``, ``materialize``, ``mask`` and ``chunk_size``, as
    :class:`SparseProjector` documents them.
    """

    model_id: int
    materialize: bool
    mask: MaskLike | None
    chunk_size: int


class SparseProjector(AbstractProjector):
    """Sparse JL: every input coordinate has ``nnz`` entries ``±sqrt(proj_dim / nnz)``.

    Row ``r`` of coordinate ``i`` picks a bucket and a sign from a hash of
    ``(seed, model_id, r, i)``; rows are independent, so two rows may share a
    bucket (their signs are independent, which keeps the map unbiased):
    ``E<Px, Py> = proj_dim * <x, y>``. Cost: ``nnz`` passes over the input,
    no dense matrix. ``nnz=1`` is the count sketch (Kane & Nelson, 2014, for
    the sparse JL construction).

    Args:
        grad_dim: d.
        proj_dim: k.
        seed: the map's seed.
        nnz: non-zeros per input coordinate (1 <= nnz <= proj_dim).
        device: where tables live.
        model_id: checkpoint id.
        materialize: keep int64 tables (8 * nnz bytes per coordinate) or hash
            each call in chunks (``O(k + chunk)`` memory); identical outputs.
        mask: optional ParamMask restricting dict inputs.

    Example:
        >>> p = SparseProjector(grad_dim=100, proj_dim=16, seed=0, nnz=4, device="cpu")
        >>> p.project(torch.randn(3, 100), model_id=0).shape
        torch.Size([3, 16])
    """

    kind = "sparse"

    def __init__(
        self,
        grad_dim: int,
        proj_dim: int,
        seed: int,
        nnz: int,
        device: torch.device | str,
        *,
        model_id: int = 0,
        materialize: bool = True,
        mask: MaskLike | None = None,
        chunk_size: int = DEFAULT_CHUNK,
    ) -> None:
        super().__init__(grad_dim, proj_dim, seed, None, device, model_id=model_id, mask=mask)
        self.nnz = positive_int("nnz", nnz)
        if self.nnz > self.proj_dim:
            raise ValueError(
                f"`nnz`={nnz} exceeds proj_dim={proj_dim}; use nnz <= proj_dim (1 to 8 is typical)."
            )
        self.materialize = bool(materialize)
        self.chunk_size = positive_int("chunk_size", chunk_size)
        self.scale = math.sqrt(self.proj_dim / self.nnz)
        self._tables: list[Tensor] | None = None

    def _on_model_change(self) -> None:
        self._tables = None

    def free_memory(self) -> None:
        """Drop the hash tables (recomputed on the next call)."""
        self._tables = None

    def _table(self, row: int, offset: int, length: int) -> Tensor:
        key = sparse_key(self.seed, self.model_id, row)
        if not self.materialize:
            return buckets_and_signs(key, offset, length, self.proj_dim, self.device)
        if self._tables is None:
            self._tables = [
                buckets_and_signs(
                    sparse_key(self.seed, self.model_id, r),
                    0,
                    self.grad_dim,
                    self.proj_dim,
                    self.device,
                )
                for r in range(self.nnz)
            ]
        return self._tables[row][offset : offset + length]

    def _accumulate(self, out: Tensor, block: Tensor, offset: int) -> None:
        self._accumulate_blocks(out, [block], offset)

    def _accumulate_blocks(self, out: Tensor, blocks: Sequence[Tensor], offset: int = 0) -> None:
        # Both paths sum every block and non-zero row unscaled into one scratch
        # and scale once, so CPU and GPU agree bit for bit whenever the sums
        # are exact, and a mapping of many parameters costs one final pass.
        k = self.proj_dim
        kernels = triton() if default_backend(out, kernel="hashed") == "triton" else None
        if kernels is not None:
            # Hashing in registers beats reading int64 tables: same map, one pass.
            signed = torch.zeros_like(out)
            for block in blocks:
                for row in range(self.nnz):
                    key = sparse_key(self.seed, self.model_id, row)
                    kernels.triton_count_sketch(block, key, offset, k, 1.0, signed)
                offset += block.shape[1]
            out.add_(signed, alpha=self.scale)
            return
        scratch = out.new_zeros(out.shape[0], 2 * k)
        for block in blocks:
            n = block.shape[1]
            if not self.materialize:
                step = self.chunk_size
            elif (
                out.shape[0] >= _TILE_MIN_ROWS
                and default_backend(out.device, kernel="scatter") != "native"
            ):
                step = _TILE_COLUMNS
            else:
                step = max(n, 1)
            for start in range(0, n, step):
                part = block[:, start : start + step].to(out.dtype)
                for row in range(self.nnz):
                    scatter_folded_(scratch, self._table(row, offset + start, part.shape[1]), part)
            offset += n
        out.add_(scratch[:, :k] - scratch[:, k:], alpha=self.scale)

    def _accumulate_sparse(
        self, out: Tensor, coords: Tensor, values: Tensor, low: int, high: int
    ) -> None:
        if not self.materialize:
            # Tables hashed per call come in coordinate ranges: densify by span.
            super()._accumulate_sparse(out, coords, values, low, high)
            return
        k = self.proj_dim
        scratch = out.new_zeros(out.shape[0], 2 * k)
        values = values.to(out.dtype)
        for row in range(self.nnz):
            folded = self._table(row, low, high - low)[coords - low]
            scratch.scatter_add_(1, folded, values)
        out.add_(scratch[:, :k] - scratch[:, k:], alpha=self.scale)


class CountSketchProjector(SparseProjector):
    """Count sketch with TRAK's normalisation: entries ``±sqrt(proj_dim)``.

    The fastest accurate projector on CPU: one ``index_add_`` pass over the
    gradients. Same map as ``SparseProjector(nnz=1)`` and as
    ``sqrt(proj_dim) * CountSketch`` (at ``model_id=0``).
    ``E<Px, Py> = proj_dim * <x, y>``. Takes :class:`SparseProjector`'s
    arguments but ``nnz`` (:class:`SparseOptions`).

    Example:
        >>> p = CountSketchProjector(grad_dim=1000, proj_dim=64, seed=0, device="cpu")
        >>> p.project(torch.randn(4, 1000), model_id=0).shape
        torch.Size([4, 64])
    """

    def __init__(
        self,
        grad_dim: int,
        proj_dim: int,
        seed: int,
        device: torch.device | str,
        **options: Unpack[SparseOptions],
    ) -> None:
        super().__init__(grad_dim, proj_dim, seed, 1, device, **options)


class _DenseProjector(AbstractProjector):
    """Shared state of the dense JL projectors (normal or Rademacher entries)."""

    kind = "dense"

    def __init__(
        self,
        grad_dim: int,
        proj_dim: int,
        seed: int,
        proj_type: ProjectionType | str,
        device: torch.device | str,
        dtype: torch.dtype,
        model_id: int,
        mask: MaskLike | None,
    ) -> None:
        parsed = parse_proj_type(proj_type)
        super().__init__(grad_dim, proj_dim, seed, parsed, device, model_id=model_id, mask=mask)
        if dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise TypeError(f"`dtype` must be a floating torch dtype, got {dtype!r}.")
        # Generation and accumulation never go below float32.
        self.dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self.requested_dtype = dtype

    def _proj_type_value(self) -> str:
        return parse_proj_type(self.proj_type).value

    def _tile(
        self, offset: int, length: int, col_start: int, col_stop: int, dtype: torch.dtype
    ) -> Tensor:
        return dense_block(
            dense_key(self.seed, self.model_id),
            offset,
            length,
            col_start,
            col_stop,
            self._proj_type_value(),
            dtype,
            self.device,
        )


class BasicSingleBlockProjector(_DenseProjector):
    """Dense JL with the whole ``[grad_dim, proj_dim]`` matrix held in memory.

    Fast per call once built, but needs ``4 * grad_dim * proj_dim`` bytes:
    for tests and small models. Same map as :class:`BasicProjector`.

    Example:
        >>> p = BasicSingleBlockProjector(50, 8, 0, "rademacher", "cpu")
        >>> p.project(torch.randn(2, 50), 0).shape
        torch.Size([2, 8])
    """

    def __init__(
        self,
        grad_dim: int,
        proj_dim: int,
        seed: int,
        proj_type: ProjectionType | str,
        device: torch.device | str,
        dtype: torch.dtype = torch.float32,
        model_id: int = 0,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            grad_dim, proj_dim, seed, proj_type, device, dtype, model_id, kwargs.get("mask")
        )
        self.proj_matrix: Tensor | None = None
        self.generate_sketch_matrix()

    def generate_sketch_matrix(self) -> Tensor:
        """Build (or return the cached) ``[grad_dim, proj_dim]`` matrix."""
        if self.proj_matrix is None:
            rows = max(1, _TILE_ENTRIES // self.proj_dim)
            tiles = [
                self._tile(start, min(rows, self.grad_dim - start), 0, self.proj_dim, self.dtype)
                for start in range(0, self.grad_dim, rows)
            ]
            self.proj_matrix = torch.cat(tiles)
        return self.proj_matrix

    def _on_model_change(self) -> None:
        self.proj_matrix = None

    def free_memory(self) -> None:
        """Drop the matrix (rebuilt on the next call)."""
        self.proj_matrix = None

    def _accumulate(self, out: Tensor, block: Tensor, offset: int) -> None:
        matrix = self.generate_sketch_matrix()[offset : offset + block.shape[1]]
        out += block.to(out.dtype) @ matrix.to(out.dtype)


class BasicProjector(_DenseProjector):
    """Dense JL generated tile by tile, never holding the whole matrix.

    Entries are i.i.d. N(0, 1) (``normal``) or ±1 (``rademacher``) from the
    counter-based hash, so ``block_size`` (output columns generated at once)
    changes speed and memory, never the map (TRAK's does: its blocks are
    re-seeded per block index). ``E<Px, Py> = proj_dim * <x, y>``.

    Cost: regenerates ``grad_dim * proj_dim`` entries per call; on CPU prefer
    :class:`CountSketchProjector` or :class:`SparseProjector`.

    Example:
        >>> a = BasicProjector(30, 8, 0, "normal", "cpu", block_size=3)
        >>> b = BasicProjector(30, 8, 0, "normal", "cpu", block_size=100)
        >>> g = torch.randn(2, 30)
        >>> torch.allclose(a.project(g, 0), b.project(g, 0), atol=1e-5)
        True
    """

    def __init__(
        self,
        grad_dim: int,
        proj_dim: int,
        seed: int,
        proj_type: ProjectionType | str,
        device: torch.device | str,
        block_size: int = 100,
        dtype: torch.dtype = torch.float32,
        model_id: int = 0,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            grad_dim, proj_dim, seed, proj_type, device, dtype, model_id, kwargs.get("mask")
        )
        self.block_size = min(self.proj_dim, positive_int("block_size", block_size))

    def _accumulate(self, out: Tensor, block: Tensor, offset: int) -> None:
        kernels = triton() if default_backend(out, kernel="dense") == "triton" else None
        if kernels is not None:
            # The matrix is generated in registers (float32, the precision of
            # this path); float64 outputs keep the float64 torch path.
            key = dense_key(self.seed, self.model_id)
            kernels.triton_dense_project(
                block, key, offset, self.proj_dim, self._proj_type_value(), out
            )
            return
        n = block.shape[1]
        rows = max(1, _TILE_ENTRIES // self.block_size)
        for start in range(0, n, rows):
            # Accumulate in the output's precision: float64 input stays float64.
            part = block[:, start : start + rows].to(out.dtype)
            for col in range(0, self.proj_dim, self.block_size):
                stop = min(col + self.block_size, self.proj_dim)
                tile = self._tile(offset + start, part.shape[1], col, stop, out.dtype)
                out[:, col:stop] += part @ tile


class CudaProjector(BasicProjector):
    """Dense JL on a CUDA device (TRAK's name); same map as :class:`BasicProjector`.

    Backed by the Triton kernel of :mod:`gradsketch.sketch._triton` when
    ``triton`` is installed (the ``gpu`` extra): the matrix is generated in
    registers, never stored. Without triton it runs the torch tile path.
    ``max_batch_size`` bounds the rows sent to one launch, as in TRAK.

    Raises:
        ValueError: on a non-CUDA device, naming the CPU projectors to use.
    """

    def __init__(
        self,
        grad_dim: int,
        proj_dim: int,
        seed: int,
        proj_type: ProjectionType | str,
        device: torch.device | str,
        max_batch_size: int,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        dev = torch.device(device)
        if dev.type != "cuda":
            raise ValueError(
                f"CudaProjector needs a CUDA device, got device={str(device)!r}. On CPU use "
                "CountSketchProjector (fastest) or BasicProjector (the same dense map as "
                "CudaProjector)."
            )
        self.max_batch_size = positive_int("max_batch_size", max_batch_size)
        super().__init__(grad_dim, proj_dim, seed, proj_type, dev, *args, **kwargs)

    def _accumulate(self, out: Tensor, block: Tensor, offset: int) -> None:
        for start in range(0, block.shape[0], self.max_batch_size):
            stop = start + self.max_batch_size
            super()._accumulate(out[start:stop], block[start:stop], offset)


class ChunkedCudaProjector:
    """TRAK's chunked projector: one projector per chunk of parameters, summed.

    Parameters are taken in order and packed into chunks of at most
    ``max_chunk_size`` coordinates; chunk ``i`` goes through
    ``projector_per_chunk[i]`` (whose ``grad_dim`` is ``params_per_chunk[i]``)
    and the projections are added. gradsketch projectors stream by
    coordinates already, so a single projector over all parameters is the
    simpler choice; this class keeps TRAK scripts running.
    """

    def __init__(
        self,
        projector_per_chunk: Sequence[AbstractProjector],
        max_chunk_size: int,
        params_per_chunk: Sequence[int],
        feat_bs: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
        if not projector_per_chunk or len(projector_per_chunk) != len(params_per_chunk):
            raise ValueError(
                f"`projector_per_chunk` ({len(projector_per_chunk)} projectors) and "
                f"`params_per_chunk` ({len(params_per_chunk)} sizes) must be non-empty and of "
                "equal length."
            )
        self.projector_per_chunk = list(projector_per_chunk)
        self.proj_dim = self.projector_per_chunk[0].proj_dim
        self.proj_type = self.projector_per_chunk[0].proj_type
        self.params_per_chunk = list(params_per_chunk)
        self.max_chunk_size = positive_int("max_chunk_size", max_chunk_size)
        self.feat_bs = feat_bs
        self.device = torch.device(device)
        self.dtype = dtype

    def free_memory(self) -> None:
        """Free every chunk projector's memory."""
        for p in self.projector_per_chunk:
            p.free_memory()

    def project(self, grads: Mapping[str, Tensor], model_id: int) -> Tensor:
        """Project a mapping of per-parameter gradients chunk by chunk."""
        _, blocks = batch_blocks(grads)
        out: Tensor | None = None
        chunk: list[Tensor] = []
        index = 0

        def flush() -> None:
            nonlocal out, chunk, index
            if index >= len(self.projector_per_chunk):
                raise ValueError(
                    f"the parameters need more than {len(self.projector_per_chunk)} chunks of "
                    f"max_chunk_size={self.max_chunk_size}; pass more projectors."
                )
            part = self.projector_per_chunk[index].project(torch.cat(chunk, dim=1), model_id)
            out = part if out is None else out + part
            chunk, index = [], index + 1

        for b in blocks:
            if chunk and sum(c.shape[1] for c in chunk) + b.shape[1] > self.max_chunk_size:
                flush()
            chunk.append(b)
        flush()
        assert out is not None
        return out


def _projector_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments the base class understands (TRAK passes extras)."""
    return {k: v for k, v in kwargs.items() if k in ("model_id", "mask")}
