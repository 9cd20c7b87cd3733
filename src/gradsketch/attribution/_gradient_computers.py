"""Per-example gradients of the model output by ``torch.func.vmap`` and by a loop.

The interface (:class:`AbstractGradientComputer`, TRAK's) lives in
:mod:`._gradient_base`; the layer-hook computer in :mod:`._hook_computer`.
:class:`FunctionalGradientComputer` hands a model ``vmap`` cannot trace to
the hooks by the capture engine's one rule (:class:`~._capture.VmapChoice`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from gradsketch.attribution._capture import VmapChoice
from gradsketch.attribution._gradient_base import AbstractGradientComputer, resolve_grad_wrt
from gradsketch.attribution._hook_computer import HookGradientComputer
from gradsketch.attribution._modelout import resolve_batch_output
from gradsketch.errors import VmapTraceError

__all__ = [
    "AbstractGradientComputer",
    "FunctionalGradientComputer",
    "IterativeGradientComputer",
    "VmapTraceError",
    "resolve_grad_wrt",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")


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
    Whatever ``vmap`` raises on a batch, that batch goes to a
    :class:`~gradsketch.attribution.HookGradientComputer` on the same model
    (same per-example gradients, exactly); once the hooks have computed it,
    later batches go to them too and the reason is logged once. A batch the
    hooks cannot compute either raises their error and switches nothing.
    When the task has no batched output for hooks, :class:`VmapTraceError`
    says what to do instead.

    Takes :class:`AbstractGradientComputer`'s arguments; put the model in
    eval mode for deterministic outputs.

    Example:
        >>> from gradsketch.attribution import ImageClassificationModelOutput
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3))
        >>> gc = FunctionalGradientComputer(model, ImageClassificationModelOutput(), 15,
        ...                                 torch.float32, "cpu", grad_wrt=["0.weight"])
        >>> grads = gc.compute_per_sample_grad((torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])))
        >>> {k: tuple(v.shape) for k, v in grads.items()}
        {'0.weight': (5, 3, 4)}
    """

    def _setup(self) -> None:
        self._vmapped: dict[int, Callable[..., dict[str, Tensor]]] = {}
        #: The layer-hook computer that took over when vmap could not trace the model.
        self.hooks: HookGradientComputer | None = None
        self._vmap: VmapChoice[Any] = VmapChoice()
        self.load_model_params(self.model)

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
            BatchFormatError: the batch cannot be the model's input (named before
                any forward pass; nothing is switched).
            VmapTraceError: ``vmap`` cannot trace the model and the task has no
                batched output for layer hooks (see the class docstring).
        """
        self.check_batch(batch)
        fn = self._per_sample_fn(len(batch))
        result: dict[str, Tensor] = self._vmap.run(
            lambda: fn(self.func_weights, self.func_buffers, *batch),
            lambda reason: self._on_hooks(reason, lambda h: h.compute_per_sample_grad(batch)),
            on_switch=self._log_switch,
        )
        return result

    def project(self, batch: Sequence[Tensor], projector: Any, model_id: int | None) -> Tensor:
        """``[batch, proj_dim]`` projected gradients: vmap's, or the hooks' once they take over.

        The batch that vmap fails on is projected by the hooks'
        :meth:`HookGradientComputer.project` too, which streams each layer
        into the projector instead of holding every per-example gradient. A
        subclass that overrides :meth:`compute_per_sample_grad` has that
        projected (the interface's default).
        """
        if self.hooks is not None:
            return self.hooks.project(batch, projector, model_id)
        if (
            type(self).compute_per_sample_grad
            is not FunctionalGradientComputer.compute_per_sample_grad
        ):
            # A subclass's own per-example gradients are what it projects.
            return super().project(batch, projector, model_id)
        self.check_batch(batch)
        fn = self._per_sample_fn(len(batch))
        # vmap's gradients are projected outside the choice, so that an error of
        # the projector itself is never taken for a tracing failure.
        grads: dict[str, Tensor] | Tensor = self._vmap.run(
            lambda: fn(self.func_weights, self.func_buffers, *batch),
            lambda reason: self._on_hooks(reason, lambda h: h.project(batch, projector, model_id)),
            on_switch=self._log_switch,
        )
        if isinstance(grads, Tensor):
            return grads
        return projector.project(grads, model_id=model_id)  # type: ignore[no-any-return]

    def _on_hooks(self, reason: str, work: Callable[[HookGradientComputer], T]) -> T:
        """``work`` on the layer-hook computer; a new one is kept only if ``work`` succeeds."""
        if self.hooks is not None:
            return work(self.hooks)
        hooks = self._new_hooks(reason)
        try:
            result = work(hooks)
        except BaseException:
            hooks.remove_hooks()
            raise
        self.hooks = hooks
        return result

    def _new_hooks(self, reason: str) -> HookGradientComputer:
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
        return hooks

    def _log_switch(self, reason: str) -> None:
        logger.warning(
            "FunctionalGradientComputer: torch.func.vmap cannot trace %s (%s); per-example "
            "gradients now come from layer hooks (HookGradientComputer), which are exact too. "
            "Pass gradient_computer=HookGradientComputer to choose them from the start.",
            type(self.model).__name__,
            reason,
        )

    def compute_loss_grad(self, batch: Sequence[Tensor]) -> Tensor:
        """``[batch, 1]`` out-to-loss terms from the task.

        Once the hooks took over, theirs: right after they projected the same
        batch, the model output of that forward is reused instead of another.
        """
        if self.hooks is not None:
            return self.hooks.compute_loss_grad(batch)
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

    Takes :class:`AbstractGradientComputer`'s arguments; ``task`` must be a
    model output whose ``get_output(model, None, None, *batch)`` returns
    ``[batch]`` outputs.

    Example:
        >>> from gradsketch.attribution import TASK_TO_MODELOUT
        >>> model = torch.nn.Linear(4, 3)
        >>> task = TASK_TO_MODELOUT["iterative_image_classification"]()
        >>> gc = IterativeGradientComputer(model, task, 15, torch.float32, "cpu")
        >>> gc.compute_per_sample_grad((torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1]))).shape
        torch.Size([5, 15])
    """

    def _setup(self) -> None:
        self.load_model_params(self.model)

    def load_model_params(self, model: nn.Module) -> None:
        """Take the model and the parameters to differentiate (in model order)."""
        self.model = model
        params = dict(model.named_parameters())
        keep = self.grad_wrt if self.grad_wrt is not None else list(params)
        self.model_params: dict[str, Tensor] = {n: params[n] for n in keep}

    def _grads(self, batch: Sequence[Tensor]) -> dict[str, Tensor]:
        """``{name: [batch, *shape]}``, one backward pass per example."""
        self.check_batch(batch)
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
