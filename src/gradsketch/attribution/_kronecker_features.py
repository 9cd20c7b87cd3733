"""Per-layer (Kronecker) features: what K-FAC, EK-FAC and identity influence store per row.

For every factored layer (Linear, Conv2d, Hugging Face ``Conv1D``, each
expert ``W[e]`` of a mixture of experts' stacked ``[E, d_out, d_in]``
weight; see :func:`~gradsketch.attribution._layer_capture.find_layers`) one hooked
forward and backward gives the inputs ``a [B, T, d_in]`` and the gradients
``g [B, T, d_out]`` of the task's output function at the layer's outputs.
The stored feature of a row is each layer's ``vec(G) = vec(sum_t g_t a_tᵀ)``
(bias: an extra input fixed at 1), concatenated in layer order, so
``feature_dim = sum_l d_out (d_in + 1)``; nothing larger than one layer's
gradient is formed per example. The same ``(a, g)`` feed the Kronecker
factors of :class:`~gradsketch.attribution._preconditioners.KFACPreconditioner`.

With ``projection=(k_in, k_out)`` inputs and output gradients are first
multiplied by the Gaussian factors of
:class:`~gradsketch.sketch.FactorizedProjector` (scaled by ``1/sqrt(k)`` so
inner products are kept in expectation): the stored rows are
``P_out G P_inᵀ`` (``k_out k_in`` numbers) and the factors ``k x k`` (LoGra:
Choe et al., "What is your data worth to GPT?", 2024).

The output function is the task's TRAK margin, or for language models the
summed log-likelihood of the predicted tokens (see
:mod:`gradsketch.attribution._fisher`), and ``Q`` makes ``Q · feature``
minus the training loss's gradient. ``curvature="sampled"`` adds a second
backward through the loss under labels drawn from the model's own
predictions (the true Fisher), seeded by ``(sample_seed, checkpoint id,
row)``: a row's draw does not depend on its batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from gradsketch._hash import derive_key
from gradsketch.attribution._fisher import SAMPLED_LOSSES, draw_labels
from gradsketch.attribution._kfac import KroneckerEigenbasis, add_bias_input
from gradsketch.attribution._layer_capture import FactoredLayer, capture_layers, find_layers
from gradsketch.attribution._modelout import AbstractModelOutput, resolve_batch_output
from gradsketch.attribution._task import task_protocol
from gradsketch.sketch import FactorizedLayer, FactorizedProjector

__all__ = ["CURVATURES", "FactoredRows", "KroneckerFeaturizer", "split_factored"]

#: Whose second moment the curvature is: empirical Fisher, output Gram, true Fisher.
CURVATURES = ("loss", "output", "sampled")
# Stream of the sampled labels' keys (see gradsketch._hash.derive_key).
SAMPLE_STREAM = 0x5A3F

LayerParts = list[tuple[Tensor, Tensor, Tensor | None]]


def split_factored(
    rows: Tensor,
    layers: Sequence[FactoredLayer],
    tokens: Sequence[int] | None,
    *,
    sampled: bool,
) -> list[tuple[Tensor, Tensor, Tensor | None]]:
    """Per layer ``(a [B, T, k_in], g [B, T, k_out], g_sampled | None)`` of factored rows.

    The layout of :meth:`KroneckerFeaturizer.factored_rows`; ``tokens``
    ``None`` reads ``rank_one`` rows (one position per layer).
    """
    out = []
    offset = 0
    b = rows.shape[0]
    for i, x in enumerate(layers):
        t = 1 if tokens is None else int(tokens[i])
        a = rows[:, offset : offset + t * x.k_in].reshape(b, t, x.k_in)
        offset += t * x.k_in
        g = rows[:, offset : offset + t * x.k_out].reshape(b, t, x.k_out)
        offset += t * x.k_out
        gs = None
        if sampled:
            gs = rows[:, offset : offset + t * x.k_out].reshape(b, t, x.k_out)
            offset += t * x.k_out
        out.append((a, g, gs))
    return out


class KroneckerFeaturizer:
    """Per-layer features ``vec(sum_t g_t a_tᵀ)`` and Q of a batch (module docstring).

    Args:
        model: the model.
        task: the resolved task.
        grad_wrt: parameter names to differentiate (``None``: all).
        projection: ``(k_in, k_out)`` per-layer projection, or ``None``.
        projection_seed: seed of the projection (re-drawn per checkpoint id).
        curvature: ``"loss"``, ``"output"`` or ``"sampled"``.
        sample_seed: seed of the sampled labels.
        device: where gradients are computed.
        dtype: the features' dtype (float32 or float64).
    """

    def __init__(
        self,
        model: nn.Module,
        task: AbstractModelOutput,
        *,
        grad_wrt: Sequence[str] | None,
        projection: tuple[int, int] | None,
        projection_seed: int,
        curvature: str,
        sample_seed: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.task = task
        self._protocol = protocol = task_protocol(task)
        override = protocol.influence_output
        self._batch_output = resolve_batch_output(task) if override is None else override[0]
        self._q_from_output = protocol.loss_grad_from_output if override is None else override[1]
        self._sampled_loss = protocol.sampled_loss
        if curvature == "sampled" and self._sampled_loss is None:
            able = ", ".join(sorted(t.__name__ for t in SAMPLED_LOSSES))
            raise ValueError(
                f"`curvature`='sampled' draws labels from the model's predictions, which task "
                f"{type(task).__name__} does not define (tasks that can: {able}). Pass "
                "curvature='loss' or 'output', or register its sampled loss with "
                "@gradsketch.attribution.register_sampled_loss(YourTask)."
            )
        self.curvature = curvature
        self.sample_seed = int(sample_seed)
        self.device = device
        self.dtype = dtype
        self.layers: list[FactoredLayer] = find_layers(model, grad_wrt, projection)
        self.feature_dim = sum(x.width for x in self.layers)
        self.projector = self._build_projector(projection, int(projection_seed))
        self.model_id: int | None = None

    def _build_projector(self, proj: tuple[int, int] | None, seed: int) -> Any:
        if proj is None:
            return None
        segments = []
        for x in self.layers:
            segments.append(
                FactorizedLayer(
                    name=x.name,
                    param_names=x.param_names,
                    d_in=x.d_in - int(x.bias),
                    d_out=x.d_out,
                    bias=x.bias,
                    k_in=x.k_in,
                    k_out=x.k_out,
                )
            )
        return FactorizedProjector(segments, seed, self.device)

    def set_model_id(self, model_id: int) -> None:
        """Checkpoint id: re-seeds the projection and the sampled labels."""
        self.model_id = int(model_id)
        if self.projector is not None:
            self.projector.set_model_id(self.model_id)

    def layer_parts(
        self, batch: Sequence[Any], rows: np.ndarray | None = None
    ) -> tuple[LayerParts, Tensor]:
        """Per layer the stored-side ``(a, g, g_sampled)`` (bias column, projection), and Q.

        ``g_sampled`` (output gradients of the loss under labels drawn from the
        model) is computed when ``rows`` (the batch's row indices, which seed
        the draws) is given and the curvature is ``"sampled"``; else ``None``.
        """
        if self._protocol.check_batch is not None:
            self._protocol.check_batch(self.model, batch)
        sampled_loss = None
        if rows is not None and self.curvature == "sampled":
            assert self.model_id is not None
            key = derive_key(self.sample_seed, self.model_id, SAMPLE_STREAM)
            index = torch.as_tensor(rows, dtype=torch.int64)
            rule, task = self._sampled_loss, self.task
            assert rule is not None  # checked at construction

            def draw(logits: Tensor) -> Tensor:
                return draw_labels(logits, index, key)

            def sampled_loss(output: Any) -> Tensor:
                return rule(task, output, batch, draw)

        caps, root = capture_layers(
            self.model, self.layers, self._batch_output, batch, sampled_loss
        )
        work = self.dtype
        out: LayerParts = []
        for x in self.layers:
            a, g, gs = caps[x.name]
            a, g = a.to(work), g.to(work)
            gs = None if gs is None else gs.to(work)
            if x.bias:
                real = (a != 0).any(-1, keepdim=True)
                a = add_bias_input(a)
                if x.container is not None:
                    # Zero rows pad an expert's routed rows to the batch's most: their bias
                    # input is 0 too, so they stay zero (and are told apart) when projected.
                    a[..., -1:] = real.to(a.dtype)
            if self.projector is not None:
                p_out, p_in = self.projector.factor_matrices(x.name, work)
                if x.k_in < x.d_in:
                    a = a @ (p_in.T / math.sqrt(x.k_in))
                if x.k_out < x.d_out:
                    g = g @ (p_out.T / math.sqrt(x.k_out))
                    gs = None if gs is None else gs @ (p_out.T / math.sqrt(x.k_out))
            out.append((a, g, gs))
        return out, self._out_to_loss(batch, root)

    def _out_to_loss(self, batch: Sequence[Any], root: Any) -> Tensor:
        rule = self._q_from_output
        if rule is not None and root is not None:
            q = rule(self.task, root, batch)
        else:
            weights = {k: p.detach() for k, p in self.model.named_parameters()}
            buffers = {k: b.detach() for k, b in self.model.named_buffers()}
            q = self.task.get_out_to_loss_grad(self.model, weights, buffers, batch)
        return q.detach().reshape(-1).to(torch.float64)

    @property
    def _rank_one_g(self) -> int:
        """Output-gradient vectors per layer in a factored row (2 with sampled labels)."""
        return 2 if self.curvature == "sampled" else 1

    def row_width(self, name: str, tokens: Sequence[int] | None = None) -> int:
        """Numbers per row of the stored array ``name`` (features or an extra array).

        ``"rank_one"`` and ``"token_factors"``: each layer's ``tokens[l]``
        positions of ``[a, g]`` (one position each for ``"rank_one"``).
        """
        if name in ("rank_one", "token_factors"):
            counts = tokens if tokens is not None else [1] * len(self.layers)
            return sum(
                t * (x.k_in + self._rank_one_g * x.k_out) for t, x in zip(counts, self.layers)
            )
        if name in ("grads", "fisher_grads"):
            return self.feature_dim
        raise ValueError(
            "per-layer features store 'grads', 'fisher_grads', 'rank_one' and "
            f"'token_factors', not {name!r}."
        )

    def dense_width(self) -> int:
        """Numbers per row of the dense rows (both dense arrays with sampled labels)."""
        return self.feature_dim * self._rank_one_g

    @staticmethod
    def token_counts(parts: LayerParts) -> list[int]:
        """Positions per example each layer saw in a batch (``T`` of ``a [B, T, k_in]``)."""
        return [int(a.shape[1]) for a, _, _ in parts]

    def extra_rows(self, name: str, parts: LayerParts) -> Tensor:
        """``[B, row_width(name)]`` rows of the extra array ``name`` from a batch's parts.

        ``"fisher_grads"``: the features under sampled labels. ``"rank_one"``:
        each layer's ``[a, g]`` (and ``g`` under sampled labels, with
        ``curvature="sampled"``) where every layer sees one position per
        example, so that ``G = g aᵀ`` is kept in ``k_in + k_out`` numbers
        instead of ``k_out k_in``; NaN rows where a layer sees several
        positions (then :meth:`factored_rows` or the dense rows are stored).
        """
        if name == "fisher_grads":
            return self.features([(a, gs) for a, _, gs in parts if gs is not None])
        if name != "rank_one":
            raise ValueError(f"no extra per-row array {name!r}.")
        if not self.rank_one(parts):
            b = parts[0][0].shape[0]
            like = parts[0][0]
            return like.new_full((b, self.row_width(name)), float("nan"))
        return self.factored_rows(parts, [1] * len(parts))

    def factored_rows(self, parts: LayerParts, tokens: Sequence[int]) -> Tensor:
        """``[B, row_width("token_factors", tokens)]``: each layer's positions of ``[a, g]``.

        ``G = sum_t g_t a_tᵀ`` is kept as its ``T`` factor pairs (``T (k_in +
        k_out)`` numbers instead of ``k_out k_in``), layer by layer: ``a``
        ``[T, k_in]``, then ``g`` ``[T, k_out]`` (then ``g`` under sampled
        labels), positions past a batch's own ``T`` zero (they add nothing).
        """
        b = parts[0][0].shape[0]
        pieces = []
        for (a, g, gs), t in zip(parts, tokens):
            if a.shape[1] > t:
                raise ValueError(f"a layer saw {a.shape[1]} positions, more than the {t} stored.")
            vectors = [a, g] + ([g if gs is None else gs] if self._rank_one_g == 2 else [])
            for v in vectors:
                if v.shape[1] < t:
                    v = torch.cat([v, v.new_zeros(b, t - v.shape[1], v.shape[2])], dim=1)
                pieces.append(v.reshape(b, -1))
        return torch.cat(pieces, dim=1)

    @staticmethod
    def rank_one(parts: LayerParts) -> bool:
        """Whether every layer of a batch saw one position per example (``G = g aᵀ``)."""
        return all(a.shape[1] == 1 for a, _, _ in parts)

    def split_rank_one(
        self, rows: Tensor, tokens: Sequence[int] | None = None
    ) -> list[tuple[Tensor, Tensor, Tensor | None]]:
        """Per layer ``(a [B, T, k_in], g [B, T, k_out], g_sampled | None)`` of factored rows."""
        return split_factored(rows, self.layers, tokens, sampled=self._rank_one_g == 2)

    def expand_rank_one(
        self,
        rows: Tensor,
        *,
        sampled: bool = False,
        bases: Sequence[KroneckerEigenbasis | None] | None = None,
        tokens: Sequence[int] | None = None,
    ) -> Tensor:
        """``[B, feature_dim]`` dense features of finite factored rows.

        Each layer's ``vec(sum_t g_t a_tᵀ)`` (``sampled``: ``g`` under sampled
        labels), as :meth:`features` lays them out; ``tokens`` as stored
        (``None``: the one position of ``rank_one`` rows). With ``bases``
        (per layer a :class:`KroneckerEigenbasis`, or ``None`` for a layer
        expanded as stored) the rows are expanded in it,
        ``vec((g Q_S)ᵀ (a Q_A))``: rotating the factors costs
        ``T (k_in² + k_out²)`` per row, not ``k_out k_in (k_in + k_out)``. A
        reduced basis (``r_s r_a`` columns) fills each layer's first ``r_s r_a``
        places and zeroes the rest, as
        :meth:`~gradsketch.attribution._preconditioners.KFACPreconditioner.solve_rotated`
        lays out the targets.
        """
        out = rows.new_empty((rows.shape[0], self.feature_dim))
        offset = 0
        for i, (x, (a, g, gs)) in enumerate(zip(self.layers, self.split_rank_one(rows, tokens))):
            g = gs if sampled and gs is not None else g
            width = x.width
            basis = None if bases is None else bases[i]
            if basis is not None:
                a, g = basis.rotate_factors(a, g)
                # A reduced basis (r_s r_a < width) fills the block's first r_s r_a places.
                width = a.shape[2] * g.shape[2]
                out[:, offset + width : offset + x.width] = 0
            block = out[:, offset : offset + width].view(rows.shape[0], g.shape[2], a.shape[2])
            if a.shape[1] == 1:
                torch.mul(g.transpose(1, 2), a, out=block)
            else:
                block.copy_(torch.bmm(g.transpose(1, 2), a))
            offset += x.width
        return out

    def token_mask(self, batch: Sequence[Any]) -> Tensor | None:
        """``[B, T]`` bool: the batch's real (not padded) positions, for tasks with a padding mask.

        Padded positions carry no output gradient, so they add nothing to the
        features; K-FAC leaves them out of ``A``'s mean too, so that a row's
        curvature does not depend on how far its batch was padded.
        """
        mask = self._protocol.token_mask
        return None if mask is None else torch.as_tensor(mask(batch)).to(self.device).bool()

    @staticmethod
    def features(parts: Sequence[tuple[Tensor, Tensor]]) -> Tensor:
        """``[B, feature_dim]``: each layer's ``vec(sum_t g_t a_tᵀ)``, in layer order."""
        blocks = [torch.bmm(g.transpose(1, 2), a).reshape(a.shape[0], -1) for a, g in parts]
        return torch.cat(blocks, dim=1)


class FactoredRows:
    """The dense ``[n, feature_dim]`` rows of a factored array, expanded as they are read.

    Where the layers see few positions per example, the store keeps each
    layer's ``[a, g]`` per position (``rank_one``: one position;
    ``token_factors``: ``tokens[l]`` each) instead of ``vec(sum_t g_t a_tᵀ)``;
    readers that want the dense features (finalizing, scoring) slice this
    view like the array it stands for: ``shape``, ``dtype`` and step-1 row
    slices, each expanded in memory.

    Args:
        factored: the stored ``[n, row_width(...)]`` array.
        featurizer: the featurizer that wrote it (its layers and layout).
        tokens: positions per layer of ``token_factors`` rows (``None``:
            ``rank_one`` rows).
        sampled: expand the gradients under sampled labels (``fisher_grads``).
        bases: per layer the eigenbasis to expand in, or ``None`` (see
            :meth:`KroneckerFeaturizer.expand_rank_one`).
    """

    def __init__(
        self,
        factored: Any,
        featurizer: KroneckerFeaturizer,
        *,
        tokens: Sequence[int] | None = None,
        sampled: bool = False,
        bases: Sequence[KroneckerEigenbasis | None] | None = None,
    ) -> None:
        self.factored = factored
        self.featurizer = featurizer
        self.tokens = None if tokens is None else [int(t) for t in tokens]
        self.sampled = sampled
        # The rows are read from the store onto the CPU: the bases (on the
        # preconditioner's device) go there once, not once per block.
        self.bases = None if bases is None else [b if b is None else b.to("cpu") for b in bases]
        self.dtype = np.dtype(factored.dtype)
        self.chunks = (int(factored.chunks[0]), featurizer.feature_dim)

    @property
    def shape(self) -> tuple[int, int]:
        """``(n, feature_dim)``."""
        return (int(self.factored.shape[0]), self.featurizer.feature_dim)

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError(f"FactoredRows supports step-1 row slices only, got {key!r}.")
        rows = torch.from_numpy(np.ascontiguousarray(np.asarray(self.factored[key])))
        # A sum is finite when every entry is (NaN and inf survive it); only a sum
        # that is not (or overflows) pays for isfinite's boolean copy of the rows:
        # 0.03 s against 0.6 per 8 GPT-2 rows of one block (one Xeon core).
        if not math.isfinite(float(rows.sum())) and not bool(torch.isfinite(rows).all()):
            bad = np.nonzero(~torch.isfinite(rows).all(1).numpy())[0]
            start = key.indices(self.shape[0])[0]
            raise ValueError(
                f"stored factored rows {(bad[:5] + start).tolist()} are not finite, so their "
                "dense features cannot be formed; featurize them again (delete the "
                "checkpoint's store folder or use a new model_id)."
            )
        dense = self.featurizer.expand_rank_one(
            rows, sampled=self.sampled, bases=self.bases, tokens=self.tokens
        )
        return dense.numpy()

    def rotated(self, bases: Sequence[KroneckerEigenbasis | None]) -> FactoredRows:
        """The same rows in per-layer eigenbases: rows ``vec(Q_Sᵀ G Q_A)`` (``None``: as stored)."""
        return FactoredRows(
            self.factored, self.featurizer, tokens=self.tokens, sampled=self.sampled, bases=bases
        )
