"""Model output functions f(z; θ) and out-to-loss terms Q, keyed by task name.

TRAK attributes a scalar model output per example; for classification it is
the margin ``f = logit_y - logsumexp_{j != y} logit_j`` (so that
``loss = log(1 + exp(-f))``) and the out-to-loss term is
``Q = -dloss/df = 1 - p_y`` (Park et al., ICML 2023, sec. 3.3).

Beside each task live its batched twins used by the layer hooks: the outputs
of a whole batch from one forward (:data:`BATCH_OUTPUTS`) and the out-to-loss
terms from that forward's model output (:data:`LOSS_GRAD_FROM_OUTPUT`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from gradsketch.errors import GradsketchError


class UnknownTaskError(GradsketchError, ValueError):
    """``task`` names no registered model output."""


class AbstractModelOutput(ABC):
    """A model output function and its out-to-loss term (TRAK's interface).

    Subclasses implement :meth:`get_output` for ONE example (no batch axis;
    it is vmapped over the batch) and :meth:`get_out_to_loss_grad` for a batch.
    """

    def __init__(self) -> None:  # noqa: B027 - TRAK subclasses call super().__init__()
        pass

    @staticmethod
    @abstractmethod
    def get_output(
        model: nn.Module,
        weights: dict[str, Tensor],
        buffers: dict[str, Tensor],
        *example: Any,
    ) -> Tensor:
        """Scalar output f(z; θ) for one example, through ``functional_call``."""

    @abstractmethod
    def get_out_to_loss_grad(
        self,
        model: nn.Module,
        weights: dict[str, Tensor],
        buffers: dict[str, Tensor],
        batch: Iterable[Tensor],
    ) -> Tensor:
        """``[batch, 1]`` out-to-loss terms Q for a batch."""


def _margin(logits: Tensor, label: Tensor) -> Tensor:
    """``logit_y - logsumexp_{j != y} logit_j`` for ``[1, C]`` logits (vmap-safe)."""
    classes = torch.arange(logits.shape[-1], device=logits.device)
    is_label = classes == label.reshape(-1, 1)
    correct = (logits * is_label).sum(-1)
    others = logits.masked_fill(is_label, float("-inf")).logsumexp(-1)
    return (correct - others).sum()


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


class ImageClassificationModelOutput(AbstractModelOutput):
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

    def __init__(self, temperature: float = 1.0) -> None:
        super().__init__()
        if not temperature > 0:
            raise ValueError(f"`temperature` must be > 0, got {temperature!r}.")
        self.loss_temperature = float(temperature)

    @staticmethod
    def get_output(
        model: nn.Module,
        weights: dict[str, Tensor],
        buffers: dict[str, Tensor],
        *example: Any,
    ) -> Tensor:
        """Margin for one ``(image, label)`` pair (no batch axis)."""
        image, label = example
        out = torch.func.functional_call(model, (weights, buffers), (image.unsqueeze(0),))
        return _margin(model_logits(out), label)

    def get_out_to_loss_grad(
        self,
        model: nn.Module,
        weights: dict[str, Tensor],
        buffers: dict[str, Tensor],
        batch: Iterable[Tensor],
    ) -> Tensor:
        """``[batch, 1]``: ``1 - p_y``."""
        images, labels = batch
        with torch.no_grad():
            out = torch.func.functional_call(model, (weights, buffers), (images,))
        return _one_minus_p(model_logits(out), labels, self.loss_temperature)


class TextClassificationModelOutput(AbstractModelOutput):
    """Margin of a sequence classifier on ``(input_ids, token_type_ids, attention_mask, label)``.

    The model is called as ``model(input_ids=..., token_type_ids=...,
    attention_mask=...)`` and must return ``[batch, classes]`` logits (or an
    object with a ``logits`` attribute, as Hugging Face models do).
    """

    def __init__(self, temperature: float = 1.0) -> None:
        super().__init__()
        if not temperature > 0:
            raise ValueError(f"`temperature` must be > 0, got {temperature!r}.")
        self.loss_temperature = float(temperature)

    @staticmethod
    def _logits(
        model: nn.Module, params: tuple[dict[str, Tensor], dict[str, Tensor]], **kw: Tensor
    ) -> Tensor:
        out = torch.func.functional_call(model, params, args=(), kwargs=kw)
        return model_logits(out)

    @staticmethod
    def get_output(
        model: nn.Module,
        weights: dict[str, Tensor],
        buffers: dict[str, Tensor],
        *example: Any,
    ) -> Tensor:
        """Margin for one tokenised example (no batch axis)."""
        input_id, token_type_id, attention_mask, label = example
        logits = TextClassificationModelOutput._logits(
            model,
            (weights, buffers),
            input_ids=input_id.unsqueeze(0),
            token_type_ids=token_type_id.unsqueeze(0),
            attention_mask=attention_mask.unsqueeze(0),
        )
        return _margin(logits, label)

    def get_out_to_loss_grad(
        self,
        model: nn.Module,
        weights: dict[str, Tensor],
        buffers: dict[str, Tensor],
        batch: Iterable[Tensor],
    ) -> Tensor:
        """``[batch, 1]``: ``1 - p_y``."""
        input_ids, token_type_ids, attention_mask, labels = batch
        with torch.no_grad():
            logits = self._logits(
                model,
                (weights, buffers),
                input_ids=input_ids,
                token_type_ids=token_type_ids,
                attention_mask=attention_mask,
            )
        return _one_minus_p(logits, labels, self.loss_temperature)


class IterativeImageClassificationModelOutput(AbstractModelOutput):
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

    def __init__(self, temperature: float = 1.0) -> None:
        super().__init__()
        if not temperature > 0:
            raise ValueError(f"`temperature` must be > 0, got {temperature!r}.")
        self.loss_temperature = float(temperature)

    @staticmethod
    def _forward(
        model: nn.Module,
        weights: dict[str, Tensor] | None,
        buffers: dict[str, Tensor] | None,
        images: Tensor,
    ) -> Tensor:
        if weights is None:
            return model_logits(model(images))
        params = (weights, buffers or {})
        return model_logits(torch.func.functional_call(model, params, (images,)))

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
        f = IterativeImageClassificationModelOutput._forward
        margins = _margins(f(model, weights, buffers, images), labels)
        return margins[0] if single else margins

    def get_out_to_loss_grad(  # type: ignore[override]
        self,
        model: nn.Module,
        weights: dict[str, Tensor] | None,
        buffers: dict[str, Tensor] | None,
        batch: Iterable[Tensor],
    ) -> Tensor:
        """``[batch, 1]``: ``1 - p_y``."""
        images, labels = batch
        with torch.no_grad():
            logits = self._forward(model, weights, buffers, images)
        return _one_minus_p(logits, labels, self.loss_temperature)


#: Task name -> model output class (TRAK's ``TASK_TO_MODELOUT``).
TASK_TO_MODELOUT: dict[str, type[AbstractModelOutput]] = {
    "image_classification": ImageClassificationModelOutput,
    "text_classification": TextClassificationModelOutput,
    "iterative_image_classification": IterativeImageClassificationModelOutput,
}


def register_task(name: str) -> Callable[[type[AbstractModelOutput]], type[AbstractModelOutput]]:
    """Class decorator adding a model output to :data:`TASK_TO_MODELOUT` under ``name``."""

    def decorator(cls: type[AbstractModelOutput]) -> type[AbstractModelOutput]:
        if not (isinstance(cls, type) and issubclass(cls, AbstractModelOutput)):
            raise TypeError(f"`cls` must subclass AbstractModelOutput, got {cls!r}.")
        TASK_TO_MODELOUT[name] = cls
        return cls

    return decorator


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
#: ``batch_output(model, *batch) -> [B]`` per-example outputs of one batched forward.
BatchOutput = Callable[..., Tensor]
#: ``loss_grad(task, root_output, batch) -> [B, 1]``: the task's out-to-loss terms
#: from the (detached) output of the model's forward on ``batch``.
LossGradFromOutput = Callable[[Any, Any, Sequence[Tensor]], Tensor]

#: Batched model outputs per task class (TRAK tasks define only a per-example one).
BATCH_OUTPUTS: dict[type[AbstractModelOutput], BatchOutput] = {}
#: Out-to-loss terms from the hooked forward's model output, keyed by exact task
#: type (a subclass may override ``get_out_to_loss_grad``; register it explicitly).
LOSS_GRAD_FROM_OUTPUT: dict[type[AbstractModelOutput], LossGradFromOutput] = {}


def register_batch_output(
    *task_types: type[AbstractModelOutput],
) -> Callable[[BatchOutput], BatchOutput]:
    """Decorator: ``fn(model, *batch) -> [B]`` per-example outputs for a task class.

    A task may instead define a method ``get_batch_output(model, *batch)``.
    """
    for t in task_types:
        if not (isinstance(t, type) and issubclass(t, AbstractModelOutput)):
            raise TypeError(f"`task_types` must be AbstractModelOutput subclasses, got {t!r}.")

    def decorator(fn: BatchOutput) -> BatchOutput:
        for t in task_types:
            BATCH_OUTPUTS[t] = fn
        return fn

    return decorator


def _margins(logits: Tensor, labels: Tensor) -> Tensor:
    """``[B]`` margins ``logit_y - logsumexp_{j != y} logit_j`` for ``[B, C]`` logits."""
    is_label = torch.arange(logits.shape[-1], device=logits.device) == labels.reshape(-1, 1)
    correct = (logits * is_label).sum(-1)
    return correct - logits.masked_fill(is_label, float("-inf")).logsumexp(-1)


@register_batch_output(ImageClassificationModelOutput, IterativeImageClassificationModelOutput)
def image_classification_batch_output(model: nn.Module, images: Tensor, labels: Tensor) -> Tensor:
    """Margins of a batch, the batched twin of ``ImageClassificationModelOutput.get_output``."""
    return _margins(model_logits(model(images)), labels)


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
    return _margins(model_logits(out), labels)


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
    for t in task_types:
        if not (isinstance(t, type) and issubclass(t, AbstractModelOutput)):
            raise TypeError(f"`task_types` must be AbstractModelOutput subclasses, got {t!r}.")

    def decorator(fn: LossGradFromOutput) -> LossGradFromOutput:
        for t in task_types:
            LOSS_GRAD_FROM_OUTPUT[t] = fn
        return fn

    return decorator


@register_loss_grad_from_output(
    ImageClassificationModelOutput, IterativeImageClassificationModelOutput
)
def image_classification_loss_grad(
    task: ImageClassificationModelOutput, logits: Any, batch: Sequence[Tensor]
) -> Tensor:
    """``1 - p_y`` from the logits of ``model(images)`` (a tensor or an object with ``.logits``)."""
    return _one_minus_p(model_logits(logits), batch[1], task.loss_temperature)


@register_loss_grad_from_output(TextClassificationModelOutput)
def text_classification_loss_grad(
    task: TextClassificationModelOutput, output: Any, batch: Sequence[Tensor]
) -> Tensor:
    """``1 - p_y`` from ``model(input_ids=..., ...)`` (logits or an object with ``.logits``)."""
    return _one_minus_p(model_logits(output), batch[3], task.loss_temperature)


def resolve_batch_output(task: AbstractModelOutput) -> BatchOutput:
    """The batched output function of ``task`` (its method, else the registry)."""
    method = getattr(task, "get_batch_output", None)
    if callable(method):
        return method
    for cls in type(task).__mro__:
        if cls in BATCH_OUTPUTS:
            return BATCH_OUTPUTS[cls]
    known = ", ".join(sorted(c.__name__ for c in BATCH_OUTPUTS))
    raise ValueError(
        f"`task` of type {type(task).__name__} has no batched output, which layer hooks need "
        f"(known tasks: {known}). Give it a method `get_batch_output(model, *batch) -> [B]` or "
        "register one with @register_batch_output(YourTask); or use FunctionalGradientComputer."
    )
