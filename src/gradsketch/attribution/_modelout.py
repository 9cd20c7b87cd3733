"""Model output functions f(z; θ) and out-to-loss terms Q, keyed by task name.

TRAK attributes a scalar model output per example; for classification it is
the margin ``f = logit_y - logsumexp_{j != y} logit_j`` (so that
``loss = log(1 + exp(-f))``) and the out-to-loss term is
``Q = -dloss/df = 1 - p_y`` (Park et al., ICML 2023, sec. 3.3).

Beside each task live its batched twins used by the layer hooks: the outputs
of a whole batch from one forward and the out-to-loss terms from that
forward's model output, slots of the task's record in the task protocol
(:mod:`gradsketch.attribution._task`; :data:`BATCH_OUTPUTS` and
:data:`LOSS_GRAD_FROM_OUTPUT` are views of them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from gradsketch._inputs import check_labels, check_model_inputs, class_count
from gradsketch.attribution._task import (
    TASK_TO_MODELOUT,
    AbstractModelOutput,
    BatchOutput,
    LossGradFromOutput,
    TaskSlotView,
    UnknownTaskError,
    register_task,
    register_task_slot,
    task_protocol,
)

__all__ = [
    "BATCH_OUTPUTS",
    "LOSS_GRAD_FROM_OUTPUT",
    "TASK_TO_MODELOUT",
    "AbstractModelOutput",
    "BatchOutput",
    "BatchedModelOutput",
    "SoftmaxModelOutput",
    "ImageClassificationModelOutput",
    "IterativeImageClassificationModelOutput",
    "LossGradFromOutput",
    "TextClassificationModelOutput",
    "UnknownTaskError",
    "margins",
    "model_logits",
    "register_batch_output",
    "register_loss_grad_from_output",
    "register_task",
    "resolve_batch_output",
    "resolve_task",
]


def margins(logits: Tensor, labels: Tensor) -> Tensor:
    """``[B]`` margins ``logit_y - logsumexp_{j != y} logit_j`` for ``[B, C]`` logits (vmap-safe).

    Example:
        >>> margins(torch.zeros(1, 3), torch.tensor([2]))  # log(1 / 2)
        tensor([-0.6931])
    """
    is_label = torch.arange(logits.shape[-1], device=logits.device) == labels.reshape(-1, 1)
    correct = (logits * is_label).sum(-1)
    return correct - logits.masked_fill(is_label, float("-inf")).logsumexp(-1)


def model_logits(output: Any) -> Tensor:
    """The logits of a model's output: the tensor itself, or its ``.logits``.

    Hugging Face models return output objects (``ImageClassifierOutput``,
    ``SequenceClassifierOutput``, ...) that carry the logits as an attribute.

    Example:
        >>> from types import SimpleNamespace
        >>> model_logits(SimpleNamespace(logits=torch.zeros(2, 3))).shape
        torch.Size([2, 3])
    """
    return output.logits if hasattr(output, "logits") else output


def _one_minus_p(logits: Tensor, labels: Tensor, temperature: float) -> Tensor:
    probs = torch.softmax(logits / temperature, dim=-1)
    p = probs.gather(-1, labels.reshape(-1, 1).long())
    return (1 - p).detach()


Params = tuple[dict[str, Tensor], dict[str, Tensor]]


class BatchedModelOutput(AbstractModelOutput):
    """A task given by its batched output; its per-example output is that of a batch of one.

    Subclasses give :meth:`outputs`; TRAK's per-example :meth:`get_output`
    (which ``vmap`` maps over a batch) is derived from it, so the two agree by
    construction.
    """

    @staticmethod
    def outputs(model: nn.Module, params: Params | None, batch: Sequence[Tensor]) -> Tensor:
        """``[B]`` outputs of one forward on ``batch`` (``functional_call`` with ``params``)."""
        raise NotImplementedError

    @classmethod
    def get_output(  # type: ignore[override]
        cls,
        model: nn.Module,
        weights: dict[str, Tensor],
        buffers: dict[str, Tensor],
        *example: Any,
    ) -> Tensor:
        """The output of one example (no batch axis): :meth:`outputs` of it as a batch of one."""
        batch = tuple(t.unsqueeze(0) for t in example)
        return cls.outputs(model, (weights, buffers), batch).sum()


class SoftmaxModelOutput(BatchedModelOutput):
    """A task whose out-to-loss term comes from the softmax of its logits at temperature ``T``.

    Subclasses give :meth:`batch_logits` (the logits of a batch) and, where
    ``Q`` is not ``1 - p_y`` of the last batch entry's labels, :meth:`q_from_output`;
    ``Q`` from a batch (:meth:`get_out_to_loss_grad`) and from the layer
    hooks' forward (the task's ``loss_grad_from_output`` slot) are then the same code.
    The output is the margin ``logit_y - logsumexp_{j != y} logit_j`` of the
    labels in the batch's last entry.

    Args:
        temperature: softmax temperature T of the out-to-loss term.
    """

    def __init__(self, temperature: float = 1.0) -> None:
        super().__init__()
        if not temperature > 0:
            raise ValueError(f"`temperature` must be > 0, got {temperature!r}.")
        self.loss_temperature = float(temperature)

    @staticmethod
    def batch_logits(model: nn.Module, params: Params | None, batch: Sequence[Tensor]) -> Any:
        """The model's output on ``batch`` (through ``functional_call`` with ``params``)."""
        raise NotImplementedError

    @classmethod
    def outputs(  # type: ignore[override]
        cls, model: nn.Module, params: Params | None, batch: Sequence[Tensor]
    ) -> Tensor:
        """``[B]`` margins of the labels (the batch's last entry)."""
        return margins(model_logits(cls.batch_logits(model, params, batch)), batch[-1])

    def q_from_output(self, output: Any, batch: Sequence[Tensor]) -> Tensor:
        """``[B, 1]``: ``1 - p_y`` from the model's output (logits, or an object with them)."""
        return _one_minus_p(model_logits(output), batch[-1], self.loss_temperature)

    def get_out_to_loss_grad(
        self,
        model: nn.Module,
        weights: dict[str, Tensor] | None,
        buffers: dict[str, Tensor] | None,
        batch: Iterable[Tensor],
    ) -> Tensor:
        """``[batch, 1]`` out-to-loss terms (``weights`` ``None``: the model as it is)."""
        batch = tuple(batch)
        params = None if weights is None else (weights, buffers or {})
        with torch.no_grad():
            output = self.batch_logits(model, params, batch)
        return self.q_from_output(output, batch)


def _call(model: nn.Module, params: Params | None, *args: Any, **kwargs: Any) -> Any:
    """``model(*args, **kwargs)``, through ``functional_call`` when ``params`` are given."""
    if params is None:
        return model(*args, **kwargs)
    return torch.func.functional_call(model, params, args, kwargs)


class ImageClassificationModelOutput(SoftmaxModelOutput):
    """Margin of a classifier on ``(image, label)`` batches.

    ``f = logit_y - log Σ_{j≠y} exp(logit_j)`` and ``Q = 1 - softmax(logits/T)_y``.
    The model returns ``[batch, classes]`` logits, or an object with a
    ``logits`` attribute (Hugging Face's ``ViTForImageClassification``...).

    Args:
        temperature: softmax temperature T of the out-to-loss term.

    Example:
        >>> model = torch.nn.Linear(3, 4)
        >>> task = ImageClassificationModelOutput()
        >>> w, b = dict(model.named_parameters()), dict(model.named_buffers())
        >>> task.get_output(model, w, b, torch.ones(3), torch.tensor(1)).shape
        torch.Size([])
        >>> task.get_out_to_loss_grad(model, w, b, (torch.ones(2, 3), torch.tensor([0, 1]))).shape
        torch.Size([2, 1])
    """

    @staticmethod
    def batch_logits(model: nn.Module, params: Params | None, batch: Sequence[Tensor]) -> Any:
        """``model(images)``."""
        return _call(model, params, batch[0])


class TextClassificationModelOutput(SoftmaxModelOutput):
    """Margin of a sequence classifier on ``(input_ids, token_type_ids, attention_mask, label)``.

    The model is called as ``model(input_ids=..., token_type_ids=...,
    attention_mask=...)`` and must return ``[batch, classes]`` logits (or an
    object with a ``logits`` attribute, as Hugging Face models do).
    """

    @staticmethod
    def batch_logits(model: nn.Module, params: Params | None, batch: Sequence[Tensor]) -> Any:
        """``model(input_ids=..., token_type_ids=..., attention_mask=...)``."""
        ids, types, mask = batch[:3]
        return _call(model, params, input_ids=ids, token_type_ids=types, attention_mask=mask)


class IterativeImageClassificationModelOutput(SoftmaxModelOutput):
    """Margins of a whole batch of ``(images, labels)``: trak's task for the iterative computer.

    The same margin and ``Q`` as :class:`ImageClassificationModelOutput`,
    but :meth:`get_output` takes a batch and returns ``[batch]`` margins, as
    :class:`~gradsketch.attribution.IterativeGradientComputer` needs (it
    passes ``weights = buffers = None`` and the model is called as it is).
    With weights it calls the model through ``functional_call``, and given
    one example (a 0-d label, as ``vmap`` hands it) it returns a scalar, so
    the other gradient computers take this task too.

    Args:
        temperature: softmax temperature T of the out-to-loss term.

    Example:
        >>> model = torch.nn.Linear(3, 4)
        >>> task = IterativeImageClassificationModelOutput()
        >>> task.get_output(model, None, None, torch.ones(2, 3), torch.tensor([0, 1])).shape
        torch.Size([2])
    """

    @staticmethod
    def batch_logits(model: nn.Module, params: Params | None, batch: Sequence[Tensor]) -> Any:
        """``model(images)``."""
        return _call(model, params, batch[0])

    @staticmethod
    def get_output(  # type: ignore[override]
        model: nn.Module,
        weights: dict[str, Tensor] | None,
        buffers: dict[str, Tensor] | None,
        *batch: Any,
    ) -> Tensor:
        """``[batch]`` margins (a scalar for one example with a 0-d label)."""
        images, labels = batch
        single = labels.dim() == 0
        if single:
            images, labels = images.unsqueeze(0), labels.reshape(1)
        params = None if weights is None else (weights, buffers or {})
        logits = _call(model, params, images)
        found = margins(model_logits(logits), labels)
        return found[0] if single else found


register_task("image_classification")(ImageClassificationModelOutput)
register_task("text_classification")(TextClassificationModelOutput)
register_task("iterative_image_classification")(IterativeImageClassificationModelOutput)


def resolve_task(task: str | AbstractModelOutput) -> AbstractModelOutput:
    """A model output instance from a task name or an instance."""
    if isinstance(task, AbstractModelOutput):
        return task
    if isinstance(task, str) and task in TASK_TO_MODELOUT:
        return TASK_TO_MODELOUT[task]()
    raise UnknownTaskError(
        f"`task`={task!r} is not a known task; known tasks are {sorted(TASK_TO_MODELOUT)}. "
        "Pass one of them, an AbstractModelOutput instance, or register yours with "
        "@register_task('name')."
    )


# -- batched outputs, for layer hooks -------------------------------------------
#: Batched model outputs per task class (TRAK tasks define only a per-example one).
BATCH_OUTPUTS: TaskSlotView[BatchOutput] = TaskSlotView("batch_output")
#: Out-to-loss terms from the hooked forward's model output, keyed by exact task
#: type (a subclass may override ``get_out_to_loss_grad``; register it explicitly).
LOSS_GRAD_FROM_OUTPUT: TaskSlotView[LossGradFromOutput] = TaskSlotView("loss_grad_from_output")


def register_batch_output(
    *task_types: type[AbstractModelOutput],
) -> Callable[[BatchOutput], BatchOutput]:
    """Decorator: ``fn(model, *batch) -> [B]`` per-example outputs for a task class.

    A task may instead define a method ``get_batch_output(model, *batch)``.
    """
    return register_task_slot("batch_output", *task_types)


@register_batch_output(ImageClassificationModelOutput, IterativeImageClassificationModelOutput)
def image_classification_batch_output(model: nn.Module, images: Tensor, labels: Tensor) -> Tensor:
    """Margins of a batch, the batched twin of ``ImageClassificationModelOutput.get_output``."""
    return margins(model_logits(model(images)), labels)


@register_batch_output(TextClassificationModelOutput)
def text_classification_batch_output(
    model: nn.Module,
    input_ids: Tensor,
    token_type_ids: Tensor,
    attention_mask: Tensor,
    labels: Tensor,
) -> Tensor:
    """Margins of a batch of tokenised examples (batched ``TextClassificationModelOutput``)."""
    out = model(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask)
    return margins(model_logits(out), labels)


def register_loss_grad_from_output(
    *task_types: type[AbstractModelOutput],
) -> Callable[[LossGradFromOutput], LossGradFromOutput]:
    """Decorator: ``fn(task, model_output, batch) -> [B, 1]`` out-to-loss terms.

    It must equal ``task.get_out_to_loss_grad(model, weights, buffers, batch)``
    when ``model_output`` is ``model(...)`` on that batch; registered tasks
    then reuse the hooked forward instead of running a second one.

    Example:
        >>> rule = LOSS_GRAD_FROM_OUTPUT[ImageClassificationModelOutput]
        >>> rule(ImageClassificationModelOutput(), torch.zeros(2, 4), (None, torch.tensor([0, 3])))
        tensor([[0.7500],
                [0.7500]])
    """
    return register_task_slot("loss_grad_from_output", *task_types)


@register_loss_grad_from_output(
    ImageClassificationModelOutput,
    IterativeImageClassificationModelOutput,
    TextClassificationModelOutput,
)
def softmax_loss_grad(task: SoftmaxModelOutput, output: Any, batch: Sequence[Tensor]) -> Tensor:
    """``Q`` from the model's output on ``batch`` (:meth:`SoftmaxModelOutput.q_from_output`)."""
    return task.q_from_output(output, batch)


@register_task_slot(
    "check_batch", ImageClassificationModelOutput, IterativeImageClassificationModelOutput
)
def image_classification_check(model: nn.Module, batch: Sequence[Any]) -> None:
    """``images`` against the model's first layer, ``labels`` against its classes."""
    check_model_inputs(model, batch[0], argument="batch[0] (the images)")
    check_labels(batch[-1], class_count(model), argument="batch[1] (the labels)")


@register_task_slot("check_batch", TextClassificationModelOutput)
def classification_labels_check(model: nn.Module, batch: Sequence[Any]) -> None:
    """The labels (the batch's last entry) against the model's classes."""
    check_labels(batch[-1], class_count(model), argument="the labels (the batch's last entry)")


@register_task_slot("token_mask", TextClassificationModelOutput)
def text_classification_token_mask(batch: Sequence[Tensor]) -> Tensor:
    """The ``attention_mask`` of ``(input_ids[, token_type_ids], attention_mask, labels)``."""
    return batch[-2]


def resolve_batch_output(task: AbstractModelOutput) -> BatchOutput:
    """The batched output function of ``task`` (its method, else the registry)."""
    output = task_protocol(task).batch_output
    if output is not None:
        return output
    known = ", ".join(sorted(c.__name__ for c in BATCH_OUTPUTS))
    raise ValueError(
        f"`task` of type {type(task).__name__} has no batched output, which layer hooks need "
        f"(known tasks: {known}). Give it a method `get_batch_output(model, *batch) -> [B]` or "
        "register one with @register_batch_output(YourTask); or use FunctionalGradientComputer."
    )
