"""Model output functions f(z; θ) and out-to-loss terms Q, keyed by task name.

TRAK attributes a scalar model output per example; for classification it is
the margin ``f = logit_y - logsumexp_{j != y} logit_j`` (so that
``loss = log(1 + exp(-f))``) and the out-to-loss term is
``Q = -dloss/df = 1 - p_y`` (Park et al., ICML 2023, sec. 3.3).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
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


def _one_minus_p(logits: Tensor, labels: Tensor, temperature: float) -> Tensor:
    probs = torch.softmax(logits / temperature, dim=-1)
    p = probs.gather(-1, labels.reshape(-1, 1).long())
    return (1 - p).detach()


class ImageClassificationModelOutput(AbstractModelOutput):
    """Margin of a classifier on ``(image, label)`` batches.

    ``f = logit_y - log Σ_{j≠y} exp(logit_j)`` and ``Q = 1 - softmax(logits/T)_y``.

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
        logits = torch.func.functional_call(model, (weights, buffers), (image.unsqueeze(0),))
        return _margin(logits, label)

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
            logits = torch.func.functional_call(model, (weights, buffers), (images,))
        return _one_minus_p(logits, labels, self.loss_temperature)


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
        return out.logits if hasattr(out, "logits") else out

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


#: Task name -> model output class (TRAK's ``TASK_TO_MODELOUT``).
TASK_TO_MODELOUT: dict[str, type[AbstractModelOutput]] = {
    "image_classification": ImageClassificationModelOutput,
    "text_classification": TextClassificationModelOutput,
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
