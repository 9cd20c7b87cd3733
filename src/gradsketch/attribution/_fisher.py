"""What influence methods differentiate, per task: the measurement and the sampled-label loss.

Two slots of a task's record in the task protocol
(:mod:`gradsketch.attribution._task`), read by
:class:`~gradsketch.attribution.InfluenceComputer`; the tables here are views of them:

* :data:`INFLUENCE_OUTPUTS` replaces a task's TRAK output where influence
  should measure something else. For ``"language_modeling"`` the output is
  the sequence's summed log-likelihood ``f = Σ_t log p(y_t | y_<t)`` over the
  predicted tokens and ``Q = 1`` (the training loss is ``-f``), so a training
  row's feature is its exact per-sequence loss gradient, summed over tokens
  by one backward, and a query's is the gradient of the LDS measurement of
  the LM demo. TRAK's summed log-odds with a mean ``Q`` (see
  :mod:`gradsketch.attribution._lm`) is exact only when the tokens' ``1 - p_t``
  agree; curvature-weighted scores should not inherit that approximation.
  ``"seq2seq_lm"``'s TRAK output is already the targets' summed
  log-likelihood with ``Q = 1``, and influence uses it as it is. Tasks
  without an entry (classification: margin, ``Q = 1 - p_y``, exact for
  cross-entropy) keep their TRAK output.
* :data:`SAMPLED_LOSSES` gives a task's training loss with its labels
  replaced by labels drawn from the model's own predictive distribution (one
  draw per example, or per predicted token). Its gradients are the true
  Fisher's (``curvature="sampled"``): ``E_ŷ[∇ℓ(ŷ) ∇ℓ(ŷ)ᵀ] = Σ_c p_c ∇ℓ(c)
  ∇ℓ(c)ᵀ``, which for softmax cross-entropy is the Gauss-Newton matrix
  (Martens, "New insights and perspectives on the natural gradient
  method", 2020), and Kronfluence's default.

Draws are reproducible: :func:`draw_labels` inverts the softmax's CDF at a
uniform hashed from ``(key, row, position)`` (:func:`gradsketch._hash.hash_indices`),
so a row's labels do not depend on its batch, the batch size or the device.

Example:
    >>> logits = torch.tensor([[0.0, 0.0], [9.0, -9.0]])
    >>> draw_labels(logits, torch.tensor([0, 1]), key=7)[1].item()  # p(0) = 1 - 1.5e-8
    0
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from gradsketch._hash import hash_indices
from gradsketch.attribution._lm import (
    IGNORE_INDEX,
    LanguageModelingModelOutput,
    Seq2SeqLMModelOutput,
    SequenceClassificationModelOutput,
    _call_model,
    _upcast_half,
)
from gradsketch.attribution._modelout import (
    ImageClassificationModelOutput,
    TextClassificationModelOutput,
    model_logits,
)
from gradsketch.attribution._task import (
    AbstractModelOutput,
    BatchOutput,
    Draw,
    LossGradFromOutput,
    SampledLoss,
    TaskSlotView,
    register_task_slot,
)

__all__ = [
    "INFLUENCE_OUTPUTS",
    "SAMPLED_LOSSES",
    "SampledLoss",
    "draw_labels",
    "find_task_entry",
    "register_influence_output",
    "register_sampled_loss",
]

#: Task class -> (batched output, out-to-loss terms) used by influence instead of TRAK's.
INFLUENCE_OUTPUTS: TaskSlotView[tuple[BatchOutput, LossGradFromOutput]] = TaskSlotView(
    "influence_output"
)
#: Task class -> its training loss under labels sampled from the model.
SAMPLED_LOSSES: TaskSlotView[SampledLoss] = TaskSlotView("sampled_loss")


def register_sampled_loss(
    *task_types: type[AbstractModelOutput],
) -> Callable[[SampledLoss], SampledLoss]:
    """Decorator: ``fn(task, model_output, batch, draw) -> [B]`` sampled-label losses."""
    return register_task_slot("sampled_loss", *task_types)


def register_influence_output(
    *task_types: type[AbstractModelOutput], out_to_loss: LossGradFromOutput
) -> Callable[[BatchOutput], BatchOutput]:
    """Decorator: the batched output ``fn(model, *batch) -> [B]`` influence uses for a task."""
    fill = register_task_slot("influence_output", *task_types)

    def decorator(fn: BatchOutput) -> BatchOutput:
        fill((fn, out_to_loss))
        return fn

    return decorator


def find_task_entry(table: Mapping[type[AbstractModelOutput], Any], task: Any) -> Any:
    """``table``'s entry for ``task``'s class or its nearest registered base (``None``: none)."""
    for cls in type(task).__mro__:
        if cls in table:
            return table[cls]
    return None


def draw_labels(logits: Tensor, rows: Tensor, key: int) -> Tensor:
    """Labels drawn from ``softmax(logits)``, one per row and position, reproducibly.

    Label ``c`` is drawn where the uniform ``u = (h + 1/2) / 2³²`` (``h`` the
    32-bit hash of ``row * P + position`` under ``key``) falls in
    ``[cdf_{c-1}, cdf_c)``, so ``P(c) = p_c`` up to the 2⁻³² grid.

    Args:
        logits: ``[B, *P, C]`` logits (P: positions, possibly none).
        rows: ``[B]`` int64 global row indices.
        key: 32-bit key (seed, checkpoint) from :func:`gradsketch._hash.derive_key`.

    Returns:
        ``[B, *P]`` int64 labels.
    """
    b, c = logits.shape[0], logits.shape[-1]
    probs = torch.softmax(logits.detach().double(), dim=-1).reshape(b, -1, c)
    positions = probs.shape[1]
    index = rows.to(torch.int64).reshape(-1, 1).to(logits.device) * positions + torch.arange(
        positions, device=logits.device
    )
    u = (hash_indices(key, index).double() + 0.5) / 2.0**32
    cdf = probs.cumsum(-1)
    labels = (cdf < (u * cdf[..., -1]).unsqueeze(-1)).sum(-1).clamp(max=c - 1)
    return labels.reshape(logits.shape[:-1])


@register_sampled_loss(
    ImageClassificationModelOutput,
    TextClassificationModelOutput,
    SequenceClassificationModelOutput,
)
def classification_sampled_loss(
    task: Any, output: Any, batch: Sequence[Tensor], draw: Draw
) -> Tensor:
    """``[B]`` cross-entropy of the logits against one label drawn per example."""
    logits = _upcast_half(model_logits(output))
    return F.cross_entropy(logits, draw(logits), reduction="none")


@register_sampled_loss(LanguageModelingModelOutput)
def language_modeling_sampled_loss(
    task: Any, output: Any, batch: Sequence[Tensor], draw: Draw
) -> Tensor:
    """``[B]`` summed next-token cross-entropy against tokens drawn at every predicted position."""
    z = _upcast_half(model_logits(output)[:, :-1])
    valid = batch[2][:, 1:] != IGNORE_INDEX
    drawn = draw(z)
    nll = F.cross_entropy(z.transpose(1, 2), drawn, reduction="none")
    return (nll * valid.to(nll.dtype)).sum(1)


def _ones_out_to_loss(task: Any, output: Any, batch: Sequence[Tensor]) -> Tensor:
    """``[B, 1]`` ones: the loss is minus the output."""
    return torch.ones(batch[0].shape[0], 1, dtype=torch.float64)


@register_influence_output(LanguageModelingModelOutput, out_to_loss=_ones_out_to_loss)
def language_modeling_log_likelihood(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, labels: Tensor
) -> Tensor:
    """``[B]`` summed log-likelihood ``Σ_t log p(y_t | y_<t)`` of the predicted tokens."""
    logits = _call_model(model, None, {"input_ids": input_ids, "attention_mask": attention_mask})
    z = _upcast_half(logits[:, :-1])
    target = labels[:, 1:]
    valid = target != IGNORE_INDEX
    logp = torch.log_softmax(z, dim=-1)
    picked = logp.gather(-1, target.masked_fill(~valid, 0).long().unsqueeze(-1)).squeeze(-1)
    return (picked * valid.to(picked.dtype)).sum(1)


@register_sampled_loss(Seq2SeqLMModelOutput)
def seq2seq_sampled_loss(task: Any, output: Any, batch: Sequence[Tensor], draw: Draw) -> Tensor:
    """``[B]`` summed cross-entropy of the decoder's logits against tokens drawn at every target.

    The decoder read the true targets (teacher forcing, as in training);
    only the labels its logits are scored against are drawn.
    """
    z = _upcast_half(model_logits(output))
    valid = batch[2] != IGNORE_INDEX
    if len(batch) > 4:
        valid = valid & (batch[4] != 0)
    nll = F.cross_entropy(z.transpose(1, 2), draw(z), reduction="none")
    return (nll * valid.to(nll.dtype)).sum(1)


@register_influence_output(Seq2SeqLMModelOutput, out_to_loss=_ones_out_to_loss)
def seq2seq_log_likelihood(model: nn.Module, *batch: Tensor) -> Tensor:
    """``[B]`` summed log-likelihood ``Σ_t log p(y_t | x, y_<t)`` of the target tokens."""
    return Seq2SeqLMModelOutput.get_batch_output(model, *batch)
