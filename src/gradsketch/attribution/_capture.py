"""The capture engine: one hooked forward and backward, shared by every per-layer computation.

Per-example gradients (:class:`~gradsketch.attribution.HookGradientComputer`)
and Kronecker factors (:func:`~gradsketch.attribution._layer_capture.capture_layers`)
see a model the same way, as opacus's ``GradSampleModule`` does for its
per-layer samplers: a forward hook on each module of interest keeps the
call's inputs (detached) as a :class:`CallRecord`, splits its rows by example
(:class:`~gradsketch.attribution._layers._rows.RowLayout`), and hands the
caller the outputs routed through an autograd edge of their own
(:class:`OutputRouter`); one backward of the summed output then asks for the
gradient at every edge (:func:`backward_to_outputs`), so no parameter
gradient is ever computed. What a module's record is turned into (a
per-example gradient, Kronecker factors, a projection) is the per-layer rule
of :mod:`gradsketch.attribution._layers`, keyed by module type; a module
without one gets its parameters' per-example gradients from ``torch.func`` on
its stored inputs (:func:`module_grads_on_inputs`).

**One rule for leaving vmap** (:class:`VmapChoice`). Wherever ``torch.func.vmap``
is tried first (the whole model in
:class:`~gradsketch.attribution.FunctionalGradientComputer`, one module's
fallback here), a batch it fails on goes to the other path (layer hooks, or
one ``autograd.grad`` per example). The choice is kept for later batches only
once the other path has computed that batch: a batch neither can compute (a
wrong input width, a label out of range) raises the other path's error and
leaves vmap in use.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from gradsketch.attribution._layers._rows import by_example, leaf_rows, unflatten
from gradsketch.errors import WrappedModelError

__all__ = [
    "CallRecord",
    "OutputRouter",
    "VmapChoice",
    "backward_to_outputs",
    "contract",
    "detach_tree",
    "first_line",
    "first_shape",
    "is_vmap_trace_failure",
    "model_family",
    "module_grads_on_inputs",
    "refuse_wrapped",
    "shapes_of",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")


# -- the model ---------------------------------------------------------------------
def _wrapper_types() -> tuple[type, ...]:
    types: list[type] = [nn.DataParallel]
    if torch.distributed.is_available():
        from torch.nn.parallel import DistributedDataParallel

        types.append(DistributedDataParallel)
        try:
            from torch.distributed.fsdp import FullyShardedDataParallel

            types.append(FullyShardedDataParallel)
        except ImportError:  # pragma: no cover - depends on the torch build
            pass
        try:
            from torch.distributed.fsdp import FSDPModule

            types.append(FSDPModule)
        except ImportError:  # pragma: no cover - depends on the torch build
            pass
    return tuple(types)


def refuse_wrapped(model: nn.Module) -> None:
    """Raise :class:`WrappedModelError` if ``model`` or a submodule is DP / DDP / FSDP.

    Their forward scatters, shards or synchronises: hooks would see shards or
    replicas, not the batch, and the wrapper's own hooks would fire. Pass the
    wrapped module instead (featurization shards *rows* across ranks, each
    rank running the plain model).
    """
    wrappers = _wrapper_types()
    for name, module in model.named_modules():
        if isinstance(module, wrappers):
            where = "the model" if not name else f"submodule {name!r}"
            raise WrappedModelError(
                f"{where} is wrapped in {type(module).__name__}; layer hooks need the plain "
                "module. Pass `model.module` (for FSDP, the unwrapped model) to "
                "HookGradientComputer / TRAKer, and split the training rows across ranks instead."
            )


def model_family(model: nn.Module) -> str:
    """``"OPTForCausalLM (model_type 'opt')"``: the class and, for Hugging Face, the family."""
    base = getattr(model, "get_base_model", None)
    target = base() if callable(base) else model
    model_type = getattr(getattr(target, "config", None), "model_type", None)
    name = type(target).__name__
    return f"{name} (model_type {model_type!r})" if model_type else name


def detach_tree(value: Any) -> Any:
    """``value`` with every tensor in it detached."""
    return tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, value)


def shapes_of(value: Any) -> str:
    """``"(2, 3), (4,)"``: the shapes of the first four tensors in ``value``."""
    shapes = [tuple(t.shape) for t in tree_flatten(value)[0] if isinstance(t, Tensor)]
    return ", ".join(str(s) for s in shapes[:4]) or "no tensor"


def first_shape(value: Any) -> tuple[int, ...]:
    """The shape of the first tensor in ``value`` (``()`` if none)."""
    first = next((t for t in tree_flatten(value)[0] if isinstance(t, Tensor)), None)
    return () if first is None else tuple(first.shape)


# -- one call of a hooked module ----------------------------------------------------
@dataclass
class CallRecord:
    """One call of a hooked module: its inputs, rows, output edges and output gradients.

    Attributes:
        args: the positional inputs, detached.
        kwargs: the keyword inputs, detached.
        rows: ``{leading dim: rows per example}`` of the call's batch tensors.
        outputs: the floating outputs, detached (templates for unused ones).
        edges: the autograd edge of each floating output (until the backward).
        grads: the summed output's gradient at each output (``None``: unused).
        sampled: the sampled loss's gradient at each output (true Fisher), if asked.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rows: dict[int, int]
    outputs: list[Tensor] = field(default_factory=list)
    edges: list[GradientEdge] = field(default_factory=list)
    grads: list[Tensor | None] = field(default_factory=list)
    sampled: list[Tensor | None] = field(default_factory=list)

    def rule_inputs(self, batch_size: int) -> tuple[Any, ...]:
        """The positional inputs as the rules read them (flattened rows as ``[B, T, ...]``)."""
        return tuple(unflatten(a, batch_size, self.rows) for a in self.args)

    def rule_grad(self, g: Tensor | None, batch_size: int, index: int = 0) -> Tensor:
        """Output ``index``'s gradient ``g`` as the rules read it (zeros for ``None``)."""
        full = torch.zeros_like(self.outputs[index]) if g is None else g
        return unflatten(full, batch_size, self.rows)

    def grads_by_example(self, grads: Sequence[Tensor | None], batch_size: int) -> list[Tensor]:
        """The output gradients ``grads`` as ``[B, rows, ...]`` (zeros where unused)."""
        return [
            by_example(
                torch.zeros_like(t) if g is None else g, batch_size, self.rows[int(t.shape[0])]
            )
            for g, t in zip(grads, self.outputs)
        ]


class OutputRouter:
    """Routes a module's floating outputs through autograd edges recorded on its call."""

    def __init__(self) -> None:
        self._zeros: dict[tuple[torch.dtype, torch.device], Tensor] = {}

    def _zero(self, like: Tensor) -> Tensor:
        key = (like.dtype, like.device)
        if key not in self._zeros:
            self._zeros[key] = torch.zeros(
                (), dtype=like.dtype, device=like.device, requires_grad=True
            )
        return self._zeros[key]

    def route(self, output: Any, call: CallRecord, *, separate: bool) -> Any:
        """``output`` with each floating tensor's edge recorded on ``call``.

        The backward asks for the gradient at each output's edge, taken here
        before any in-place op of the caller, so it is the gradient of this
        value; a single output that requires grad is neither copied nor
        replaced. An output that does not require grad (frozen parameters so
        far) gets a path by adding a zero that does; so does each of several
        outputs (``separate``), because one may have been computed from
        another inside the module (a router's scores from its logits), and
        the first one's edge would then also collect the gradient that
        reached it through the second.
        """

        def one(t: Any) -> Any:
            if not (isinstance(t, Tensor) and t.is_floating_point()):
                return t
            routed = t if t.requires_grad and not separate else t + self._zero(t)
            call.outputs.append(t.detach())
            call.edges.append(get_gradient_edge(routed))
            return routed

        return tree_map(one, output)


def backward_to_outputs(
    total: Tensor,
    calls: Sequence[CallRecord],
    *,
    extra: Sequence[Tensor] = (),
    into: str = "grads",
    retain_graph: bool = False,
) -> list[Tensor | None]:
    """Gradients of ``total`` at every call's output edges, stored as ``call.<into>``.

    Returns the gradients at the ``extra`` targets (parameters read outside
    any hooked call), in their order.
    """
    edges: list[Any] = [e for c in calls for e in c.edges]
    targets = edges + list(extra)
    if not targets:
        for c in calls:
            setattr(c, into, [])
        return []
    got = torch.autograd.grad(total, targets, allow_unused=True, retain_graph=retain_graph)
    it = iter(got)
    for c in calls:
        setattr(c, into, [next(it) for _ in c.edges])
    return list(got[len(edges) :])


def release_edges(calls: Sequence[CallRecord]) -> None:
    """Drop the output edges (and the graph they hold) once the backwards are done."""
    for c in calls:
        c.edges.clear()


def contract(outputs: Sequence[Tensor], grads: Sequence[Tensor]) -> Tensor:
    """``sum_i <outputs_i, grads_i>``: its gradient at any earlier value is the chain rule's."""
    total = grads[0].new_zeros(()) if grads else outputs[0].new_zeros(())
    for o, g in zip(outputs, grads):
        total = total + (o * g).sum()
    return total


# -- the one rule for leaving vmap ---------------------------------------------------
def is_vmap_trace_failure(exc: BaseException) -> bool:
    """Whether an error raised while ``vmap`` traced should send the batch to the other path.

    Any :class:`Exception` does: ``vmap`` refuses models in many ways
    (data-dependent control flow, ``autograd.Function`` without
    ``setup_context`` as BLOOM's fused GELU, kernels without a batching
    rule, ``.item()``), and not all of them say "vmap". An error in the
    inputs themselves then surfaces from the other path, which runs the
    model as it is. Interrupts and exits (not :class:`Exception`) are never caught.

    Example:
        >>> is_vmap_trace_failure(RuntimeError("must override the setup_context staticmethod"))
        True
        >>> is_vmap_trace_failure(KeyboardInterrupt())
        False
    """
    return isinstance(exc, Exception)


def first_line(exc: BaseException, limit: int = 200) -> str:
    """``"RuntimeError: <first line, at most limit characters>"``."""
    text = str(exc).strip()
    line = text.splitlines()[0][:limit] if text else ""
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


@dataclass
class VmapChoice(Generic[T]):
    """Whether a computation runs under ``vmap`` or on its other path (module docstring).

    Attributes:
        ok: ``True`` once vmap computed a batch, ``False`` once a batch vmap
            failed on was computed by the other path (then kept), ``None``
            before either.
        reason: why vmap failed (``"RuntimeError: ..."``), once ``ok`` is False.

    Example:
        >>> choice = VmapChoice()
        >>> def fails():
        ...     raise RuntimeError("data-dependent control flow")
        >>> choice.run(fails, lambda reason: "looped")
        'looped'
        >>> choice.ok, choice.reason
        (False, 'RuntimeError: data-dependent control flow')
    """

    ok: bool | None = None
    reason: str | None = None

    def run(
        self,
        vmapped: Callable[[], T],
        other: Callable[[str], T],
        *,
        on_switch: Callable[[str], None] | None = None,
    ) -> T:
        """``vmapped()``, or ``other(reason)`` where vmap fails (or failed before).

        ``on_switch(reason)`` runs once, when ``other`` has computed the first
        batch vmap failed on. If ``other`` raises too, its error propagates and
        nothing is switched.
        """
        if self.ok is False:
            return other(self.reason or "")
        try:
            with warnings.catch_warnings():
                # vmap falls back to a loop for a few fused kernels (CPU flash
                # attention) and says so; the result is exact, nothing is actionable.
                warnings.filterwarnings(
                    "ignore", message="There is a performance drop", category=UserWarning
                )
                result = vmapped()
        except BaseException as exc:
            if not is_vmap_trace_failure(exc):
                raise
            reason = first_line(exc)
        else:
            self.ok = True
            return result
        result = other(reason)
        self.ok, self.reason = False, reason
        if on_switch is not None:
            on_switch(reason)
        return result


# -- modules without a rule: torch.func on their stored inputs ------------------------
def module_grads_on_inputs(
    call: CallRecord,
    module: nn.Module,
    names: Sequence[str],
    batch_size: int,
    choice: VmapChoice[dict[str, Tensor]],
    label: str,
) -> dict[str, Tensor]:
    """Per-example gradients ``{local name: [B, *shape]}`` of a module's parameters ``names``.

    ``grad_b = d/dθ <module(x_b; θ), g_b>`` where ``x_b`` are example ``b``'s
    rows of every batch input (``[1, ...]`` for the batch on dim 0, ``[T,
    ...]`` for flattened rows) and ``g_b`` its rows of the output gradients:
    ``vmap``-ed over the examples, or, for a module ``vmap`` cannot trace
    (data-dependent control flow: a mixture of experts picking its tokens),
    one ``autograd.grad`` per example, as ``choice`` decides.
    """
    if all(g is None for g in call.grads):
        return {}
    wanted = set(names)
    params = {k: p.detach() for k, p in module.named_parameters() if k in wanted}
    leaves, spec = tree_flatten((call.args, call.kwargs))
    split = [leaf_rows(t, call.rows) for t in leaves]
    inputs = [by_example(t, batch_size, r) for t, r in zip(leaves, split) if r is not None]
    grads = call.grads_by_example(call.grads, batch_size)

    def contracted(p: dict[str, Tensor], xs: Sequence[Tensor], gs: Sequence[Tensor]) -> Tensor:
        it = iter(xs)
        full = [next(it) if r is not None else t for t, r in zip(leaves, split)]
        args, kwargs = tree_unflatten(full, spec)
        out = torch.func.functional_call(module, p, args, kwargs)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor) and t.is_floating_point()]
        return contract(outs, gs)

    def vmapped() -> dict[str, Tensor]:
        per_example = torch.func.vmap(torch.func.grad(contracted), in_dims=(None, 0, 0))
        result: dict[str, Tensor] = per_example(params, inputs, grads)
        return result

    def looped(reason: str) -> dict[str, Tensor]:
        return _looped_grads(contracted, params, inputs, grads, batch_size)

    def switched(reason: str) -> None:
        logger.info(
            "HookGradientComputer: torch.func.vmap cannot trace %r (%s); its per-example "
            "gradients come from one autograd.grad per example",
            label,
            reason[:160],
        )

    return choice.run(vmapped, looped, on_switch=switched)


def _looped_grads(
    contracted: Callable[[dict[str, Tensor], Sequence[Tensor], Sequence[Tensor]], Tensor],
    params: dict[str, Tensor],
    inputs: Sequence[Tensor],
    grads: Sequence[Tensor],
    batch_size: int,
) -> dict[str, Tensor]:
    """``{name: [B, *shape]}``: one ``autograd.grad`` of the contracted output per example."""
    rows: dict[str, list[Tensor]] = {k: [] for k in params}
    for b in range(batch_size):
        leaves = {k: p.detach().requires_grad_(True) for k, p in params.items()}
        with torch.enable_grad():
            value = contracted(leaves, [x[b] for x in inputs], [g[b] for g in grads])
            got = torch.autograd.grad(
                value, list(leaves.values()), allow_unused=True, materialize_grads=True
            )
        for k, g in zip(leaves, got):
            rows[k].append(g)
    return {k: torch.stack(v) for k, v in rows.items()}
