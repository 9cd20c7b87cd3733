"""Per-layer Kronecker (factorized) projection of Linear / Conv2d / HF Conv1D gradients.

For a linear layer with inputs ``a_t`` (``d_in``) and output gradients
``g_t`` (``d_out``) at positions ``t = 1..T`` (tokens, or conv patches after
im2col), the per-example weight gradient is ``G = sum_t g_t a_t^T``. A
Kronecker map projects it without ever forming it::

    (P_out ⊗ P_in) vec(G) = vec(P_out G P_in^T) = sum_t (P_out g_t) ⊗ (P_in a_t)

so a layer costs two small matmuls per position instead of a ``d_out x d_in``
outer product per example (LoGra: Choe et al., "What is Your Data Worth to
GPT?", 2024; FactGraSS: Hu et al., 2025).

Hugging Face's ``Conv1D`` (GPT-2) is a Linear whose weight is stored
``[d_in, d_out]``; its gradient is the same ``sum_t g_t a_t^T`` read in
transposed order, so it is a factorized layer with ``transposed=True``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gradsketch._checks import nonnegative_int, positive_int
from gradsketch._hash import derive_key
from gradsketch.errors import FactorizedLayoutError
from gradsketch.sketch._backend import buckets_and_signs
from gradsketch.sketch._countsketch import accumulate_folded
from gradsketch.sketch._fingerprint import Fingerprint
from gradsketch.sketch._projectors import AbstractProjector, ProjectionType, parse_proj_type
from gradsketch.sketch._tables import dense_block
from gradsketch.sketch._validate import check_device, check_float_tensor, output_dtype

#: Hash stream of factorized maps (keeps them independent of every other kind).
_FACTORIZED_STREAM = 0xFAC7
#: Layer index used for the count sketch of the parameters outside factorized layers.
_REST_INDEX = 0xFFFFFFFF
_IN, _OUT = 0, 1


@dataclass(frozen=True)
class FactorizedLayer:
    """One factorized layer: its gradient is the ``[d_out, d_in + bias]`` matrix ``[W | b]``.

    Attributes:
        name: the module's name in the model (``"0"``, ``"blocks.1.mlp.fc"``).
        param_names: full names of its weight and (if any) bias parameter.
        d_in: input features per position (``C_in * kh * kw`` for Conv2d).
        d_out: output features (``C_out`` for Conv2d).
        bias: whether a bias is part of the gradient (a constant-1 input column).
        k_in: rows of ``P_in``.
        k_out: rows of ``P_out``.
        transposed: the weight parameter is stored ``[d_in, d_out]`` (HF
            ``Conv1D``); the projected matrix is still ``[W | b]`` with ``W``
            ``[d_out, d_in]``.
    """

    name: str
    param_names: tuple[str, ...]
    d_in: int
    d_out: int
    bias: bool
    k_in: int
    k_out: int
    transposed: bool = False

    @property
    def in_dim(self) -> int:
        """Columns of ``P_in``: ``d_in`` plus one for the bias."""
        return self.d_in + int(self.bias)

    @property
    def numel(self) -> int:
        """Gradient coordinates of the layer (weight, then bias)."""
        return self.d_out * self.in_dim

    @property
    def proj_dim(self) -> int:
        """Outputs of the layer: ``k_out * k_in``."""
        return self.k_out * self.k_in


@dataclass(frozen=True)
class PlainParam:
    """A parameter outside every factorized layer, count-sketched into the rest block."""

    name: str
    numel: int


Segment = FactorizedLayer | PlainParam


def _linear_dims(module: nn.Module) -> tuple[int, int, bool] | None:
    assert isinstance(module, nn.Linear)
    return module.in_features, module.out_features, module.bias is not None


def _conv2d_dims(module: nn.Module) -> tuple[int, int, bool] | None:
    assert isinstance(module, nn.Conv2d)
    if module.groups != 1:
        # A grouped weight is block-diagonal, not one d_out x d_in matrix.
        return None
    kh, kw = module.kernel_size
    return module.in_channels * kh * kw, module.out_channels, module.bias is not None


#: Module types whose weight gradient is a sum of outer products, keyed by
#: exact type (a subclass may change ``forward``). Each returns
#: ``(d_in, d_out, has_bias)`` or ``None`` when that instance cannot be factorized.
FACTORIZABLE: dict[type[nn.Module], Callable[[nn.Module], tuple[int, int, bool] | None]] = {
    nn.Linear: _linear_dims,
    nn.Conv2d: _conv2d_dims,
}
#: Types in :data:`FACTORIZABLE` whose weight is stored ``[d_in, d_out]``.
TRANSPOSED_WEIGHT: set[type[nn.Module]] = set()


def _conv1d_dims(module: nn.Module) -> tuple[int, int, bool] | None:
    nx, nf = int(module.nx), int(module.nf)  # type: ignore[arg-type]
    return nx, nf, getattr(module, "bias", None) is not None


def _register_optional_types() -> None:
    """Add Hugging Face's ``Conv1D`` once transformers is loaded (a model holding one implies it).

    Looked up at use, not imported: gradsketch does not import transformers.
    """
    pytorch_utils = sys.modules.get("transformers.pytorch_utils")
    conv1d = getattr(pytorch_utils, "Conv1D", None)
    if isinstance(conv1d, type) and conv1d not in FACTORIZABLE:
        FACTORIZABLE[conv1d] = _conv1d_dims
        TRANSPOSED_WEIGHT.add(conv1d)


class FactorizedProjector(AbstractProjector):
    """Kronecker projection per Linear / Conv2d layer; the rest by count sketch.

    The output is the concatenation, in model order, of one block of
    ``k_out * k_in`` numbers per factorized layer, then one block of
    ``rest_proj_dim`` numbers for every other parameter (Embedding,
    LayerNorm, grouped convolutions, ...). Layer ``l`` maps its gradient
    ``G = [W | b]`` (``[d_out, d_in + 1]``; the bias is the gradient of a
    constant-1 input) to ``s_l * vec(P_out G P_in^T)``, entry ``p * k_in + q``,
    with i.i.d. N(0, 1) (or ±1) factors ``P_out`` ``[k_out, d_out]`` and
    ``P_in`` ``[k_in, d_in + 1]`` drawn from the counter-based hash of
    ``(seed, model_id, layer index, side)``. ``E[(P_out ⊗ P_in)^T (P_out ⊗
    P_in)] = k_out k_in I``, so with ``s_l = sqrt(proj_dim / (k_out k_in))``
    (and count-sketch entries ``±sqrt(proj_dim)`` for the rest) the whole map
    has TRAK's normalisation::

        E<Px, Py> = proj_dim * <x, y>

    (for a single layer without rest, ``E<Px, Py> = k_in k_out <x, y>``). The
    variance is larger than a dense JL map's of the same size: the Kronecker
    entries are products of two Gaussians and share factors. For one layer's
    gradients ``V, W`` and Gaussian factors, ``X = <Px, Py> / (k_in k_out)``
    has (:func:`kronecker_inner_product_variance`, derived in
    tests/sketch/test_factorized_inner_products.py)::

        Var X = [|V|²|W|² + <V,W>² + 2||VᵀW||² + 4||sym(VWᵀ)||²
                 + 2 (k_in - 1) ||sym(VWᵀ)||² + 2 (k_out - 1) ||sym(VᵀW)||²] / (k_in k_out)

    about ``2||sym(VWᵀ)||²/k_out + 2||sym(VᵀW)||²/k_in`` for large sides: a
    relative error of order ``sqrt(2/k)`` per side, where a dense map of
    ``k_in k_out`` rows has ``sqrt(1/(k_in k_out))``. Layers use independent
    factors, so their variances add. Measured on GPT-2 layouts at k = 16, 64
    and 256 per side: ``benchmarks/bench_logra_quality.py``.

    Two ways in:

    * the fast path, :meth:`project_layer_into_`, takes a layer's inputs
      ``a`` ``[B, T, d_in]`` and output gradients ``g`` ``[B, T, d_out]`` and
      computes ``sum_t (P_out g_t) ⊗ (P_in a_t)`` without building ``G``;
      :class:`gradsketch.attribution.HookGradientComputer` feeds it;
    * the ordinary projector interface (:meth:`project`,
      :meth:`project_into_`) takes per-example gradients in model parameter
      order, so the same map also works behind any gradient computer.

    Build it from a model with :meth:`from_model`.

    Example:
        >>> nn = torch.nn
        >>> model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
        >>> p = FactorizedProjector.from_model(model, k_in=3, k_out=2, seed=0)
        >>> p.proj_dim, p.grad_dim
        (12, 39)
        >>> a, g = torch.randn(8, 1, 5), torch.randn(8, 1, 4)
        >>> out = torch.zeros(8, p.proj_dim)
        >>> p.project_layer_into_(out, "0", a, g).shape
        torch.Size([8, 12])
    """

    kind = "factorized"

    def __init__(
        self,
        segments: Sequence[Segment],
        seed: int,
        device: torch.device | str = "cpu",
        *,
        rest_proj_dim: int = 0,
        proj_type: ProjectionType | str = ProjectionType.normal,
        model_id: int = 0,
    ) -> None:
        self.segments: tuple[Segment, ...] = tuple(segments)
        if not self.segments:
            raise FactorizedLayoutError(
                "`segments` is empty; pass at least one FactorizedLayer (build the projector with "
                "FactorizedProjector.from_model(model, ...))."
            )
        for seg in self.segments:
            _check_segment(seg)
        self.layers: tuple[FactorizedLayer, ...] = tuple(
            s for s in self.segments if isinstance(s, FactorizedLayer)
        )
        self.rest_dim = sum(s.numel for s in self.segments if isinstance(s, PlainParam))
        self.rest_proj_dim = nonnegative_int("rest_proj_dim", rest_proj_dim)
        if self.rest_dim and not self.rest_proj_dim:
            names = [s.name for s in self.segments if isinstance(s, PlainParam)]
            raise FactorizedLayoutError(
                f"`rest_proj_dim`=0 but {self.rest_dim} coordinates of {names[:5]} are outside "
                "every factorized layer; pass rest_proj_dim > 0 (e.g. the k_in * k_out of a "
                "layer) or leave those parameters out."
            )
        if self.rest_proj_dim and not self.rest_dim:
            raise FactorizedLayoutError(
                f"`rest_proj_dim`={rest_proj_dim} but every parameter is in a factorized layer; "
                "pass rest_proj_dim=0."
            )
        grad_dim = sum(s.numel for s in self.segments)
        proj_dim = sum(layer.proj_dim for layer in self.layers) + self.rest_proj_dim
        super().__init__(
            grad_dim, proj_dim, seed, parse_proj_type(proj_type), device, model_id=model_id
        )
        self._layer_index = {layer.name: i for i, layer in enumerate(self.layers)}
        # Where each segment's coordinates start (input side) and where each
        # layer's block starts (output side); the rest block comes last.
        self._coord_offsets: list[int] = []
        self._rest_offsets: list[int] = []
        coord = rest = 0
        for seg in self.segments:
            self._coord_offsets.append(coord)
            self._rest_offsets.append(rest)
            coord += seg.numel
            if isinstance(seg, PlainParam):
                rest += seg.numel
        self._out_offsets: list[int] = []
        out = 0
        for layer in self.layers:
            self._out_offsets.append(out)
            out += layer.proj_dim
        self.rest_offset = out
        self._factors: dict[tuple[int, torch.dtype], tuple[Tensor, Tensor]] = {}
        self._rest_table: Tensor | None = None

    # -- construction ------------------------------------------------------
    @classmethod
    def from_model(
        cls,
        model: nn.Module,
        *,
        k_in: int = 16,
        k_out: int = 16,
        seed: int,
        device: torch.device | str | None = None,
        rest_proj_dim: int | None = None,
        proj_type: ProjectionType | str = ProjectionType.normal,
        model_id: int = 0,
        grad_wrt: Iterable[str] | None = None,
    ) -> FactorizedProjector:
        """Lay out a projector over ``model``'s parameters, in ``named_parameters`` order.

        Every module whose exact type is in :data:`FACTORIZABLE` (``nn.Linear``,
        ``nn.Conv2d`` with ``groups=1``, Hugging Face's ``Conv1D``) becomes a factorized layer with
        ``min(k_in, d_in + bias)`` and ``min(k_out, d_out)`` rows (projecting
        up would only add variance); every other parameter goes to the rest
        block.

        Args:
            model: the model (its structure only; weights are not read).
            k_in: rows of every ``P_in``.
            k_out: rows of every ``P_out``.
            seed: the map's seed.
            device: where the factors live (default: the model's device).
            rest_proj_dim: size of the rest block when some parameter is not
                factorized (ignored otherwise); ``None`` gives ``k_in * k_out``.
            proj_type: ``"normal"`` or ``"rademacher"`` factor entries.
            model_id: checkpoint id (re-seeds the map, as in TRAK).
            grad_wrt: parameter names to include (default: all), as in TRAK's
                ``FunctionalGradientComputer``.

        Returns:
            The projector; its ``segments`` name every parameter it expects.

        Raises:
            FactorizedLayoutError: if no parameter is selected or a name in
                ``grad_wrt`` is not a parameter of ``model``.
        """
        k_in = positive_int("k_in", k_in)
        k_out = positive_int("k_out", k_out)
        all_names = [name for name, _ in model.named_parameters()]
        wanted = set(all_names) if grad_wrt is None else set(grad_wrt)
        unknown = sorted(wanted - set(all_names))
        if unknown:
            raise FactorizedLayoutError(
                f"`grad_wrt` names {unknown} that are not parameters of the model; allowed names "
                f"are {all_names[:20]}{' ...' if len(all_names) > 20 else ''}."
            )
        _register_optional_types()
        segments: list[Segment] = []
        seen: set[int] = set()
        for mod_name, module in model.named_modules():
            own = [
                (f"{mod_name}.{n}" if mod_name else n, p)
                for n, p in module.named_parameters(recurse=False)
                if id(p) not in seen
            ]
            seen.update(id(p) for _, p in module.named_parameters(recurse=False))
            own = [(n, p) for n, p in own if n in wanted]
            if not own:
                continue
            rule = FACTORIZABLE.get(type(module))
            dims = rule(module) if rule is not None else None
            weight_name = f"{mod_name}.weight" if mod_name else "weight"
            if dims is not None and own[0][0] == weight_name:
                d_in, d_out, has_bias = dims
                bias = has_bias and len(own) == 2
                segments.append(
                    FactorizedLayer(
                        name=mod_name,
                        param_names=tuple(n for n, _ in own),
                        d_in=d_in,
                        d_out=d_out,
                        bias=bias,
                        k_in=min(k_in, d_in + int(bias)),
                        k_out=min(k_out, d_out),
                        transposed=type(module) in TRANSPOSED_WEIGHT,
                    )
                )
                continue
            segments.extend(PlainParam(n, p.numel()) for n, p in own)
        if not segments:
            raise FactorizedLayoutError(
                "no parameter selected: the model has none, or `grad_wrt` is empty."
            )
        has_rest = any(isinstance(s, PlainParam) for s in segments)
        if not has_rest:
            rest_proj_dim = 0
        elif rest_proj_dim is None:
            rest_proj_dim = k_in * k_out
        if device is None:
            first = next(iter(model.parameters()), None)
            device = first.device if first is not None else torch.device("cpu")
        return cls(
            segments,
            seed,
            device,
            rest_proj_dim=rest_proj_dim,
            proj_type=proj_type,
            model_id=model_id,
        )

    @classmethod
    def from_budget(
        cls,
        model: nn.Module,
        proj_dim: int,
        *,
        seed: int,
        device: torch.device | str | None = None,
        proj_type: ProjectionType | str = ProjectionType.normal,
        model_id: int = 0,
        grad_wrt: Iterable[str] | None = None,
    ) -> FactorizedProjector:
        """:meth:`from_model` with sides ``k_in = k_out = s``: the most features up to ``proj_dim``.

        ``s`` is the largest side whose total (every layer's
        ``min(s, d_in + bias) * min(s, d_out)``, plus ``s * s`` for the rest
        block when some parameter is not factorized) stays at most
        ``proj_dim``; a larger side that adds no feature is not taken.

        Raises:
            ValueError: ``proj_dim`` is below the smallest layout (``s = 1``).

        Example:
            >>> model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
            >>> p = FactorizedProjector.from_budget(model, 2048, seed=0)
            >>> p.layers[0].k_in, p.proj_dim  # 40 * 40 + 40 * 10 = 2000
            (40, 2000)
        """
        budget = positive_int("proj_dim", proj_dim)
        probe = cls.from_model(model, k_in=1, k_out=1, seed=seed, grad_wrt=grad_wrt, device="cpu")
        has_rest = probe.rest_dim > 0

        def total(side: int) -> int:
            layers = sum(min(side, layer.in_dim) * min(side, layer.d_out) for layer in probe.layers)
            return layers + (side * side if has_rest else 0)

        if total(1) > budget:
            raise ValueError(
                f"`proj_dim`={proj_dim} is below the smallest factorized layout of this model "
                f"({total(1)} features: one per layer, plus the rest block); raise proj_dim."
            )
        side = 1
        while total(side + 1) <= budget and (has_rest or total(side + 1) > total(side)):
            side += 1
        return cls.from_model(
            model,
            k_in=side,
            k_out=side,
            seed=seed,
            device=device,
            proj_type=proj_type,
            model_id=model_id,
            grad_wrt=grad_wrt,
        )

    # -- identity -----------------------------------------------------------
    def _proj_type_value(self) -> str:
        return parse_proj_type(self.proj_type).value

    @property
    def fingerprint(self) -> Fingerprint:
        """Kind ``"factorized"``; ``extra`` holds the layout (dims only, not names).

        ``extra`` is compact JSON: ``{"segments": [["L", d_in, d_out, bias,
        k_in, k_out] | ["P", numel], ...], "rest_proj_dim": r}``, with ``"LT"``
        for a transposed weight (its coordinates come in another order).
        Renaming modules keeps the map; changing any dimension or order changes it.
        """
        layout = [
            ["LT" if s.transposed else "L", s.d_in, s.d_out, int(s.bias), s.k_in, s.k_out]
            if isinstance(s, FactorizedLayer)
            else ["P", s.numel]
            for s in self.segments
        ]
        extra = json.dumps(
            {"segments": layout, "rest_proj_dim": self.rest_proj_dim}, separators=(",", ":")
        )
        return dataclasses.replace(super().fingerprint, extra=extra)

    def _on_model_change(self) -> None:
        self.free_memory()

    def free_memory(self) -> None:
        """Drop the cached factors and the rest table (regenerated on demand)."""
        self._factors = {}
        self._rest_table = None

    # -- the factors ----------------------------------------------------------
    def layer(self, name: str) -> FactorizedLayer:
        """The factorized layer called ``name`` (a module name)."""
        return self.layers[self._index(name)]

    def output_slice(self, name: str) -> slice:
        """Columns of the output that hold layer ``name``'s block."""
        i = self._index(name)
        return slice(self._out_offsets[i], self._out_offsets[i] + self.layers[i].proj_dim)

    def scale(self, name: str) -> float:
        """``s_l = sqrt(proj_dim / (k_out k_in))`` of layer ``name``."""
        return math.sqrt(self.proj_dim / self.layer(name).proj_dim)

    def _index(self, name: str) -> int:
        try:
            return self._layer_index[name]
        except KeyError:
            allowed = ", ".join(repr(n) for n in self._layer_index)
            raise FactorizedLayoutError(
                f"`name`={name!r} is not a factorized layer of this projector; its layers are "
                f"{allowed}. Build the projector from the same model."
            ) from None

    def factor_matrices(
        self, name: str, dtype: torch.dtype = torch.float32
    ) -> tuple[Tensor, Tensor]:
        """``(P_out [k_out, d_out], P_in [k_in, d_in + bias])`` of layer ``name``, unscaled.

        The last column of ``P_in`` is the bias column when the layer has a bias.
        """
        p_in_t, p_out_t = self._factor_t(self._index(name), dtype)
        return p_out_t.T, p_in_t.T

    def _factor_t(self, index: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Transposed factors ``(P_in^T [d_in + bias, k_in], P_out^T [d_out, k_out])``, cached."""
        work = output_dtype(dtype)
        cached = self._factors.get((index, work))
        if cached is None:
            layer = self.layers[index]
            kind = self._proj_type_value()
            key_in = derive_key(self.seed, self.model_id, _FACTORIZED_STREAM, index, _IN)
            key_out = derive_key(self.seed, self.model_id, _FACTORIZED_STREAM, index, _OUT)
            cached = (
                dense_block(key_in, 0, layer.in_dim, 0, layer.k_in, kind, work, self.device),
                dense_block(key_out, 0, layer.d_out, 0, layer.k_out, kind, work, self.device),
            )
            self._factors[(index, work)] = cached
        return cached

    # -- the fast path: factors in, projections out ---------------------------
    def project_layer_into_(
        self,
        out: Tensor,
        name: str,
        a: Tensor,
        g: Tensor,
        *,
        model_id: int | None = None,
    ) -> Tensor:
        """``out[:, block of name] += s_l * sum_t (P_out g_t) ⊗ (P_in [a_t, 1])``.

        Args:
            out: ``[B, proj_dim]`` float32/float64 accumulator.
            name: the layer's module name.
            a: ``[B, T, d_in]`` (or ``[B, d_in]``) layer inputs, im2col
                patches for Conv2d.
            g: ``[B, T, d_out]`` (or ``[B, d_out]``) gradients of the output
                function w.r.t. the layer's outputs.
            model_id: checkpoint id; ``None`` keeps the current one.

        Returns:
            ``out``, for chaining.
        """
        index = self._index(name)
        layer = self.layers[index]
        a3, g3 = _as_positions("a", a, layer.d_in), _as_positions("g", g, layer.d_out)
        if a3.shape[:2] != g3.shape[:2] or out.shape != (a3.shape[0], self.proj_dim):
            raise FactorizedLayoutError(
                f"shapes do not agree for layer {name!r}: `a` {tuple(a.shape)}, `g` "
                f"{tuple(g.shape)}, `out` {tuple(out.shape)}; expected a [B, T, {layer.d_in}], "
                f"g [B, T, {layer.d_out}] and out [B, {self.proj_dim}]."
            )
        for arg_name, t in (("a", a3), ("g", g3), ("out", out)):
            check_device(arg_name, t, self.device)
        self.set_model_id(model_id)
        p_in_t, p_out_t = self._factor_t(index, out.dtype)
        batch, positions = a3.shape[:2]
        # [B*T, k_in]: the bias is a constant-1 input, i.e. the last row of P_in^T.
        a2 = a3.to(out.dtype).reshape(batch * positions, layer.d_in)
        if layer.bias:
            pa = torch.addmm(p_in_t[layer.d_in], a2, p_in_t[: layer.d_in])
        else:
            pa = a2 @ p_in_t
        pg = g3.to(out.dtype).reshape(batch * positions, layer.d_out) @ p_out_t  # [B*T, k_out]
        # The layer's columns viewed as [B, k_out, k_in] (splitting the last
        # axis keeps it a view): the contraction accumulates in place, no
        # temporary block and no copy.
        view = out[:, self.output_slice(name)].view(batch, layer.k_out, layer.k_in)
        scale = self.scale(name)
        if positions == 1:
            # One position: an outer product, cheaper than B tiny matmuls.
            view.addcmul_(pg.unsqueeze(2), pa.unsqueeze(1), value=scale)
        else:
            # sum_t pg_t pa_t^T, one batched matmul over all positions.
            pg3 = pg.view(batch, positions, layer.k_out)
            view.baddbmm_(pg3.transpose(1, 2), pa.view(batch, positions, layer.k_in), alpha=scale)
        return out

    def project_rest_into_(self, out: Tensor, block: Tensor, rest_offset: int) -> Tensor:
        """Count-sketch rest coordinates ``rest_offset : rest_offset + n`` into the rest block.

        Args:
            out: ``[B, proj_dim]`` accumulator.
            block: ``[B, n]`` gradient coordinates of parameters outside
                factorized layers (their position in the rest space is
                :meth:`rest_offset_of`).
            rest_offset: index of the block's first coordinate in the rest space.

        Returns:
            ``out``, for chaining.
        """
        if rest_offset < 0 or rest_offset + block.shape[1] > self.rest_dim:
            raise FactorizedLayoutError(
                f"rest coordinates [{rest_offset}, {rest_offset + block.shape[1]}) run past the "
                f"rest space of {self.rest_dim} coordinates."
            )
        folded = self._rest_folded()[rest_offset : rest_offset + block.shape[1]]
        rest_view = out[:, self.rest_offset :]
        accumulate_folded(rest_view, block, folded, self.rest_proj_dim, math.sqrt(self.proj_dim))
        return out

    def project_rest_sparse_into_(self, out: Tensor, coords: Tensor, values: Tensor) -> Tensor:
        """Count-sketch a per-example sparse gradient into the rest block.

        ``out[b, rest] += sqrt(proj_dim) * sum_j S[:, coords[b, j]] * values[b, j]``;
        repeated coordinates add up. This is how Embedding gradients (a few
        rows per example) are sketched without a ``[B, vocab, dim]`` tensor.

        Args:
            out: ``[B, proj_dim]`` accumulator.
            coords: int64 ``[B, n]`` rest-space coordinates.
            values: ``[B, n]`` values.

        Returns:
            ``out``, for chaining.
        """
        folded = self._rest_folded()[coords]
        scratch = out.new_zeros(out.shape[0], 2 * self.rest_proj_dim)
        scratch.scatter_add_(1, folded, values.to(out.dtype))
        k = self.rest_proj_dim
        out[:, self.rest_offset :].add_(
            scratch[:, :k] - scratch[:, k:], alpha=math.sqrt(self.proj_dim)
        )
        return out

    def rest_offset_of(self, param_name: str) -> int:
        """Position of a plain parameter's first coordinate in the rest space."""
        for seg, offset in zip(self.segments, self._rest_offsets):
            if isinstance(seg, PlainParam) and seg.name == param_name:
                return offset
        allowed = [s.name for s in self.segments if isinstance(s, PlainParam)]
        raise FactorizedLayoutError(
            f"`param_name`={param_name!r} is not a rest parameter of this projector; rest "
            f"parameters are {allowed[:20]}."
        )

    def _rest_folded(self) -> Tensor:
        if self._rest_table is None:
            key = derive_key(self.seed, self.model_id, _FACTORIZED_STREAM, _REST_INDEX)
            self._rest_table = buckets_and_signs(
                key, 0, self.rest_dim, self.rest_proj_dim, self.device
            )
        return self._rest_table

    # -- the ordinary projector path: flat per-example gradients ---------------
    def _accumulate(self, out: Tensor, block: Tensor, offset: int) -> None:
        stop = offset + block.shape[1]
        for seg, start, rest_start in zip(self.segments, self._coord_offsets, self._rest_offsets):
            lo, hi = max(offset, start), min(stop, start + seg.numel)
            if lo >= hi:
                continue
            part = block[:, lo - offset : hi - offset]
            if isinstance(seg, PlainParam):
                self.project_rest_into_(out, part, rest_start + lo - start)
                continue
            full = part.new_zeros(part.shape[0], seg.numel)
            full[:, lo - start : hi - start] = part
            self._project_dense_layer(out, seg, full)

    def _project_dense_layer(self, out: Tensor, layer: FactorizedLayer, flat: Tensor) -> None:
        """``out[:, block] += s_l vec(P_out [W | b] P_in^T)`` from a flat layer gradient."""
        p_in_t, p_out_t = self._factor_t(self._index(layer.name), out.dtype)
        batch = flat.shape[0]
        flat = flat.to(out.dtype)
        weight = flat[:, : layer.d_out * layer.d_in]
        if layer.transposed:
            weight = weight.reshape(batch, layer.d_in, layer.d_out).transpose(1, 2)
        else:
            weight = weight.reshape(batch, layer.d_out, layer.d_in)
        block = p_out_t.T @ (weight @ p_in_t[: layer.d_in])  # [B, k_out, k_in]
        if layer.bias:
            pb = flat[:, layer.d_out * layer.d_in :] @ p_out_t  # [B, k_out]
            block = block + pb.unsqueeze(2) * p_in_t[layer.d_in]
        view = out[:, self.output_slice(layer.name)]
        view.add_(block.reshape(batch, -1), alpha=self.scale(layer.name))

    def __repr__(self) -> str:
        return (
            f"FactorizedProjector(layers={len(self.layers)}, rest_dim={self.rest_dim}, "
            f"grad_dim={self.grad_dim}, proj_dim={self.proj_dim}, seed={self.seed}, "
            f"model_id={self.model_id}, device={self.device})"
        )


def kronecker_inner_product_variance(
    v: Tensor, w: Tensor, *, k_in: int | None, k_out: int | None
) -> float:
    """Variance of ``<P_out V P_inᵀ, P_out W P_inᵀ> / (k_in k_out)`` under N(0, 1) factors.

    The estimate is unbiased (its mean is ``<V, W>``); see
    :class:`FactorizedProjector` for the formula and
    tests/sketch/test_factorized_inner_products.py for its derivation.
    Rademacher factors have a smaller fourth moment, so this bounds their
    variance from above. A side left unprojected (``None``, as the per-layer
    rows leave a side whose ``k`` is not below its width) adds no variance:
    with only ``P_out``, ``Var X = 2||sym(VWᵀ)||² / k_out``; with only
    ``P_in``, ``2||sym(VᵀW)||² / k_in``.

    Args:
        v: one layer's gradient ``[d_out, d_in (+ 1)]``.
        w: another, of the same shape.
        k_in: rows of ``P_in``, or ``None`` (the input side is exact).
        k_out: rows of ``P_out``, or ``None`` (the output side is exact).

    Returns:
        The variance, in float64.

    Example:
        >>> v = torch.eye(2, dtype=torch.float64)
        >>> kronecker_inner_product_variance(v, v, k_in=1, k_out=1)
        20.0
    """
    k_in = positive_int("k_in", k_in, optional=True)
    k_out = positive_int("k_out", k_out, optional=True)
    if v.shape != w.shape or v.dim() != 2:
        raise ValueError(
            f"`v` and `w` must have one shape [d_out, d_in], got {tuple(v.shape)} and "
            f"{tuple(w.shape)}; pass two gradients of the same layer."
        )
    v, w = v.double(), w.double()

    def sym_sq(m: Tensor) -> float:
        return float((0.5 * (m + m.T)).pow(2).sum())

    left, right = sym_sq(v @ w.T), sym_sq(v.T @ w)
    if k_in is None or k_out is None:
        return (0.0 if k_out is None else 2.0 * left / k_out) + (
            0.0 if k_in is None else 2.0 * right / k_in
        )
    inner = float((v * w).sum())
    single = (
        float(v.pow(2).sum()) * float(w.pow(2).sum())
        + inner**2
        + 2.0 * float((v.T @ w).pow(2).sum())
        + 4.0 * left
    )
    return (single + 2.0 * (k_in - 1) * left + 2.0 * (k_out - 1) * right) / (k_in * k_out)


def _check_segment(seg: object) -> None:
    if isinstance(seg, FactorizedLayer):
        for field_name in ("d_in", "d_out", "k_in", "k_out"):
            positive_int(f"{seg.name}.{field_name}", getattr(seg, field_name))
        expected = 1 + int(seg.bias)
        if len(seg.param_names) != expected:
            raise FactorizedLayoutError(
                f"layer {seg.name!r} has bias={seg.bias} so it needs {expected} parameter "
                f"names, got {seg.param_names!r}."
            )
        return
    if isinstance(seg, PlainParam):
        positive_int(f"{seg.name}.numel", seg.numel)
        return
    raise TypeError(
        f"`segments` entries must be FactorizedLayer or PlainParam, got {type(seg).__name__}."
    )


def _as_positions(name: str, t: Tensor, width: int) -> Tensor:
    """View a ``[B, d]`` or ``[B, ..., d]`` tensor as ``[B, T, d]``."""
    check_float_tensor(name, t)
    if t.dim() < 2 or t.shape[-1] != width:
        raise FactorizedLayoutError(
            f"`{name}` must be [B, T, {width}] or [B, {width}], got shape {tuple(t.shape)}."
        )
    return t.reshape(t.shape[0], -1, width)


def param_layout(projector: FactorizedProjector) -> Mapping[str, Segment]:
    """Every parameter name the projector expects, mapped to its segment."""
    layout: dict[str, Segment] = {}
    for seg in projector.segments:
        names = seg.param_names if isinstance(seg, FactorizedLayer) else (seg.name,)
        for n in names:
            layout[n] = seg
    return layout
