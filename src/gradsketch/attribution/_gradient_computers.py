"""Per-example gradients of the model output, projected to TRAK features.

The interface is TRAK's (``load_model_params``, ``compute_per_sample_grad``,
``compute_loss_grad``) plus one derived method, :meth:`AbstractGradientComputer.project`,
which is what :class:`TRAKer` calls. Its default computes per-example
gradients and hands them to the projector; a computer that never materialises
per-example gradients (layer hooks that project Kronecker factors directly)
overrides ``project`` alone and plugs into TRAKer unchanged.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from gradsketch.attribution._modelout import AbstractModelOutput
from gradsketch.errors import GradsketchError

logger = logging.getLogger(__name__)


class VmapTraceError(GradsketchError, RuntimeError):
    """``torch.func.vmap`` cannot trace the model, and layer hooks cannot stand in."""


class AbstractGradientComputer(ABC):
    """Computes per-example gradients of a model output (TRAK's interface).

    Args:
        model: the model.
        task: the model output function.
        grad_dim: number of gradient coordinates (informative).
        dtype: dtype of stored features.
        device: where gradients are computed.
    """

    def __init__(
        self,
        model: nn.Module,
        task: AbstractModelOutput,
        grad_dim: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.model = model
        self.modelout_fn = task
        self.grad_dim = grad_dim
        self.dtype = dtype
        self.device = device

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


def _is_vmap_trace_failure(exc: BaseException) -> bool:
    """Whether an error raised while ``vmap`` traced the model should hand it to the hooks.

    Any :class:`Exception` does: ``vmap`` refuses models in many ways
    (data-dependent control flow, ``autograd.Function`` without
    ``setup_context`` as BLOOM's fused GELU, kernels without a batching
    rule, ``.item()``), and not all of them say "vmap". An error in the
    inputs themselves then surfaces from the hooks, which run the model as
    it is. Interrupts and exits (not :class:`Exception`) are never caught.

    Example:
        >>> _is_vmap_trace_failure(RuntimeError("must override the setup_context staticmethod"))
        True
        >>> _is_vmap_trace_failure(KeyboardInterrupt())
        False
    """
    return isinstance(exc, Exception)


def _first_line(exc: BaseException) -> str:
    """``"RuntimeError: <first line, at most 200 characters>"``."""
    text = str(exc).strip()
    line = text.splitlines()[0][:200] if text else ""
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


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


class FunctionalGradientComputer(AbstractGradientComputer):
    """Per-example gradients with ``torch.func.vmap(torch.func.grad(...))``.

    With ``grad_wrt``, the model is called through ``functional_call`` with
    the selected parameters as the differentiated argument and every other
    parameter passed as a constant, so gradients of the others are never
    computed (TRAK computes all and then drops some).

    Some models cannot be traced by ``vmap``: Hugging Face transformers
    decide how to build the attention mask from its values (data-dependent
    control flow), BLOOM's GELU is an ``autograd.Function`` that functorch
    cannot transform, mixture-of-experts layers pick their tokens by value.
    Whatever ``vmap`` raises on the first batch, the computation then moves
    to a :class:`~gradsketch.attribution.HookGradientComputer` on the same
    model (same per-example gradients, exactly), and the reason is logged
    once; when the task has no batched output for hooks,
    :class:`VmapTraceError` says what to do instead.

    Args:
        model: the model (put it in eval mode for deterministic outputs).
        task: the model output function.
        grad_dim: number of gradient coordinates (informative).
        dtype: dtype of stored features.
        device: where gradients are computed.
        grad_wrt: names of the parameters to differentiate (``None``: all).

    Example:
        >>> from gradsketch.attribution import ImageClassificationModelOutput
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3))
        >>> gc = FunctionalGradientComputer(model, ImageClassificationModelOutput(), 15,
        ...                                 torch.float32, "cpu", grad_wrt=["0.weight"])
        >>> grads = gc.compute_per_sample_grad((torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])))
        >>> {k: tuple(v.shape) for k, v in grads.items()}
        {'0.weight': (5, 3, 4)}
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
        super().__init__(model, task, grad_dim, dtype, device)
        names = [name for name, _ in model.named_parameters()]
        self.grad_wrt: list[str] | None = resolve_grad_wrt(names, grad_wrt)
        self._vmapped: dict[int, Callable[..., dict[str, Tensor]]] = {}
        #: The layer-hook computer that took over when vmap could not trace the model.
        self.hooks: AbstractGradientComputer | None = None
        self.load_model_params(model)

    def load_model_params(self, model: nn.Module) -> None:
        """Split the parameters into differentiated weights and constants."""
        if self.hooks is not None:
            self.hooks.load_model_params(model)
        self.model = model
        params = {n: p.detach() for n, p in model.named_parameters()}
        keep = self.grad_wrt if self.grad_wrt is not None else list(params)
        self.func_weights = {n: params[n] for n in keep}
        frozen = {n: p for n, p in params.items() if n not in self.func_weights}
        self.func_buffers = {**frozen, **{n: b.detach() for n, b in model.named_buffers()}}

    def _output(
        self, weights: dict[str, Tensor], buffers: dict[str, Tensor], *example: Any
    ) -> Tensor:
        return self.modelout_fn.get_output(self.model, weights, buffers, *example)

    def _per_sample_fn(self, arity: int) -> Callable[..., dict[str, Tensor]]:
        # Built once per batch arity and reused: no re-wrapping per batch.
        if arity not in self._vmapped:
            grad_fn = torch.func.grad(self._output, argnums=0)
            self._vmapped[arity] = torch.func.vmap(
                grad_fn, in_dims=(None, None, *([0] * arity)), randomness="different"
            )
        return self._vmapped[arity]

    def compute_per_sample_grad(self, batch: Sequence[Tensor]) -> dict[str, Tensor]:
        """``{name: [batch, *shape]}`` for the differentiated parameters, in model order.

        Raises:
            VmapTraceError: ``vmap`` cannot trace the model and the task has no
                batched output for layer hooks (see the class docstring).
        """
        if self.hooks is not None:
            return self.hooks.compute_per_sample_grad(batch)
        fn = self._per_sample_fn(len(batch))
        try:
            return fn(self.func_weights, self.func_buffers, *batch)
        except BaseException as exc:
            if not _is_vmap_trace_failure(exc):
                raise
            reason = _first_line(exc)
        return self._route_to_hooks(reason).compute_per_sample_grad(batch)

    def project(self, batch: Sequence[Tensor], projector: Any, model_id: int | None) -> Tensor:
        """``[batch, proj_dim]`` projected gradients (through the hooks once they took over)."""
        if self.hooks is not None:
            return self.hooks.project(batch, projector, model_id)
        return super().project(batch, projector, model_id)

    def _route_to_hooks(self, reason: str) -> AbstractGradientComputer:
        # Imported here: the hook computer is built on this module.
        from gradsketch.attribution._hook_computer import HookGradientComputer
        from gradsketch.attribution._modelout import resolve_batch_output

        model_type = type(self.model).__name__
        try:
            resolve_batch_output(self.modelout_fn)
        except ValueError:
            raise VmapTraceError(
                f"torch.func.vmap cannot trace {model_type} ({reason}), so "
                "FunctionalGradientComputer cannot give its per-example gradients (Hugging Face "
                "models build their attention masks with data-dependent control flow, among "
                "other things vmap refuses). Use HookGradientComputer "
                "(TRAKer(..., gradient_computer=HookGradientComputer)); "
                f"it needs a batched output for the task {type(self.modelout_fn).__name__}: "
                "give it a method `get_batch_output(model, *batch) -> [B]` or register one "
                "with @register_batch_output."
            ) from None
        logger.warning(
            "FunctionalGradientComputer: torch.func.vmap cannot trace %s (%s); per-example "
            "gradients now come from layer hooks (HookGradientComputer), which are exact too. "
            "Pass gradient_computer=HookGradientComputer to choose them from the start.",
            model_type,
            reason,
        )
        hooks = HookGradientComputer(
            self.model,
            self.modelout_fn,
            self.grad_dim,
            self.dtype,
            self.device,
            grad_wrt=self.grad_wrt,
        )
        # Its errors then point elsewhere than back to this computer.
        hooks.vmap_failure = reason
        self.hooks = hooks
        return hooks

    def compute_loss_grad(self, batch: Sequence[Tensor]) -> Tensor:
        """``[batch, 1]`` out-to-loss terms from the task."""
        return self.modelout_fn.get_out_to_loss_grad(
            self.model, self.func_weights, self.func_buffers, batch
        )


class IterativeGradientComputer(AbstractGradientComputer):
    """Per-example gradients with one ``torch.autograd.grad`` call per example (trak's path).

    trak's non-functorch computer: the task's :meth:`get_output` runs once on
    the whole batch (``weights`` and ``buffers`` are passed as ``None``) and
    returns ``[batch]`` outputs; each example's output is then differentiated
    alone. Slower than :class:`FunctionalGradientComputer` (``batch``
    backward passes) but it needs neither ``vmap`` nor layer hooks, so any
    model autograd can differentiate works. Use it with the task
    ``"iterative_image_classification"`` or any task whose ``get_output``
    takes a batch.

    Differences from trak 0.3.2, both deliberate: ``grad_wrt`` is honoured
    (trak warns and differentiates every parameter, which then does not fit
    a projector built for the selection), and gradients keep the parameters'
    dtype (trak stores them in float32).

    Args:
        model: the model.
        task: a model output whose ``get_output(model, None, None, *batch)``
            returns ``[batch]`` outputs.
        grad_dim: number of gradient coordinates (informative).
        dtype: dtype of stored features.
        device: where gradients are computed.
        grad_wrt: names of the parameters to differentiate (``None``: all).

    Example:
        >>> from gradsketch.attribution import TASK_TO_MODELOUT
        >>> model = torch.nn.Linear(4, 3)
        >>> task = TASK_TO_MODELOUT["iterative_image_classification"]()
        >>> gc = IterativeGradientComputer(model, task, 15, torch.float32, "cpu")
        >>> gc.compute_per_sample_grad((torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1]))).shape
        torch.Size([5, 15])
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
        super().__init__(model, task, grad_dim, dtype, device)
        names = [name for name, _ in model.named_parameters()]
        self.grad_wrt: list[str] | None = resolve_grad_wrt(names, grad_wrt)
        self.load_model_params(model)

    def load_model_params(self, model: nn.Module) -> None:
        """Take the model and the parameters to differentiate (in model order)."""
        self.model = model
        params = dict(model.named_parameters())
        keep = self.grad_wrt if self.grad_wrt is not None else list(params)
        self.model_params: dict[str, Tensor] = {n: params[n] for n in keep}

    def _grads(self, batch: Sequence[Tensor]) -> dict[str, Tensor]:
        """``{name: [batch, *shape]}``, one backward pass per example."""
        with torch.enable_grad():
            outputs = self.modelout_fn.get_output(self.model, None, None, *batch)  # type: ignore[arg-type]
            if outputs.dim() != 1:
                raise ValueError(
                    f"`task` {type(self.modelout_fn).__name__}.get_output returned shape "
                    f"{tuple(outputs.shape)}; IterativeGradientComputer needs one output per "
                    "example, [batch]. Use a batched task such as "
                    "'iterative_image_classification', or FunctionalGradientComputer."
                )
            names, params = list(self.model_params), list(self.model_params.values())
            out = {n: p.new_zeros(outputs.shape[0], *p.shape) for n, p in zip(names, params)}
            for i in range(outputs.shape[0]):
                grads = torch.autograd.grad(
                    outputs[i], params, retain_graph=i + 1 < outputs.shape[0], allow_unused=True
                )
                for n, g in zip(names, grads):
                    if g is not None:  # a parameter this output does not use: zero gradient
                        out[n][i] = g
        return out

    def compute_per_sample_grad(self, batch: Sequence[Tensor]) -> Tensor:  # type: ignore[override]
        """``[batch, grad_dim]``: each example's gradient flattened, parameters in model order.

        trak's shape; :meth:`project` hands the projector the per-parameter
        blocks instead, so that a projector's mask applies.
        """
        grads = self._grads(batch)
        return torch.cat([g.flatten(1) for g in grads.values()], dim=1)

    def project(self, batch: Sequence[Tensor], projector: Any, model_id: int | None) -> Tensor:
        """``[batch, proj_dim]`` projected gradients."""
        return projector.project(self._grads(batch), model_id=model_id)  # type: ignore[no-any-return]

    def compute_loss_grad(self, batch: Sequence[Tensor]) -> Tensor:
        """``[batch, 1]`` out-to-loss terms from the task."""
        return self.modelout_fn.get_out_to_loss_grad(self.model, None, None, batch)  # type: ignore[arg-type]
