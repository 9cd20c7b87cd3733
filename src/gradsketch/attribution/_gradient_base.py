"""The gradient computers' interface (TRAK's), and the check of ``grad_wrt``.

The interface is TRAK's (``load_model_params``, ``compute_per_sample_grad``,
``compute_loss_grad``) plus one derived method, :meth:`AbstractGradientComputer.project`,
which is what :class:`TRAKer` calls. Its default computes per-example
gradients and hands them to the projector; a computer that never materialises
per-example gradients (layer hooks that project Kronecker factors directly)
overrides ``project`` alone and plugs into TRAKer unchanged.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from gradsketch.attribution._task import AbstractModelOutput, task_protocol

__all__ = ["AbstractGradientComputer", "resolve_grad_wrt"]


class AbstractGradientComputer(ABC):
    """Computes per-example gradients of a model output (TRAK's interface).

    Args:
        model: the model.
        task: the model output function.
        grad_dim: number of gradient coordinates (informative).
        dtype: dtype of stored features.
        device: where gradients are computed.
        grad_wrt: names of the parameters to differentiate (``None``: all),
            checked by :func:`resolve_grad_wrt` and kept in model order.

    Subclasses set up their own state in :meth:`_setup`, which runs last.
    """

    def __init__(
        self,
        model: nn.Module,
        task: AbstractModelOutput,
        grad_dim: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        grad_wrt: Iterable[str] | None = None,
    ) -> None:
        self.model = model
        self.modelout_fn = task
        self.grad_dim = grad_dim
        self.dtype = dtype
        self.device = device
        self._grad_wrt_arg = None if grad_wrt is None else list(grad_wrt)
        names = [name for name, _ in model.named_parameters()]
        self.grad_wrt: list[str] | None = resolve_grad_wrt(names, self._grad_wrt_arg)
        self._batch_check = task_protocol(task).check_batch
        self._setup()

    def check_batch(self, batch: Sequence[Any]) -> None:
        """Name a bad batch (width, dtype, labels) before any forward pass (the task's check).

        Raises:
            BatchFormatError: the batch cannot be the model's input.
        """
        if self._batch_check is not None:
            self._batch_check(self.model, batch)

    def _setup(self) -> None:  # noqa: B027 - optional hook
        """The subclass's own state (and, for most, :meth:`load_model_params` of ``self.model``)."""

    @abstractmethod
    def load_model_params(self, model: nn.Module) -> None:
        """Take the (new) checkpoint's parameters and buffers."""

    @abstractmethod
    def compute_per_sample_grad(self, batch: Sequence[Tensor]) -> dict[str, Tensor]:
        """``{parameter name: [batch, *param.shape]}`` gradients of the model output."""

    @abstractmethod
    def compute_loss_grad(self, batch: Sequence[Tensor]) -> Tensor:
        """``[batch, 1]`` out-to-loss terms Q."""

    def project(self, batch: Sequence[Tensor], projector: Any, model_id: int | None) -> Tensor:
        """``[batch, proj_dim]`` projected gradients of the model output.

        Default: :meth:`compute_per_sample_grad`, then ``projector.project``.
        Override to project without forming per-example gradients.
        """
        return projector.project(self.compute_per_sample_grad(batch), model_id=model_id)


def resolve_grad_wrt(names: Sequence[str], grad_wrt: Iterable[str] | None) -> list[str] | None:
    """Check ``grad_wrt`` against a model's parameter ``names``; return them in model order.

    Model order lays coordinates out the same way every time, whatever order
    the user listed them in. ``None`` means every parameter.

    Raises:
        ValueError: an empty selection or a name that is not a parameter
            (the allowed names are listed).

    Example:
        >>> resolve_grad_wrt(["0.weight", "0.bias"], ["0.bias", "0.weight"])
        ['0.weight', '0.bias']
    """
    if grad_wrt is None:
        return None
    wanted = list(grad_wrt)
    unknown = [w for w in wanted if w not in names]
    if unknown or not wanted:
        raise ValueError(
            f"`grad_wrt` has names {unknown or wanted} that are not parameters of the "
            f"model; allowed names are {list(names)}. Take them from "
            "model.named_parameters()."
        )
    chosen = set(wanted)
    return [n for n in names if n in chosen]
