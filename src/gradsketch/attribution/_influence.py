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
0.3 of the mean eigenvalue of each layer's curvature (Kronfluence's
``damping_factor=None`` heuristic takes 0.1; its default is 1e-8; Grosse et
al. 2023): the fraction with the best mean LDS over five protocols.

Only the factored layers enter the scores (as in Kronfluence); embeddings and
norms are left out.

The flow, the store and the scoring kernel are TRAKer's (this class is
``TRAKer`` with a per-layer method as default); the curvature maths is
:mod:`gradsketch.attribution._kfac` behind the preconditioners of
:mod:`gradsketch.attribution._preconditioners`, and the features are
:mod:`gradsketch.attribution._kronecker_features`. Which method when, measured
per protocol: ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from gradsketch.attribution._kfac import resolve_damping
from gradsketch.attribution._kronecker_features import CURVATURES
from gradsketch.attribution._modelout import AbstractModelOutput
from gradsketch.attribution._preconditioners import resolve_method
from gradsketch.attribution._traker import TRAKer, TRAKSettings

__all__ = [
    "CURVATURES",
    "INFLUENCE_METHODS",
    "InfluenceComputer",
    "InfluenceSettings",
]

#: The built-in per-layer methods (``TRAKer(method=...)`` also takes ``"trak"``).
INFLUENCE_METHODS = ("identity", "kfac", "ekfac")
#: The settings record of every method's store (one record, one layout).
InfluenceSettings = TRAKSettings


class InfluenceComputer(TRAKer):
    """K-FAC / EK-FAC / identity influence: :class:`TRAKer` with a per-layer method.

    The calls and the store are TRAKer's: :meth:`load_checkpoint`,
    :meth:`featurize` (or :meth:`featurize_loader`) over the training rows,
    :meth:`finalize_features` (eigendecompositions and, for EK-FAC, the
    eigenvalue correction), then per query set :meth:`start_scoring_checkpoint`,
    :meth:`score` and :meth:`finalize_scores`, which averages the checkpoints'
    scores (an ensemble); :meth:`topk`, ``per_token`` and ``memory_budget``
    work as for TRAK. See the module docstring for the maths.

    Args:
        model: the model (plain, not DDP / FSDP wrapped).
        task: a task name or an :class:`AbstractModelOutput` with a batched output.
        train_set_size: number of training rows n.
        save_dir: directory of the store.
        method: ``"identity"``, ``"kfac"``, ``"ekfac"`` or a registered
            per-layer preconditioner.
        damping: λ >= 0 for every layer, or ``"auto"`` (0.3 of each layer's
            mean eigenvalue); used at scoring, so one store serves several.
        curvature: ``"loss"``, ``"output"`` or ``"sampled"``.
        sample_seed: seed of the labels drawn for ``curvature="sampled"``.
        projection: ``(k_in, k_out)`` per-layer projection, or ``None``.
        projection_seed: seed of the projection (re-drawn per checkpoint id).
        grad_wrt: parameters to differentiate (names, ``|``-joined globs, a
            list or a whole-parameter ``ParamMask``; ``None``: all).
        load_from_save_dir: resume rows already in ``save_dir``.
        device: where gradients are computed.
        dtype: ``torch.float32`` or ``torch.float64`` storage.
        chunk_rows: rows per chunk of the stored gradients.
        progress: show tqdm bars.
        memory_budget: bytes of working memory for finalize and scoring.

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
        memory_budget: int | None = None,
    ) -> None:
        resolve_damping(damping, torch.ones(1))  # `damping` named in the error
        if resolve_method(method).features != "layers":
            raise ValueError(
                f"`method` must be a per-layer method such as {list(INFLUENCE_METHODS)} for "
                f"InfluenceComputer, got {method!r}; use TRAKer(..., method={method!r})."
            )
        super().__init__(
            model,
            task,
            train_set_size,
            save_dir,
            load_from_save_dir=load_from_save_dir,
            device=device,
            projector_seed=projection_seed,
            grad_wrt=grad_wrt,
            lambda_reg=damping,
            memory_budget=memory_budget,
            progress=progress,
            chunk_rows=chunk_rows,
            method=method,
            curvature=curvature,
            projection=projection,
            sample_seed=sample_seed,
            dtype=dtype,
        )

    @property
    def damping(self) -> float | str:
        """λ of the per-layer curvature (``lambda_reg``)."""
        return self.lambda_reg

    @property
    def feature_dim(self) -> int:
        """Stored numbers per row: ``sum_l k_out k_in`` over the factored layers."""
        return self.proj_dim
