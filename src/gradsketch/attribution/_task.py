"""The task protocol: one :class:`Task` record per task class carries all a method asks of it.

A task (TRAK's "model output function", :class:`AbstractModelOutput`) is
what the attribution methods differentiate and weigh. Beside its per-example
output ``f(z; θ)`` (:meth:`~AbstractModelOutput.get_output`, which ``vmap``
maps over a batch) and its out-to-loss term ``Q``
(:meth:`~AbstractModelOutput.get_out_to_loss_grad`), each method needs one
more piece of the task, and each piece has one slot in the task's
:class:`Task` record:

========================= ============================================== ======================
slot                      what it is                                     who reads it
========================= ============================================== ======================
``batch_output``          ``[B]`` outputs ``f`` of one batched forward   layer hooks, Kronecker
                          (the query output)                             features, replay
``loss_grad_from_output`` ``[B, 1]`` ``Q`` from that forward's output    hooks, Kronecker
``training_loss``         ``[B]`` training losses of one forward         the replay
``sampled_loss``          ``[B]`` losses under labels drawn from the     true Fisher
                          model (its gradient is the loss gradient from  (``curvature=
                          the output under those labels)                 "sampled"``)
``influence_output``      ``(batch output, Q)`` influence measures       K-FAC, EK-FAC,
                          instead of TRAK's (LM: log-likelihood, Q = 1)  identity
``token_mask``            ``[B, T]`` real positions of a padded batch    K-FAC's ``A``
``per_token``             ``(per_token_batch, per_token_length)``: the   ``per_token`` scores
                          per-token expansion of a batch
``check_batch``           ``check(model, batch)`` names a bad batch      the gradient
                          (width, dtype, label range) before any         computers, Kronecker
                          forward pass                                   features
========================= ============================================== ======================

A new task registers once: :func:`register_task` names the class and fills
its slots; the older decorators (``register_batch_output``,
``register_sampled_loss``, ...) each fill one slot, and the older tables
(``TASK_TO_MODELOUT``, ``LOSS_GRAD_FROM_OUTPUT``, ``SAMPLED_LOSSES``, ...)
are :class:`TaskSlotView` views of one slot of :data:`TASKS`. A slot is
looked up along the task's MRO (a subclass inherits its base's), except
``loss_grad_from_output``, which is read for the exact class, since a
subclass may override ``get_out_to_loss_grad``.

Example:
    >>> import torch
    >>> class Squared(AbstractModelOutput):
    ...     @staticmethod
    ...     def get_output(model, weights, buffers, x):
    ...         return torch.func.functional_call(model, (weights, buffers), (x,)).pow(2).sum()
    ...     def get_out_to_loss_grad(self, model, weights, buffers, batch):
    ...         return torch.ones(len(batch[0]), 1)
    >>> _ = register_task("squared", batch_output=lambda model, x: model(x).pow(2).sum(-1))(
    ...     Squared)
    >>> task_protocol(Squared()).batch_output is not None
    True
    >>> unregister_task("squared")
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from torch import Tensor, nn

from gradsketch.errors import UnknownTaskError

__all__ = [
    "TASKS",
    "AbstractModelOutput",
    "Task",
    "TaskNameView",
    "TaskSlotView",
    "UnknownTaskError",
    "register_task",
    "register_task_slot",
    "task_protocol",
    "unregister_task",
]

V = TypeVar("V")
_C = TypeVar("_C", bound=type)


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


#: ``batch_output(model, *batch) -> [B]`` per-example outputs of one batched forward.
BatchOutput = Callable[..., Tensor]
#: ``loss_grad(task, root_output, batch) -> [B, 1]``: the task's out-to-loss terms
#: from the (detached) output of the model's forward on ``batch``.
LossGradFromOutput = Callable[[Any, Any, Sequence[Tensor]], Tensor]
#: ``draw(logits [B, *P, C]) -> labels [B, *P]``, seeded per row and position.
Draw = Callable[[Tensor], Tensor]
#: ``loss(task, model_output, batch, draw) -> [B]``: each example's training loss with
#: labels drawn by ``draw`` from the (differentiable) model output of the hooked forward.
SampledLoss = Callable[[Any, Any, Sequence[Tensor], Draw], Tensor]
#: ``loss(task, model, *batch) -> [B]``: per-example training losses of one batched forward.
TrainingLoss = Callable[..., Tensor]
#: ``mask(batch) -> [B, T]`` real (not padded) positions of a canonical batch.
TokenMask = Callable[[Sequence[Any]], Tensor]
#: ``check(model, batch)``: raise :class:`~gradsketch.errors.BatchFormatError` for a bad batch.
BatchCheck = Callable[[nn.Module, Sequence[Any]], None]


@dataclass
class Task:
    """Everything the attribution methods ask of one task class (see the module docstring).

    Attributes:
        task_type: the task class.
        names: the names it is registered under (``TRAKer(task="name")``).
        batch_output: its batched output ``f`` (the query output).
        loss_grad_from_output: its ``Q`` from the hooked forward's output.
        training_loss: its per-example training loss (the replay trains it).
        sampled_loss: its training loss under labels drawn from the model.
        influence_output: the ``(batch output, Q)`` influence uses instead of TRAK's.
        token_mask: the real positions of a batch, for K-FAC's ``A``.
        per_token: ``(per_token_batch, per_token_length)``, the per-token expansion.
        check_batch: names a bad batch before any forward pass.
    """

    task_type: type[AbstractModelOutput]
    names: list[str] = field(default_factory=list)
    batch_output: BatchOutput | None = None
    loss_grad_from_output: LossGradFromOutput | None = None
    training_loss: TrainingLoss | None = None
    sampled_loss: SampledLoss | None = None
    influence_output: tuple[BatchOutput, LossGradFromOutput] | None = None
    token_mask: TokenMask | None = None
    per_token: tuple[Callable[..., Any], Callable[..., int]] | None = None
    check_batch: BatchCheck | None = None


#: The registered tasks, by class.
TASKS: dict[type[AbstractModelOutput], Task] = {}

#: The slots of a :class:`Task` that registration fills.
SLOTS = tuple(f.name for f in dataclasses.fields(Task) if f.name not in ("task_type", "names"))
#: Slots read for the exact class only (not inherited).
EXACT_SLOTS = frozenset({"loss_grad_from_output"})


def _check_task_type(t: Any) -> None:
    if not (isinstance(t, type) and issubclass(t, AbstractModelOutput)):
        raise TypeError(f"`task_types` must be AbstractModelOutput subclasses, got {t!r}.")


def _check_task_class(cls: Any) -> None:
    if not (isinstance(cls, type) and issubclass(cls, AbstractModelOutput)):
        raise TypeError(f"`cls` must subclass AbstractModelOutput, got {cls!r}.")


def _entry(task_type: type[AbstractModelOutput]) -> Task:
    """The record of ``task_type``, created empty on first use."""
    if task_type not in TASKS:
        TASKS[task_type] = Task(task_type)
    return TASKS[task_type]


def _check_slot(slot: str) -> None:
    if slot not in SLOTS:
        raise ValueError(f"`slot` must be one of {list(SLOTS)}, got {slot!r}.")


def register_task_slot(slot: str, *task_types: type[AbstractModelOutput]) -> Callable[[V], V]:
    """Decorator: ``fn`` fills ``slot`` of each of ``task_types``' records.

    Example:
        >>> from gradsketch.attribution import ImageClassificationModelOutput
        >>> rule = TASKS[ImageClassificationModelOutput].loss_grad_from_output
        >>> register_task_slot("loss_grad_from_output", ImageClassificationModelOutput)(rule)
        ... # doctest: +ELLIPSIS
        <function ...>
    """
    _check_slot(slot)
    for t in task_types:
        _check_task_type(t)

    def decorator(fn: V) -> V:
        for t in task_types:
            setattr(_entry(t), slot, fn)
        return fn

    return decorator


def register_task(
    name: str | None = None, **slots: Any
) -> Callable[[type[AbstractModelOutput]], type[AbstractModelOutput]]:
    """Class decorator: register a task under ``name`` and fill its slots, in one call.

    Args:
        name: the name ``TRAKer(task=name)`` takes (``None``: slots only).
        **slots: any :class:`Task` slot (``batch_output=...``,
            ``training_loss=...``, ``sampled_loss=...``, ...). A task class
            defining ``get_batch_output`` or ``per_token_batch`` /
            ``per_token_length`` methods fills those slots itself.

    Raises:
        TypeError: the class is not an :class:`AbstractModelOutput` subclass.
        ValueError: an unknown slot.
    """
    for slot in slots:
        _check_slot(slot)

    def decorator(cls: type[AbstractModelOutput]) -> type[AbstractModelOutput]:
        _check_task_class(cls)
        entry = _entry(cls)
        if name is not None:
            TASK_TO_MODELOUT[name] = cls
        for slot, value in slots.items():
            setattr(entry, slot, value)
        return cls

    return decorator


def unregister_task(name: str) -> None:
    """Forget the task registered as ``name`` (its record goes once it has no name left)."""
    cls = TASK_TO_MODELOUT.pop(name)
    entry = TASKS.get(cls)
    if entry is not None and not entry.names:
        del TASKS[cls]


def task_protocol(task: AbstractModelOutput | type[AbstractModelOutput]) -> Task:
    """The resolved record of a task (instance or class): each slot its nearest registered one.

    Methods of the task class stand in for empty slots: ``get_batch_output``
    for ``batch_output``, ``per_token_batch`` / ``per_token_length`` for
    ``per_token``.
    """
    cls = task if isinstance(task, type) else type(task)
    resolved = Task(cls, names=list(TASKS[cls].names) if cls in TASKS else [])
    for slot in SLOTS:
        setattr(resolved, slot, _lookup(cls, slot))
    method = getattr(task, "get_batch_output", None)
    if callable(method) and not isinstance(task, type):
        resolved.batch_output = method
    expand, length = getattr(cls, "per_token_batch", None), getattr(cls, "per_token_length", None)
    if resolved.per_token is None and callable(expand) and callable(length):
        resolved.per_token = (expand, length)
    return resolved


def _lookup(cls: type, slot: str) -> Any:
    for base in (cls,) if slot in EXACT_SLOTS else cls.__mro__:
        entry = TASKS.get(base)
        value = None if entry is None else getattr(entry, slot)
        if value is not None:
            return value
    return None


# -- the older tables, as views of one slot ------------------------------------------
class TaskSlotView(MutableMapping[type[AbstractModelOutput], V], Generic[V]):
    """``{task class: its slot}`` for the classes whose record fills ``slot``.

    Setting an item fills the slot, deleting one empties it: the table and
    the records never disagree.
    """

    def __init__(self, slot: str) -> None:
        _check_slot(slot)
        self.slot = slot

    def __getitem__(self, task_type: type[AbstractModelOutput]) -> V:
        entry = TASKS.get(task_type)
        value = None if entry is None else getattr(entry, self.slot)
        if value is None:
            raise KeyError(task_type)
        return value  # type: ignore[no-any-return]

    def __setitem__(self, task_type: type[AbstractModelOutput], value: V) -> None:
        _check_task_type(task_type)
        setattr(_entry(task_type), self.slot, value)

    def __delitem__(self, task_type: type[AbstractModelOutput]) -> None:
        self[task_type]  # KeyError if empty
        setattr(TASKS[task_type], self.slot, None)

    def __iter__(self) -> Iterator[type[AbstractModelOutput]]:
        return iter([t for t, entry in TASKS.items() if getattr(entry, self.slot) is not None])

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"TaskSlotView({self.slot!r}, {dict(self)!r})"


class TaskNameView(MutableMapping[str, type[AbstractModelOutput]]):
    """``{name: task class}`` over the records' names (TRAK's ``TASK_TO_MODELOUT``)."""

    def __getitem__(self, name: str) -> type[AbstractModelOutput]:
        for cls, entry in TASKS.items():
            if name in entry.names:
                return cls
        raise KeyError(name)

    def __setitem__(self, name: str, cls: type[AbstractModelOutput]) -> None:
        _check_task_class(cls)
        for entry in TASKS.values():
            if name in entry.names:
                entry.names.remove(name)
        _entry(cls).names.append(name)

    def __delitem__(self, name: str) -> None:
        self[name]  # KeyError if unknown
        for entry in TASKS.values():
            if name in entry.names:
                entry.names.remove(name)

    def __iter__(self) -> Iterator[str]:
        return iter([n for entry in TASKS.values() for n in entry.names])

    def __len__(self) -> int:
        return sum(len(entry.names) for entry in TASKS.values())

    def __repr__(self) -> str:
        return f"TaskNameView({dict(self)!r})"


#: Task name -> model output class (TRAK's ``TASK_TO_MODELOUT``).
TASK_TO_MODELOUT = TaskNameView()
