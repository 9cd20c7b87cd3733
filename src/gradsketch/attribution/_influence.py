"""Curvature-aware influence (K-FAC, EK-FAC, identity) in TRAKer's featurize / score flow.

For every Linear, Conv2d and Hugging Face ``Conv1D`` layer (any type with a
rule in the layer-factor registry, :func:`register_layer_factors`) one
hooked forward and backward per batch gives the inputs ``a [B, T, d_in]`` and
the gradients ``g [B, T, d_out]`` of the task's output function (TRAK's
margin) at the layer's outputs. The per-example gradient of the layer is
``G = sum_t g_t a_tᵀ`` (bias: an extra input fixed at 1), and influence of
training example ``i`` on query ``q`` is, summed over layers,

    score[i, q] = Q_i * ∇f(z_q)ᵀ (H + λI)⁻¹ ∇f(z_i)

where ``Q_i ∇f(z_i)`` is minus the gradient of the training loss (exact for
cross-entropy: ``(1 - p_y) ∇margin = -∇loss``) and ``H`` is one of

* ``"identity"``: ``H = 0``, λ ignored: plain gradient dot products (TracIn at
  one checkpoint, Pruthi et al. 2020; Kronfluence's "identity" strategy);
* ``"kfac"``: ``H = S ⊗ A`` per layer (Martens & Grosse 2015), the factors
  fitted over the training set (see :mod:`gradsketch.attribution._kfac`);
* ``"ekfac"``: the same Kronecker eigenbasis with eigenvalues replaced by the
  diagonal of the Fisher in that basis (George et al. 2018; Grosse et al.,
  "Studying large language model generalization with influence functions",
  2023).

``curvature`` chooses which per-example gradients ``H`` is the second moment
of: ``"loss"`` (the empirical Fisher of the training loss, weights ``Q_i²``),
``"output"`` (the Gram of the output-function gradients, TRAK's ``XᵀX`` made
Kronecker) or ``"sampled"`` (the true Fisher, Kronfluence's default: the
output gradients are those of the training loss with each example's label,
or each predicted token, replaced by one drawn from the model's own
predictive distribution, ``E_ŷ[∇ℓ(ŷ)∇ℓ(ŷ)ᵀ] = Σ_c p_c ∇ℓ(c)∇ℓ(c)ᵀ``, the
Gauss-Newton matrix of softmax cross-entropy). The draws are reproducible:
a uniform hashed from ``(sample_seed, checkpoint id, row, position)``
inverts the softmax's CDF (:func:`gradsketch.attribution._fisher.draw_labels`),
so a row's label does not depend on its batch; each draw is exact up to the
2⁻³² grid of the uniform. The sampled loss shares the hooked forward and
costs one more backward per batch; for EK-FAC the sampled-label gradients
are stored beside the training gradients (``fisher_grads``, as many numbers
again) for the eigenvalue correction. Tasks that can sample are those in
:data:`gradsketch.attribution._fisher.SAMPLED_LOSSES` (classification,
language modeling; add one with ``register_sampled_loss``); others are
refused. The EK-FAC correction is computed from the stored gradients in
:meth:`InfluenceComputer.finalize_features`, so fitting takes one pass over
the training data (Kronfluence takes two).

Language models (task ``"language_modeling"``). Influence differentiates the
sequence's summed log-likelihood ``f = Σ_t log p(y_t | y_<t)`` with ``Q = 1``
instead of TRAK's summed log-odds (see
:mod:`gradsketch.attribution._fisher`): per-token gradients are summed into
the per-sequence gradient ``G = Σ_t g_t a_tᵀ`` by the one backward, the
training feature is then exactly minus the sequence's loss gradient, and a
query's score is the first-order change of its log-likelihood (the LM demo's
LDS measurement). Positions with label ``-100`` are not predicted and add
nothing to ``f``; padded positions still enter ``A``'s mean over tokens.
GPT-2's ``lm_head`` is a Linear whose weight is tied to the token
embedding; it is factored like any Linear (its inputs are the final hidden
states, its output gradients the logits'), so its block is the head's part
of the tied weight's gradient and the embedding's part is left out, which is
what Kronfluence computes after converting ``Conv1D`` to Linear. On the
benchmark's GPT-2 it adds LDS (see ``benchmarks/bench_influence.py``,
``"without lm_head"``); leave it out with ``grad_wrt`` (the parameter names
without ``transformer.wte.weight``; ``"lm_head.weight"`` names it).

Featurization stores the per-layer gradients ``vec(G)`` (``d_out * (d_in + 1)``
numbers per layer) and accumulates the factors; nothing larger than one
layer's gradient is formed per example. For wide layers, ``projection=(k_in,
k_out)`` projects inputs and output gradients per layer with the Gaussian
factors of :class:`gradsketch.sketch.FactorizedProjector` (scaled by
``1/sqrt(k)`` so inner products are kept in expectation) *before* anything
else: the stored gradients are ``P_out G P_inᵀ`` (``k_out * k_in`` numbers)
and the factors ``P_in A P_inᵀ``, ``P_out S P_outᵀ`` are ``k x k`` (LoGra:
Choe et al., "What is your data worth to GPT?", 2024). Damping ``"auto"`` is
a tenth of the mean eigenvalue of each layer's curvature (Kronfluence's
default heuristic; Grosse et al. 2023).

Only the factored layers enter the scores (as in Kronfluence); embeddings and
norms are left out.

Which method when. Measured with ``benchmarks/bench_influence.py`` (digits
MLP 64-32-10, 1,000 training rows, 100 targets, margin, LDS over 40 models
retrained on random halves, 3 checkpoints; one thread of a shared 2-core
EPYC under heavy load, so the times are indicative):

=============================  =====  =====  ==========
method                          LDS    top-5  fit+score
=============================  =====  =====  ==========
``"ekfac"``                     0.467  0.97     2.4 s
``"kfac"``                      0.464  0.95     0.9 s
``"ekfac"``, 1 checkpoint       0.448  0.91     1.1 s
``"ekfac"``, projection 16x16   0.422  0.96     1.1 s
``"ekfac"``, curvature output   0.430  0.83     2.5 s
``"identity"``                  0.375  0.95     1.0 s
TRAK, k=512, ``"auto"``         0.320  0.40     1.4 s
``bayesian_influence``          0.385  0.95    34 s
Kronfluence EK-FAC (1.0.1)      0.414  0.85    38 s
Kronfluence K-FAC               0.296  0.62    24 s
Kronfluence identity            0.375  0.95    13 s
=============================  =====  =====  ==========

(top-5: fraction of each target's five strongest proponents that share its
label.) With ``curvature="sampled"`` (same run conditions, another session):
``"ekfac"`` 0.472 (0.467 with ``"loss"``), ``"kfac"`` 0.470 (0.464).

GPT-2 protocol of the same benchmark (the LM demo's 2-layer, width-64
byte-level GPT-2, 512 standard-library chunks, 64 queries, measurement the
summed log-likelihood, LDS over 20 models retrained on random halves, 3
checkpoints; one thread, load average 1.9-3.4 on 2 cores):

====================================================  =====  ==========
method                                                 LDS   fit+score
====================================================  =====  ==========
``"kfac"``, ``"sampled"``, projection 32x32            0.379    4.4 s
``"kfac"``, ``"sampled"``                              0.371   10.8 s
``"ekfac"``, ``"sampled"``, projection 32x32           0.371    4.6 s
``"ekfac"``, ``"sampled"``                             0.369   16.9 s
``"kfac"``, ``"loss"``                                 0.361    8.4 s
``"ekfac"``, ``"loss"``, projection 32x32              0.349    2.9 s
``"ekfac"``, ``"loss"``                                0.345   14.7 s
``"ekfac"``, ``"loss"``, without ``lm_head``           0.336   12.5 s
``"identity"``                                         0.329    6.4 s
``"kfac"``, ``"sampled"``, 1 checkpoint                0.341    3.4 s
TRAK, k=512, ``"auto"`` (3 / 1 checkpoints)            0.158    3.9 s
``bayesian_influence``, 1 checkpoint, 2 x 50 draws *   0.16    78 s
Kronfluence identity (1.0.1)                           0.329    5.5 s
Kronfluence K-FAC                                      0.324   11.7 s
Kronfluence EK-FAC                                     0.319   17.2 s
Kronfluence identity, 1 checkpoint                     0.308    1.8 s
====================================================  =====  ==========

(* another run, load average about 7.) Every method differentiates each
training row at each checkpoint, so none can take much less than one
forward and backward of the training set per checkpoint, which is about
what Kronfluence's identity strategy costs: the best curvature method here
is 0.05 above it in 0.8 times its time, and 0.06 above Kronfluence's
EK-FAC in a quarter of its time.

Damping (the fraction of each layer's mean eigenvalue; ``"auto"`` is 0.1),
3 checkpoints: unprojected ``"kfac"``/``"sampled"`` rises from 0.371 to
0.394 at 1.0; projected 32x32 it is flat (0.377, 0.379, 0.377, 0.373, 0.358
at 0.03, 0.1, 0.3, 1, 3); projected ``"ekfac"``/``"sampled"`` 0.370 at 0.3,
0.373 at 1. On one checkpoint, 1.0 lifts ``"kfac"``/``"sampled"`` from 0.341
to 0.369 and ``"ekfac"``/``"sampled"`` from 0.333 to 0.355; 0.01 lowers both
(0.327, 0.322). Kronfluence was run at its default (0.1).

* Use ``"ekfac"`` (or ``"kfac"``, nearly as good and cheaper to finalize)
  whenever the model's weights sit in Linear / Conv2d / ``Conv1D`` layers and
  one stored row per training example (``sum_l d_out (d_in + 1)`` numbers)
  fits on disk; one checkpoint already beats every other method here, and
  each further checkpoint adds a little for its featurization cost.
* Wide layers or many training rows: ``projection=(k, k)`` keeps rows at
  ``k²`` per layer and factors at ``k x k``; it costs LDS (here -0.045 at a
  projection that barely compresses), so take ``k`` as large as the disk allows.
* Language models: ``curvature="sampled"`` (the true Fisher) with
  ``"kfac"``, projected per layer; the sampled Fisher costs one more backward
  per batch (and, for ``"ekfac"``, a second stored row per example).
* ``"identity"`` only as a baseline, or when curvature cannot be fitted.
* :func:`gradsketch.slt.bayesian_influence` for architectures without
  factored layers, or when per-example gradients are unavailable: it needs
  only forward passes, but many draws (its cost grows with draws x rows).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge
from tqdm.auto import tqdm

from gradsketch._hash import derive_key
from gradsketch._settings import SettingsMismatchError, read_record, write_record
from gradsketch._store import RowStore, default_chunk_rows
from gradsketch.attribution._distributed import rank_and_world
from gradsketch.attribution._fisher import (
    INFLUENCE_OUTPUTS,
    SAMPLED_LOSSES,
    draw_labels,
    find_task_entry,
)
from gradsketch.attribution._hook_computer import refuse_wrapped
from gradsketch.attribution._kfac import (
    KroneckerEigen,
    KroneckerFactors,
    add_bias_input,
    resolve_damping,
)
from gradsketch.attribution._layers import LAYER_FACTORS, register_optional_rules
from gradsketch.attribution._modelout import (
    LOSS_GRAD_FROM_OUTPUT,
    AbstractModelOutput,
    resolve_batch_output,
    resolve_task,
)
from gradsketch.sketch import FactorizedLayer, FactorizedProjector

__all__ = [
    "CURVATURES",
    "INFLUENCE_METHODS",
    "InfluenceComputer",
    "InfluenceSettings",
]

logger = logging.getLogger(__name__)

#: Preconditioners of :class:`InfluenceComputer` (``TRAKer(method=...)`` also takes ``"trak"``).
INFLUENCE_METHODS = ("identity", "kfac", "ekfac")
#: Whose second moment the curvature is (see the module docstring).
CURVATURES = ("loss", "output", "sampled")
# Stream of the sampled labels' keys (see gradsketch._hash.derive_key).
_SAMPLE_STREAM = 0x5A3F
_DTYPES = ("float32", "float64")


# -- layers ----------------------------------------------------------------------
@dataclass
class _Layer:
    """A factored layer: its module, parameters and (projected) gradient shape."""

    name: str
    module: nn.Module
    bias: bool
    d_in: int  # inputs per position, with the bias column
    d_out: int
    k_in: int  # stored input side (d_in without projection)
    k_out: int
    offset: int = 0

    @property
    def width(self) -> int:
        return self.k_out * self.k_in


def _layer_dims(module: nn.Module) -> tuple[int, int]:
    """``(d_in, d_out)`` of a factored module (Conv2d: ``C_in kh kw``, ``C_out``)."""
    if isinstance(module, nn.Conv2d):
        kh, kw = module.kernel_size
        return module.in_channels * kh * kw, module.out_channels
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    weight = module.weight
    assert isinstance(weight, Tensor)
    return int(weight.shape[0]), int(weight.shape[1])  # Conv1D: [d_in, d_out]


def find_layers(
    model: nn.Module,
    grad_wrt: Sequence[str] | None,
    projection: tuple[int, int] | None,
) -> list[_Layer]:
    """The modules with a layer-factor rule whose weight is differentiated, in model order."""
    register_optional_rules(model)  # Hugging Face's Conv1D, once transformers is loaded
    wanted = None if grad_wrt is None else set(grad_wrt)
    layers: list[_Layer] = []
    offset = 0
    for name, module in model.named_modules():
        if type(module) not in LAYER_FACTORS:
            continue
        if isinstance(module, nn.Conv2d) and module.groups != 1:
            logger.info("influence: Conv2d %r has groups=%d; left out", name, module.groups)
            continue
        prefix = f"{name}." if name else ""
        weight_name = prefix + "weight"
        if wanted is not None and weight_name not in wanted:
            continue
        bias_param = getattr(module, "bias", None)
        bias = isinstance(bias_param, Tensor) and (wanted is None or prefix + "bias" in wanted)
        d_in, d_out = _layer_dims(module)
        d_in += int(bias)
        k_in, k_out = (d_in, d_out) if projection is None else projection
        layer = _Layer(name, module, bias, d_in, d_out, min(k_in, d_in), min(k_out, d_out))
        layer.offset = offset
        offset += layer.width
        layers.append(layer)
    if not layers:
        allowed = ", ".join(sorted(t.__name__ for t in LAYER_FACTORS))
        raise ValueError(
            f"the model has no differentiated layer of a factored type ({allowed}); K-FAC "
            "influence needs at least one. Check `grad_wrt`, register your layer type with "
            "@register_layer_factors, or use bayesian_influence."
        )
    return layers


def capture_layers(
    model: nn.Module,
    layers: Sequence[_Layer],
    batch_output: Any,
    batch: Sequence[Any],
    sampled_loss: Any = None,
) -> tuple[dict[str, tuple[Tensor, Tensor, Tensor | None]], Any]:
    """One hooked forward, and a backward of ``F = sum_b f(z_b)``.

    With ``sampled_loss`` (``fn(model_output) -> [B]``, the output kept in the
    graph), a second backward of its sum gives the layers' output gradients
    under sampled labels (the true Fisher's); the forward is shared.

    Returns:
        ``{layer name: (a [B, T, d_in], g [B, T, d_out], g_sampled or None)}``
        (inputs detached; a layer called twice has its calls' positions
        concatenated) and the root module's (detached) output.
    """
    calls: dict[str, list[tuple[tuple[Any, ...], Any, Tensor]]] = {x.name: [] for x in layers}
    root: list[Any] = []
    dummy: dict[tuple[torch.dtype, torch.device], Tensor] = {}

    def make_hook(layer: _Layer) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            if not isinstance(output, Tensor):
                raise TypeError(
                    f"layer {layer.name!r} ({type(module).__name__}) returned "
                    f"{type(output).__name__}; factored layers must return one tensor."
                )
            routed = output
            if not output.requires_grad:
                # Frozen weights and inputs so far: a zero that requires grad
                # gives the output a gradient edge.
                key = (output.dtype, output.device)
                if key not in dummy:
                    dummy[key] = torch.zeros(
                        (), dtype=output.dtype, device=output.device, requires_grad=True
                    )
                routed = output + dummy[key]
            args_d = tuple(t.detach() if isinstance(t, Tensor) else t for t in args)
            # The edge is taken now, before a caller's in-place op changes the value.
            calls[layer.name].append((args_d, get_gradient_edge(routed), output.detach()))
            return routed if routed is not output else None

        return hook

    handles = [x.module.register_forward_hook(make_hook(x)) for x in layers]
    handles.append(
        model.register_forward_hook(
            lambda m, args, out: root.append(
                out if isinstance(out, Tensor) else getattr(out, "logits", out)
            )
        )
    )
    try:
        with torch.enable_grad():
            outputs = batch_output(model, *batch)
            flat = [(x.name, i) for x in layers for i in range(len(calls[x.name]))]
            edges = [calls[n][i][1] for n, i in flat]
            grads = torch.autograd.grad(
                outputs.sum(), edges, allow_unused=True, retain_graph=sampled_loss is not None
            )
            sampled: Sequence[Tensor | None] = [None] * len(flat)
            if sampled_loss is not None:
                if len(root) != 1:
                    raise RuntimeError(
                        "curvature='sampled' needs the model's output from one forward call; "
                        f"the model was called {len(root)} times for one batch."
                    )
                sampled = torch.autograd.grad(sampled_loss(root[0]).sum(), edges, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    by_call = dict(zip(flat, grads))
    by_call_sampled = dict(zip(flat, sampled))
    result: dict[str, tuple[Tensor, Tensor, Tensor | None]] = {}
    for layer in layers:
        rule = LAYER_FACTORS[type(layer.module)]
        parts_a, parts_g, parts_s = [], [], []
        for i, (args, _, out) in enumerate(calls[layer.name]):
            g = by_call[(layer.name, i)]
            a3, g3 = rule(layer.module, args, torch.zeros_like(out) if g is None else g)
            parts_a.append(a3.detach())
            parts_g.append(g3.detach())
            if sampled_loss is not None:
                gs = by_call_sampled[(layer.name, i)]
                _, gs3 = rule(layer.module, args, torch.zeros_like(out) if gs is None else gs)
                parts_s.append(gs3.detach())
        if not parts_a:
            raise RuntimeError(
                f"layer {layer.name!r} was not called in the forward; influence needs every "
                "factored layer to run. Pass grad_wrt without its parameters."
            )
        result[layer.name] = (
            torch.cat(parts_a, 1),
            torch.cat(parts_g, 1),
            torch.cat(parts_s, 1) if parts_s else None,
        )
    if len(root) != 1:
        return result, None
    return result, (root[0].detach() if isinstance(root[0], Tensor) else root[0])


# -- settings --------------------------------------------------------------------
@dataclass
class InfluenceSettings:
    """What determines an influence store; saved as ``settings.json`` in ``save_dir``.

    Attributes:
        method: ``"identity"``, ``"kfac"`` or ``"ekfac"``.
        train_set_size: number of training rows n.
        curvature: ``"loss"`` (empirical Fisher), ``"output"`` (Gram of the
            output gradients) or ``"sampled"`` (true Fisher, labels drawn from
            the model).
        sample_seed: seed of the sampled labels (``curvature="sampled"``).
        projection: ``[k_in, k_out]`` of the per-layer projection, or ``None``
            (exact per-layer gradients).
        projection_seed: seed of the projection factors.
        layers: the factored layers' names.
        feature_dim: stored numbers per row (sum over layers of ``k_out * k_in``).
        model: fingerprint of the architecture.
        task: the model output class.
        grad_wrt: differentiated parameters (``None``: all).
        dtype: storage dtype of the gradients.
    """

    method: str
    train_set_size: int
    curvature: str = "loss"
    sample_seed: int = 0
    projection: list[int] | None = None
    projection_seed: int = 0
    layers: list[str] = field(default_factory=list)
    feature_dim: int = 0
    model: str = ""
    task: str = ""
    grad_wrt: list[str] | None = None
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.method not in INFLUENCE_METHODS:
            raise ValueError(
                f"`method` must be one of {list(INFLUENCE_METHODS)}, got {self.method!r}."
            )
        if self.curvature not in CURVATURES:
            raise ValueError(
                f"`curvature` must be one of {list(CURVATURES)}, got {self.curvature!r}."
            )
        if isinstance(self.sample_seed, bool) or not isinstance(self.sample_seed, int):
            raise ValueError(f"`sample_seed` must be an int, got {self.sample_seed!r}.")
        n = self.train_set_size
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"`train_set_size` must be a positive int, got {n!r}.")
        if self.projection is not None:
            p = list(self.projection)
            if len(p) != 2 or any(
                isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in p
            ):
                raise ValueError(
                    f"`projection` must be (k_in, k_out) positive ints or None, got "
                    f"{self.projection!r}."
                )
            self.projection = p
        if self.dtype not in _DTYPES:
            raise ValueError(f"`dtype` must be one of {list(_DTYPES)}, got {self.dtype!r}.")


def _atomic_save(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    """``np.savez`` to a temporary file, then rename: a kill never leaves a torn file."""
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, **arrays)  # type: ignore[arg-type]
    os.replace(tmp, path)


# -- the computer ------------------------------------------------------------------
class InfluenceComputer:
    """K-FAC / EK-FAC / identity influence with TRAKer's methods and store.

    The flow and the store are TRAKer's: :meth:`load_checkpoint`,
    :meth:`featurize` (or :meth:`featurize_loader`) over the training rows,
    :meth:`finalize_features` (eigendecompositions and, for EK-FAC, the
    eigenvalue correction), then per query set :meth:`start_scoring_checkpoint`,
    :meth:`score` and :meth:`finalize_scores`, which averages the checkpoints'
    scores (an ensemble). Rows and factors resume after a crash; reopening
    ``save_dir`` with other settings is refused with both shown; fitted
    factors stay in the store and serve every later query set. Reach it as
    ``TRAKer(..., method="ekfac")`` or directly. See the module docstring for
    the maths and for which method to use when.

    Args:
        model: the model (plain, not DDP / FSDP wrapped).
        task: a task name or an :class:`AbstractModelOutput` with a batched output.
        train_set_size: number of training rows n.
        save_dir: directory of the store.
        method: ``"identity"``, ``"kfac"`` or ``"ekfac"``.
        damping: λ >= 0 for every layer, or ``"auto"`` (a tenth of each layer's
            mean eigenvalue); used at scoring, so one store serves several.
        curvature: ``"loss"``, ``"output"`` or ``"sampled"`` (see the module
            docstring).
        sample_seed: seed of the labels drawn for ``curvature="sampled"``
            (with the checkpoint id and the row index: a row's draw does not
            depend on its batch).
        projection: ``(k_in, k_out)`` per-layer projection, or ``None``.
        projection_seed: seed of the projection (re-drawn per checkpoint id).
        grad_wrt: parameter names to differentiate (``None``: all).
        load_from_save_dir: resume rows already in ``save_dir``.
        device: where gradients are computed.
        dtype: ``torch.float32`` or ``torch.float64`` storage.
        chunk_rows: rows per chunk of the stored gradients.
        progress: show tqdm bars.

    Example:
        >>> import tempfile
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(),
        ...                             torch.nn.Linear(5, 3))
        >>> x, y = torch.randn(12, 4), torch.arange(12) % 3
        >>> ic = InfluenceComputer(model, "image_classification", 12, tempfile.mkdtemp(),
        ...                        method="ekfac", progress=False)
        >>> ic.load_checkpoint(model.state_dict(), model_id=0)
        >>> ic.featurize((x, y), num_samples=12)
        >>> ic.finalize_features()
        >>> ic.start_scoring_checkpoint("test", model.state_dict(), model_id=0, num_targets=2)
        >>> ic.score((x[:2], y[:2]), num_samples=2)
        >>> ic.finalize_scores("test").shape
        (12, 2)
    """

    def __init__(
        self,
        model: nn.Module,
        task: AbstractModelOutput | str,
        train_set_size: int,
        save_dir: str | Path,
        *,
        method: str = "ekfac",
        damping: float | str = "auto",
        curvature: str = "loss",
        sample_seed: int = 0,
        projection: tuple[int, int] | None = None,
        projection_seed: int = 0,
        grad_wrt: Iterable[str] | None = None,
        load_from_save_dir: bool = True,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        chunk_rows: int | None = None,
        progress: bool = True,
    ) -> None:
        from gradsketch.attribution._traker import model_fingerprint

        _, world = rank_and_world()
        if world > 1:
            raise RuntimeError(
                f"influence methods run in one process (this is a torch.distributed group of "
                f"{world}); run them on rank 0 only, or use method='trak' for sharded work."
            )
        refuse_wrapped(model)
        resolve_damping(damping, torch.ones(1))  # validates
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(
                f"`dtype` must be torch.float32 or torch.float64, got {dtype!r}; influence "
                "gradients are not stored in half precision (their squares feed EK-FAC)."
            )
        self.model = model
        self.task = resolve_task(task)
        override = find_task_entry(INFLUENCE_OUTPUTS, self.task)
        self._batch_output = resolve_batch_output(self.task) if override is None else override[0]
        self._q_from_output = (
            LOSS_GRAD_FROM_OUTPUT.get(type(self.task)) if override is None else override[1]
        )
        self._sampled_loss = find_task_entry(SAMPLED_LOSSES, self.task)
        if curvature == "sampled" and self._sampled_loss is None:
            able = ", ".join(sorted(t.__name__ for t in SAMPLED_LOSSES))
            raise ValueError(
                f"`curvature`='sampled' draws labels from the model's predictions, which task "
                f"{type(self.task).__name__} does not define (tasks that can: {able}). Pass "
                "curvature='loss' or 'output', or register its sampled loss with "
                "@gradsketch.attribution.register_sampled_loss(YourTask)."
            )
        self.train_set_size = int(train_set_size)
        self.method = method
        self.damping = damping
        self.device = torch.device(device)
        self.dtype = dtype
        self.progress = progress
        self.load_from_save_dir = bool(load_from_save_dir)
        self.grad_wrt = None if grad_wrt is None else list(grad_wrt)
        if self.grad_wrt is not None:
            names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
            unknown = [n for n in self.grad_wrt if n not in names]
            if unknown:
                raise ValueError(
                    f"`grad_wrt` names {unknown} are not parameters of the model; allowed names "
                    f"are {names[:20]}."
                )
        proj = None if projection is None else (int(projection[0]), int(projection[1]))
        self.settings = InfluenceSettings(
            method=method,
            train_set_size=self.train_set_size,
            curvature=curvature,
            sample_seed=sample_seed,
            projection=None if proj is None else list(proj),
            projection_seed=int(projection_seed),
            model=model_fingerprint(model),
            task=type(self.task).__name__,
            grad_wrt=self.grad_wrt,
            dtype=str(dtype).removeprefix("torch."),
        )
        self.layers = find_layers(model, self.grad_wrt, proj)
        self.settings.layers = [x.name for x in self.layers]
        self.feature_dim = sum(x.width for x in self.layers)
        self.settings.feature_dim = self.feature_dim
        self._projector = self._build_projector(proj, int(projection_seed))
        self.save_dir = Path(save_dir).resolve()
        self.store = RowStore(self.save_dir, self.settings, what="influence store")
        if chunk_rows is not None and (
            isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1
        ):
            raise ValueError(f"`chunk_rows` must be a positive int or None, got {chunk_rows!r}.")
        self._chunk_rows = chunk_rows or default_chunk_rows((self.feature_dim,), self._np_dtype)
        self.ckpt_loaded: int | None = None
        self._done: np.ndarray | None = None
        self._factors: list[KroneckerFactors] | None = None
        self._covered: np.ndarray | None = None
        self._rows_since_save = 0
        self._last_ind = 0
        self._exp: str | None = None
        self._exp_model_id: int | None = None
        self._exp_done: np.ndarray | None = None
        self._exp_num_targets = 0
        self._last_ind_target = 0
        self.scores: Any = None

    # -- set-up ------------------------------------------------------------------
    @property
    def _stores_fisher_grads(self) -> bool:
        """EK-FAC with the sampled Fisher keeps each row's sampled-label gradient too."""
        return self.method == "ekfac" and self.settings.curvature == "sampled"

    @property
    def _np_dtype(self) -> Any:
        return np.float64 if self.dtype == torch.float64 else np.float32

    def _build_projector(self, proj: tuple[int, int] | None, seed: int) -> Any:
        if proj is None:
            return None
        params = dict(self.model.named_parameters(remove_duplicate=False))
        segments = []
        for x in self.layers:
            prefix = f"{x.name}." if x.name else ""
            names = (prefix + "weight",) + ((prefix + "bias",) if x.bias else ())
            assert all(n in params for n in names)
            segments.append(
                FactorizedLayer(
                    name=x.name,
                    param_names=names,
                    d_in=x.d_in - int(x.bias),
                    d_out=x.d_out,
                    bias=x.bias,
                    k_in=x.k_in,
                    k_out=x.k_out,
                )
            )
        return FactorizedProjector(segments, seed, self.device)

    def _ckpt(self, model_id: int) -> str:
        return f"checkpoints/{int(model_id)}"

    def _ckpt_record(self, model_id: int) -> dict[str, Any]:
        path = self.save_dir / self._ckpt(model_id) / "checkpoint.json"
        return read_record(path) if path.exists() else {}

    def _write_ckpt_record(self, model_id: int, record: Mapping[str, Any]) -> None:
        path = self.save_dir / self._ckpt(model_id) / "checkpoint.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_record(path, record)

    @property
    def model_ids(self) -> list[int]:
        """Checkpoints present in the store."""
        root = self.save_dir / "checkpoints"
        if not root.exists():
            return []
        return sorted(int(p.name) for p in root.iterdir() if (p / "checkpoint.json").exists())

    def _load_weights(self, checkpoint: Mapping[str, Any], model_id: int) -> None:
        self.model.load_state_dict(checkpoint)
        self.model.eval()
        if self._projector is not None:
            self._projector.set_model_id(int(model_id))

    def _factors_path(self, model_id: int) -> Path:
        return self.save_dir / self._ckpt(model_id) / "factors.npz"

    def load_checkpoint(self, checkpoint: Mapping[str, Any], model_id: int) -> None:
        """Load a checkpoint for featurizing; resumes rows and factors stored for ``model_id``.

        Raises:
            SettingsMismatchError: ``model_id`` was featurized from other weights.
        """
        from gradsketch.attribution._traker import checkpoint_fingerprint

        self._save_factors()  # the previous checkpoint's, before they are replaced
        sha = checkpoint_fingerprint(checkpoint)
        n, base = self.train_set_size, self._ckpt(model_id)
        record = self._ckpt_record(model_id)
        if record and record.get("checkpoint") != sha:
            raise SettingsMismatchError(
                f"model id {model_id} in `{self.save_dir}` was featurized from a checkpoint with "
                f"fingerprint {record.get('checkpoint')!r}, but the given checkpoint has {sha!r}. "
                "Use a new model_id for new weights, or another save_dir."
            )
        fresh = not record or not self.load_from_save_dir
        if fresh:
            self._write_ckpt_record(model_id, {"checkpoint": sha, "finalized": False})
        self.store.require_array(
            f"{base}/grads", (n, self.feature_dim), self._np_dtype, chunk_rows=self._chunk_rows
        )
        self.store.require_array(
            f"{base}/out_to_loss", (n, 1), np.float64, chunk_rows=self._chunk_rows
        )
        if self._stores_fisher_grads:
            self.store.require_array(
                f"{base}/fisher_grads",
                (n, self.feature_dim),
                self._np_dtype,
                chunk_rows=self._chunk_rows,
            )
        self.store.require_done(f"{base}/done", n, chunk_rows=self._chunk_rows)
        if fresh:
            self.store.array(f"{base}/done")[:] = np.zeros(n, dtype=np.uint8)
            self._factors_path(model_id).unlink(missing_ok=True)
        self._done = self.store.done_rows(f"{base}/done")
        self._factors, self._covered = self._read_factors(model_id)
        if self._done.any() or self._covered.any():
            logger.info(
                "model id %d: resuming, %d of %d rows featurized, %d in the factors",
                model_id,
                int(self._done.sum()),
                n,
                int(self._covered.sum()),
            )
        self._load_weights(checkpoint, model_id)
        self.ckpt_loaded = int(model_id)
        self._last_ind = 0
        self._rows_since_save = 0

    def _read_factors(self, model_id: int) -> tuple[list[KroneckerFactors], np.ndarray]:
        path = self._factors_path(model_id)
        if not path.exists():
            empty = [
                KroneckerFactors.zeros(x.k_in, x.k_out, device=str(self.device))
                for x in self.layers
            ]
            return empty, np.zeros(self.train_set_size, dtype=bool)
        with np.load(path) as z:
            factors = [
                KroneckerFactors(
                    torch.from_numpy(z[f"a_sum_{i}"]).to(self.device),
                    torch.from_numpy(z[f"g_sum_{i}"]).to(self.device),
                    int(z["tokens"][i]),
                    int(z["examples"][i]),
                )
                for i in range(len(self.layers))
            ]
            return factors, z["covered"].astype(bool)

    def _save_factors(self) -> None:
        """Write the factors and the rows they cover, if rows were added since the last write."""
        if self.ckpt_loaded is None or self._factors is None or self._covered is None:
            return
        if not self._rows_since_save:
            return
        arrays: dict[str, np.ndarray] = {"covered": self._covered.astype(np.uint8)}
        for i, f in enumerate(self._factors):
            arrays[f"a_sum_{i}"] = f.a_sum.cpu().numpy()
            arrays[f"g_sum_{i}"] = f.g_sum.cpu().numpy()
        arrays["tokens"] = np.array([f.tokens for f in self._factors], dtype=np.int64)
        arrays["examples"] = np.array([f.examples for f in self._factors], dtype=np.int64)
        _atomic_save(self._factors_path(self.ckpt_loaded), arrays)
        self._rows_since_save = 0

    # -- per-batch work ----------------------------------------------------------------
    def _layer_inputs(
        self, batch: Sequence[Any], rows: np.ndarray | None = None
    ) -> tuple[list[tuple[Tensor, Tensor, Tensor | None]], Tensor]:
        """Per layer the stored-side ``(a, g, g_sampled)`` (bias column, projection), and Q.

        ``g_sampled`` (output gradients of the loss under labels drawn from the
        model) is computed when ``rows`` (the batch's row indices, which seed
        the draws) is given and the curvature is ``"sampled"``; else ``None``.
        """
        sampled_loss = None
        if rows is not None and self.settings.curvature == "sampled":
            assert self.ckpt_loaded is not None
            key = derive_key(self.settings.sample_seed, self.ckpt_loaded, _SAMPLE_STREAM)
            index = torch.as_tensor(rows, dtype=torch.int64)
            rule, task = self._sampled_loss, self.task

            def draw(logits: Tensor) -> Tensor:
                return draw_labels(logits, index, key)

            def sampled_loss(output: Any) -> Tensor:
                return rule(task, output, batch, draw)

        caps, root = capture_layers(
            self.model, self.layers, self._batch_output, batch, sampled_loss
        )
        work = self.dtype
        out = []
        for x in self.layers:
            a, g, gs = caps[x.name]
            a, g = a.to(work), g.to(work)
            gs = None if gs is None else gs.to(work)
            if x.bias:
                a = add_bias_input(a)
            if self._projector is not None:
                p_out, p_in = self._projector.factor_matrices(x.name, work)
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

    def _features(self, parts: Sequence[tuple[Tensor, Tensor]]) -> Tensor:
        """``[B, feature_dim]``: each layer's ``vec(sum_t g_t a_tᵀ)``, in layer order."""
        blocks = [torch.bmm(g.transpose(1, 2), a).reshape(a.shape[0], -1) for a, g in parts]
        return torch.cat(blocks, dim=1)

    # -- featurizing ----------------------------------------------------------------------
    def featurize(
        self, batch: Sequence[Any], inds: Any = None, num_samples: int | None = None
    ) -> None:
        """Store the per-layer gradients and Q of a batch of training rows; fit the factors.

        Rows already stored are not recomputed, and rows already in the stored
        factors are not added twice (both resume independently).

        Args:
            batch: tuple of ``[B, ...]`` tensors, as the task expects.
            inds: ``[B]`` row indices in the training set.
            num_samples: ``B``, when rows follow the previous batch.
        """
        from gradsketch.attribution._traker import ModelIDException, _resolve_inds

        if self.ckpt_loaded is None or self._done is None or self._covered is None:
            raise ModelIDException(
                "no checkpoint loaded; call load_checkpoint(state_dict, model_id) before featurize."
            )
        idx = _resolve_inds(inds, num_samples, self._last_ind, self.train_set_size, "featurize")
        if num_samples is not None:
            self._last_ind += int(num_samples)
        need_rows = ~self._done[idx]
        need_factors = (
            ~self._covered[idx] if self.method != "identity" else np.zeros_like(need_rows)
        )
        todo = need_rows | need_factors
        if not todo.any():
            return
        if not todo.all():
            keep = torch.as_tensor(np.nonzero(todo)[0])
            batch = tuple(t.index_select(0, keep.to(t.device)) for t in batch)
            idx, need_rows, need_factors = idx[todo], need_rows[todo], need_factors[todo]
        sampled = self.method != "identity" and self.settings.curvature == "sampled"
        parts, q = self._layer_inputs(batch, idx if sampled else None)
        if need_factors.any():
            assert self._factors is not None
            sel = torch.as_tensor(np.nonzero(need_factors)[0], device=q.device)
            weight = q.index_select(0, sel).abs() if self.settings.curvature == "loss" else None
            for f, (a, g, g_sampled) in zip(self._factors, parts):
                g = g if g_sampled is None else g_sampled
                gs = g.index_select(0, sel)
                if weight is not None:
                    gs = gs * weight.to(gs.device, gs.dtype).reshape(-1, 1, 1)
                f.update(a.index_select(0, sel), gs)
            self._covered[idx[need_factors]] = True
            self._rows_since_save += int(need_factors.sum())
            if self._rows_since_save >= max(self._chunk_rows, self.train_set_size // 10):
                self._save_factors()
        if need_rows.any():
            rows = np.nonzero(need_rows)[0]
            keep = torch.as_tensor(rows)
            phi = self._features([(a, g) for a, g, _ in parts])[keep]
            base = self._ckpt(self.ckpt_loaded)
            arrays = {
                f"{base}/grads": phi.detach().cpu().numpy().astype(self._np_dtype),
                f"{base}/out_to_loss": q[keep].cpu().numpy().reshape(-1, 1),
            }
            if self._stores_fisher_grads:
                fisher = self._features([(a, gs) for a, _, gs in parts if gs is not None])[keep]
                arrays[f"{base}/fisher_grads"] = fisher.cpu().numpy().astype(self._np_dtype)
            self.store.write_rows(
                idx[rows],
                arrays,
                done=f"{base}/done",
                background=True,
            )
            self._done[idx[rows]] = True

    def featurize_loader(self, loader: Iterable[Sequence[Any]]) -> None:
        """Featurize every batch of ``loader`` in order (rows follow each other)."""
        for batch in tqdm(loader, desc="featurizing (influence)", disable=not self.progress):
            self.featurize(batch, num_samples=int(batch[0].shape[0]))
        self._save_factors()
        self.store.flush()

    # -- finalizing ---------------------------------------------------------------------
    def _curvature_path(self, model_id: int) -> Path:
        return self.save_dir / self._ckpt(model_id) / "curvature.npz"

    def finalize_features(
        self, model_ids: Iterable[int] | None = None, del_grads: bool = False
    ) -> None:
        """Eigendecompose each checkpoint's factors; for EK-FAC, correct the eigenvalues.

        The correction is one pass over the stored gradients: rotated to the
        Kronecker eigenbasis, squared, weighted as the factors were and averaged.
        ``del_grads`` must be ``False`` (the training gradients are the features).
        """
        from gradsketch.attribution._traker import ModelIDException

        if del_grads:
            raise ValueError(
                "`del_grads`=True is not supported by influence methods: the stored training "
                "gradients are what queries are scored against. Pass del_grads=False."
            )
        self._save_factors()
        self.store.flush()
        ids = self.model_ids if model_ids is None else [int(i) for i in model_ids]
        for model_id in tqdm(ids, desc="finalizing (influence)", disable=not self.progress):
            record = self._ckpt_record(model_id)
            if not record:
                raise ModelIDException(
                    f"model id {model_id} is not in `{self.save_dir}`; featurized ids are "
                    f"{self.model_ids}."
                )
            done = self.store.done_rows(f"{self._ckpt(model_id)}/done")
            factors, covered = self._read_factors(model_id)
            if self.method == "identity":
                covered = done
            missing = np.nonzero(~(done & covered))[0]
            if missing.size:
                raise ModelIDException(
                    f"model id {model_id} is not fully featurized: {missing.size} of {done.size} "
                    f"rows missing (first: {missing[:5].tolist()}). Featurize them, then finalize."
                )
            if record.get("finalized"):
                continue
            if self.method != "identity":
                self._write_curvature(model_id, factors)
            self._write_ckpt_record(model_id, {**record, "finalized": True})

    def _write_curvature(self, model_id: int, factors: Sequence[KroneckerFactors]) -> None:
        eigens = [f.eigen() for f in factors]
        if self.method == "kfac":
            values = [e.kfac_eigenvalues() for e in eigens]
        else:
            values = self._ekfac_values(model_id, eigens)
        arrays: dict[str, np.ndarray] = {}
        for i, (e, v) in enumerate(zip(eigens, values)):
            arrays[f"q_a_{i}"] = e.q_a.cpu().numpy()
            arrays[f"q_s_{i}"] = e.q_s.cpu().numpy()
            arrays[f"eigenvalues_{i}"] = v.cpu().numpy()
        _atomic_save(self._curvature_path(model_id), arrays)

    def _ekfac_values(self, model_id: int, eigens: Sequence[KroneckerEigen]) -> list[Tensor]:
        base = self._ckpt(model_id)
        sampled = self.settings.curvature == "sampled"
        grads = self.store.array(f"{base}/fisher_grads" if sampled else f"{base}/grads")
        q = np.asarray(self.store.array(f"{base}/out_to_loss")[:], dtype=np.float64)
        sums = [torch.zeros(x.width, dtype=torch.float64, device=self.device) for x in self.layers]
        n = self.train_set_size
        step = int(grads.chunks[0]) * max(1, 4096 // int(grads.chunks[0]))
        for start in range(0, n, step):
            stop = min(n, start + step)
            x_all = torch.as_tensor(np.asarray(grads[start:stop]), device=self.device)
            w = torch.as_tensor(q[start:stop, 0], device=self.device).to(x_all.dtype)
            for s, layer, e in zip(sums, self.layers, eigens):
                rot = _rotate(x_all[:, layer.offset : layer.offset + layer.width], layer, e)
                if self.settings.curvature == "loss":
                    rot = rot * w.reshape(-1, 1)
                s += (rot * rot).sum(0, dtype=torch.float64)
        return [s / n for s in sums]

    def _read_curvature(self, model_id: int) -> list[tuple[Tensor, Tensor, Tensor]]:
        with np.load(self._curvature_path(model_id)) as z:
            return [
                (
                    torch.from_numpy(z[f"q_a_{i}"]).to(self.device),
                    torch.from_numpy(z[f"q_s_{i}"]).to(self.device),
                    torch.from_numpy(z[f"eigenvalues_{i}"]).to(self.device),
                )
                for i in range(len(self.layers))
            ]

    # -- scoring ----------------------------------------------------------------------------
    def _exp_dir(self, exp_name: str) -> str:
        return f"experiments/{exp_name}"

    def start_scoring_checkpoint(
        self,
        exp_name: str,
        checkpoint: Mapping[str, Any],
        model_id: int,
        num_targets: int,
    ) -> None:
        """Load ``checkpoint`` to compute query gradients of experiment ``exp_name``.

        Raises:
            SettingsMismatchError: ``exp_name`` exists with another ``num_targets``.
        """
        if not exp_name or "/" in exp_name:
            raise ValueError(f"`exp_name` must be a non-empty name without '/', got {exp_name!r}.")
        if isinstance(num_targets, bool) or not isinstance(num_targets, int) or num_targets < 1:
            raise ValueError(f"`num_targets` must be a positive int, got {num_targets!r}.")
        self._save_factors()
        exp_dir = self.save_dir / self._exp_dir(exp_name)
        rec_path = exp_dir / "experiment.json"
        exp_dir.mkdir(parents=True, exist_ok=True)
        if rec_path.exists():
            stored = read_record(rec_path)
            if stored.get("num_targets") != num_targets:
                raise SettingsMismatchError(
                    f"experiment {exp_name!r} in `{self.save_dir}` has num_targets="
                    f"{stored.get('num_targets')}, requested {num_targets}. Use a new exp_name."
                )
        else:
            write_record(rec_path, {"num_targets": num_targets})
        base = f"{self._exp_dir(exp_name)}/{int(model_id)}"
        self.store.require_array(
            f"{base}/grads",
            (num_targets, self.feature_dim),
            self._np_dtype,
            chunk_rows=self._chunk_rows,
        )
        self.store.require_done(f"{base}/done", num_targets, chunk_rows=self._chunk_rows)
        self._exp_done = self.store.done_rows(f"{base}/done")
        self._load_weights(checkpoint, model_id)
        self._exp, self._exp_model_id = exp_name, int(model_id)
        self._exp_num_targets = num_targets
        self._last_ind_target = 0

    def score(self, batch: Sequence[Any], inds: Any = None, num_samples: int | None = None) -> None:
        """Compute and store the query gradients of a batch (see :meth:`featurize`)."""
        from gradsketch.attribution._traker import ModelIDException, _resolve_inds

        if self._exp is None or self._exp_model_id is None or self._exp_done is None:
            raise ModelIDException(
                "no scoring checkpoint; call start_scoring_checkpoint(...) before score."
            )
        idx = _resolve_inds(
            inds, num_samples, self._last_ind_target, self._exp_num_targets, "score"
        )
        if num_samples is not None:
            self._last_ind_target += int(num_samples)
        todo = ~self._exp_done[idx]
        if not todo.any():
            return
        if not todo.all():
            keep = torch.as_tensor(np.nonzero(todo)[0])
            batch = tuple(t.index_select(0, keep.to(t.device)) for t in batch)
            idx = idx[todo]
        parts, _ = self._layer_inputs(batch)
        base = f"{self._exp_dir(self._exp)}/{self._exp_model_id}"
        feats = self._features([(a, g) for a, g, _ in parts])
        self.store.write_rows(
            idx,
            {f"{base}/grads": feats.cpu().numpy().astype(self._np_dtype)},
            done=f"{base}/done",
            background=True,
        )
        self._exp_done[idx] = True

    def score_loader(self, loader: Iterable[Sequence[Any]]) -> None:
        """Score every batch of ``loader`` in order."""
        for batch in tqdm(loader, desc=f"queries ({self._exp})", disable=not self.progress):
            self.score(batch, num_samples=int(batch[0].shape[0]))
        self.store.flush()

    def _preconditioned(self, model_id: int, targets: Tensor) -> Tensor:
        """``(H + λI)⁻¹ g`` of every target row, layer by layer, ``[m, feature_dim]``."""
        if self.method == "identity":
            return targets
        out = torch.empty_like(targets)
        for layer, (q_a, q_s, values) in zip(self.layers, self._read_curvature(model_id)):
            block = targets[:, layer.offset : layer.offset + layer.width]
            e = KroneckerEigen(q_a=q_a, alpha=q_a.new_empty(0), q_s=q_s, s=q_s.new_empty(0))
            rot = _rotate(block, layer, e)
            lam = resolve_damping(self.damping, values)
            rot = rot / (values + lam)
            back = q_s @ rot.reshape(-1, layer.k_out, layer.k_in) @ q_a.T
            out[:, layer.offset : layer.offset + layer.width] = back.reshape(block.shape)
        return out

    def finalize_scores(
        self,
        exp_name: str,
        model_ids: Iterable[int] | None = None,
        allow_skip: bool = False,
    ) -> np.ndarray:
        """Average the checkpoints' influence scores for experiment ``exp_name``.

        Returns:
            ``[train_set_size, num_targets]`` float32 scores (positive: the
            training row raises the query's output); also saved in the store
            as ``scores/<exp_name>``.
        """
        from gradsketch.attribution._traker import ModelIDException

        self.store.flush()
        rec_path = self.save_dir / self._exp_dir(exp_name) / "experiment.json"
        if not rec_path.exists():
            raise ValueError(
                f"experiment {exp_name!r} does not exist in `{self.save_dir}`; start it with "
                "start_scoring_checkpoint(...) and score targets first."
            )
        m = int(read_record(rec_path)["num_targets"])
        n = self.train_set_size
        ids = self.model_ids if model_ids is None else [int(i) for i in model_ids]
        acc = torch.zeros(n, m, dtype=torch.float64, device=self.device)
        used = []
        for model_id in ids:
            base = f"{self._exp_dir(exp_name)}/{model_id}"
            problem = None
            if not self._ckpt_record(model_id).get("finalized"):
                problem = f"model id {model_id} is not finalized (call finalize_features)"
            elif not self.store.has(f"{base}/done"):
                problem = f"model id {model_id} has no query gradients for {exp_name!r}"
            elif not self.store.done_rows(f"{base}/done").all():
                problem = f"model id {model_id} has queries of {exp_name!r} not scored yet"
            if problem is not None:
                if allow_skip:
                    logger.warning("%s; skipping it.", problem)
                    continue
                raise ModelIDException(problem + "; or pass allow_skip=True.")
            targets = torch.as_tensor(
                np.asarray(self.store.array(f"{base}/grads")[:]), device=self.device
            ).double()
            pre = self._preconditioned(model_id, targets).to(self.dtype)
            cbase = self._ckpt(model_id)
            grads = self.store.array(f"{cbase}/grads")
            q = np.asarray(self.store.array(f"{cbase}/out_to_loss")[:], dtype=np.float64)
            step = int(grads.chunks[0]) * max(1, 4096 // int(grads.chunks[0]))
            for start in range(0, n, step):
                stop = min(n, start + step)
                x = torch.as_tensor(np.asarray(grads[start:stop]), device=self.device)
                w = torch.as_tensor(q[start:stop], device=self.device)
                acc[start:stop] += (x @ pre.T).double() * w
            used.append(model_id)
        if not used:
            raise ModelIDException(
                f"every model id was skipped for {exp_name!r}; nothing to score."
            )
        scores = (acc / len(used)).float().cpu().numpy()
        arr = self.store.require_array(f"scores/{exp_name}", (n, m), np.float32)
        arr[:] = scores
        (self.save_dir / "scores").mkdir(exist_ok=True)
        (self.save_dir / "scores" / f"{exp_name}.json").write_text(
            json.dumps(
                {
                    "model_ids": used,
                    "num_targets": m,
                    "method": self.method,
                    "damping": self.damping,
                }
            )
            + "\n"
        )
        self.scores = scores
        return scores


def _rotate(block: Tensor, layer: _Layer, eigen: KroneckerEigen) -> Tensor:
    """``vec(Q_Sᵀ G Q_A)`` of stored ``vec(G)`` rows ``[B, k_out * k_in]``, in the rows' dtype.

    Two plain GEMMs over all rows at once (a broadcast batched matmul of small
    matrices is several times slower on CPU).
    """
    rows, k_out, k_in = block.shape[0], layer.k_out, layer.k_in
    q_a, q_s = eigen.q_a.to(block.dtype), eigen.q_s.to(block.dtype)
    right = (block.reshape(rows * k_out, k_in) @ q_a).reshape(rows, k_out, k_in)
    left = right.transpose(1, 2).reshape(rows * k_in, k_out) @ q_s  # (Q_Sᵀ G Q_A)ᵀ
    return left.reshape(rows, k_in, k_out).transpose(1, 2).reshape(rows, -1)


def make_influence(
    method: str,
    model: nn.Module,
    task: AbstractModelOutput | str,
    train_set_size: int,
    save_dir: str | Path,
    load_from_save_dir: bool,
    device: torch.device | str | None,
    projector: Any,
    projector_seed: int,
    grad_wrt: Iterable[str] | None,
    lambda_reg: float | str,
    progress: bool,
    chunk_rows: int | None,
    curvature: str = "loss",
) -> InfluenceComputer:
    """The :class:`InfluenceComputer` behind ``TRAKer(..., method=method)``.

    ``lambda_reg`` is the damping, ``curvature`` the curvature (sampled labels
    seeded by ``projector_seed``); a :class:`FactorizedProjector` as
    ``projector`` gives the per-layer projection ``(k_in, k_out)`` (its widest
    layer's sides) and seed; no projector means exact per-layer gradients.
    """
    if method not in INFLUENCE_METHODS:
        raise ValueError(
            f"`method` must be 'trak' or one of {list(INFLUENCE_METHODS)}, got {method!r}."
        )
    if method != "identity" and lambda_reg == 0:
        logger.warning(
            "TRAKer(method=%r, lambda_reg=0): no damping, so directions of near-zero curvature "
            "dominate the scores; pass lambda_reg='auto' (a tenth of each layer's mean "
            "eigenvalue) or a positive number.",
            method,
        )
    projection = None
    seed = projector_seed
    if isinstance(projector, FactorizedProjector):
        projection = (
            max(x.k_in for x in projector.layers),
            max(x.k_out for x in projector.layers),
        )
        seed = int(projector.seed)
    elif projector is not None:
        raise ValueError(
            f"`projector` must be None or a FactorizedProjector with method={method!r}, got "
            f"{type(projector).__name__}; influence methods project inputs and output "
            "gradients per layer."
        )
    return InfluenceComputer(
        model,
        task,
        train_set_size,
        save_dir,
        method=method,
        damping=lambda_reg,
        curvature=curvature,
        sample_seed=projector_seed,
        projection=projection,
        projection_seed=seed,
        grad_wrt=grad_wrt,
        load_from_save_dir=load_from_save_dir,
        device=device if device is not None else "cpu",
        progress=progress,
        chunk_rows=chunk_rows,
    )
