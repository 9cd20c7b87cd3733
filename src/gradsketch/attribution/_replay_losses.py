"""The per-example training losses the replay trains and differentiates, one per task class.

:data:`TRAINING_LOSSES` maps a task class to ``(task, model, *batch) -> [B]``
per-example losses of one batched forward; :func:`resolve_training_loss`
picks the one of a task (along its MRO) or checks a user's ``loss_fn``.
The losses live in the ``training_loss`` slot of each task's record in the
task protocol (:mod:`gradsketch.attribution._task`); the table is a view of it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor, nn

from gradsketch.attribution._lm import IGNORE_INDEX, LanguageModelingModelOutput, _call_model
from gradsketch.attribution._modelout import (
    AbstractModelOutput,
    ImageClassificationModelOutput,
    IterativeImageClassificationModelOutput,
    TextClassificationModelOutput,
    resolve_batch_output,
)
from gradsketch.attribution._task import (
    TaskSlotView,
    TrainingLoss,
    register_task_slot,
    task_protocol,
)

#: ``loss(model, *batch) -> [B]``: per-example training losses of one batched forward.
#: It calls ``model`` as usual; the replay swaps the run's parameters in.
BatchLoss = Callable[..., Tensor]

#: Per-example training loss of each task class (checked along the MRO).
TRAINING_LOSSES: TaskSlotView[TrainingLoss] = TaskSlotView("training_loss")


def register_training_loss(
    *task_types: type[AbstractModelOutput],
) -> Callable[[Callable[..., Tensor]], Callable[..., Tensor]]:
    """Decorator: the per-example training losses the replay uses for a task class.

    The function takes ``(task, model, *batch)`` and returns ``[B]`` losses
    of one batched forward (``model`` is called as usual).
    """
    return register_task_slot("training_loss", *task_types)


@register_training_loss(
    ImageClassificationModelOutput,
    IterativeImageClassificationModelOutput,
    TextClassificationModelOutput,
)
def classification_loss(task: AbstractModelOutput, model: nn.Module, *batch: Tensor) -> Tensor:
    """``[B]`` cross-entropies ``softplus(-margin) = -log p_y`` (the margin is TRAK's output f)."""
    return torch.nn.functional.softplus(-resolve_batch_output(task)(model, *batch))


@register_training_loss(LanguageModelingModelOutput)
def language_modeling_loss(
    task: AbstractModelOutput, model: nn.Module, ids: Tensor, mask: Tensor, labels: Tensor
) -> Tensor:
    """``[B]`` mean next-token cross-entropies over each example's predicted tokens."""
    logits = _call_model(model, None, {"input_ids": ids, "attention_mask": mask})[:, :-1]
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    target = labels[:, 1:]
    valid = target != IGNORE_INDEX
    logp = logits.log_softmax(-1).gather(-1, target.masked_fill(~valid, 0).long().unsqueeze(-1))
    count = valid.sum(1).clamp(min=1).to(logp.dtype)
    return -(logp.squeeze(-1) * valid.to(logp.dtype)).sum(1) / count


def resolve_training_loss(task: AbstractModelOutput, loss_fn: BatchLoss | None) -> BatchLoss:
    """The ``(model, *batch) -> [B]`` training loss: ``loss_fn`` checked, or the task's own."""
    if loss_fn is not None:
        if not callable(loss_fn):
            raise TypeError(
                f"`loss_fn` must be callable as loss_fn(model, *batch) -> [B] per-example "
                f"losses, got {type(loss_fn).__name__}."
            )
        return loss_fn
    loss = task_protocol(task).training_loss
    if loss is not None:
        return functools.partial(loss, task)
    known = ", ".join(sorted(c.__name__ for c in TRAINING_LOSSES))
    raise ValueError(
        f"`task` of type {type(task).__name__} has no registered training loss (known: {known}). "
        "Pass `loss_fn(model, *batch) -> [B]` per-example losses, or register one with "
        "@register_training_loss(YourTask)."
    )


class LossModule(nn.Module):
    """The model under a batched loss, so ``functional_call`` swaps the run's parameters in."""

    def __init__(self, model: nn.Module, loss: BatchLoss) -> None:
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, *batch: Tensor) -> Tensor:
        return self.loss(self.model, *batch)
