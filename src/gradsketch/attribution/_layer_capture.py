"""The factored layers of a model, and one hooked pass capturing their inputs and output gradients.

For every module with a layer-factor rule (:func:`register_layer_factors`:
Linear, Conv2d, Hugging Face ``Conv1D``), and every expert ``W[e]`` of a
mixture-of-experts container's stacked 3-D weight ``W [E, d_out, d_in]``
(Mixtral, Qwen2-MoE, OLMoE...: ``F.linear(x_routed, W[e])``), :func:`capture_layers` runs one
hooked forward and one backward of the task's summed output and returns,
per layer, the inputs ``a [B, T, d_in]`` and output gradients
``g [B, T, d_out]`` whose products ``sum_t g_t a_tᵀ`` are the per-example
weight gradients. K-FAC / EK-FAC fit their factors from them and the
Kronecker featurizer stores ``vec(sum_t g_t a_tᵀ)``.

A layer's rows are split by example as the layer hooks split them (see
:mod:`gradsketch.attribution._layers._rows`): the batch on dim 0, or the
batch flattened with one of its lengths (OPT's ``fc1`` / ``fc2`` see
``[B * T, d]``), which is read back as ``[B, T, d]``. Layers inside a
mixture-of-experts container (a module of
:data:`~gradsketch.attribution._layers.WHOLE_MODULES`) see the tokens the
router picked, a data-dependent subset that no shape assigns to examples:
the container's inputs and output gradients are captured instead, and the
container runs again on each example's rows alone, where the layer's rows
are that example's. Their ``a`` and ``g`` are ``[B, R, d]`` with ``R`` the
most rows any example routed to the layer in the batch, zero rows padding
the others (zero rows add nothing to ``sum_t g_t a_tᵀ``; K-FAC leaves them
out of ``A``'s mean).

A stacked weight's experts are factored layers of their own, ``E`` in a row
(names ``"<param>.<e>"``), so that their features ``vec(sum_t g_t a_tᵀ)``,
concatenated, are the 3-D weight's per-example gradient flattened row-major
and K-FAC's curvature is block-diagonal by expert. During the container's
rerun, calls ``F.linear(x, W[e])`` whose weight is a view of a registered
stacked weight are intercepted (a :class:`~torch.overrides.TorchFunctionMode`;
the expert is the view's storage offset), their ``x`` kept as ``a`` and
their outputs routed for ``g``; so are ``x @ W[e]`` of transformers'
transposed ``[E, d_in, d_out]`` weights (gpt-oss, Aria), with their
``<weight>_bias [E, d_out]``. Transformers' experts run their eager
implementation while capturing (grouped or batched matmuls call neither).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from gradsketch.attribution._capture import (
    CallRecord,
    OutputRouter,
    backward_to_outputs,
    contract,
    detach_tree,
    first_shape,
    model_family,
    release_edges,
)
from gradsketch.attribution._layers import (
    LAYER_FACTORS,
    WHOLE_MODULES,
    HookComputationError,
    register_optional_rules,
)
from gradsketch.attribution._layers._rows import (
    RowLayout,
    batch_lengths,
    by_example,
    leaf_rows,
)

__all__ = ["FactoredLayer", "capture_layers", "find_layers"]

logger = logging.getLogger(__name__)


@dataclass
class FactoredLayer:
    """A factored layer: its module, parameters and (projected) gradient shape.

    ``container`` names the mixture-of-experts container the layer sits in
    (its rows are a routed subset of the tokens), or is ``None``. ``param``
    and ``expert`` name the stacked 3-D weight ``W [E, d_out, d_in]`` and
    the expert ``e`` whose slice ``W[e]`` the layer is (``module`` is then the
    weight's owner), or are ``None`` for a layer module; ``transposed``: the
    stacked weight is ``[E, d_in, d_out]``, called as ``x @ W[e]``. Its
    features are still ``[d_out, d_in (+ bias)]``, as ``Conv1D``'s are.
    """

    name: str
    module: nn.Module
    bias: bool
    d_in: int  # inputs per position, with the bias column
    d_out: int
    k_in: int  # stored input side (d_in without projection)
    k_out: int
    offset: int = 0
    container: str | None = None
    param: str | None = None
    expert: int | None = None
    transposed: bool = False

    @property
    def width(self) -> int:
        return self.k_out * self.k_in

    @property
    def param_names(self) -> tuple[str, ...]:
        """Full names of the parameters whose gradient the layer's features are."""
        if self.param is not None:
            return (self.param,) + ((self.param + "_bias",) if self.bias else ())
        prefix = f"{self.name}." if self.name else ""
        return (prefix + "weight",) + ((prefix + "bias",) if self.bias else ())

    def weight(self) -> Tensor:
        """The weight tensor: the module's, or the whole stacked weight of an expert."""
        if self.param is not None:
            w = self.module.get_parameter(self.param.rsplit(".", 1)[-1])
        else:
            w = self.module.weight  # type: ignore[assignment]
        assert isinstance(w, Tensor)
        return w


def _layer_dims(module: nn.Module) -> tuple[int, int]:
    """``(d_in, d_out)`` of a factored module (Conv2d: ``C_in kh kw``, ``C_out``)."""
    if isinstance(module, nn.Conv2d):
        kh, kw = module.kernel_size
        return module.in_channels * kh * kw, module.out_channels
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    weight = module.weight
    assert isinstance(weight, Tensor)
    return int(weight.shape[0]), int(weight.shape[1])  # Conv1D: [d_in, d_out]


def _factored(
    name: str,
    module: nn.Module,
    bias: bool,
    d_in: int,
    d_out: int,
    projection: tuple[int, int] | None,
    **where: Any,
) -> FactoredLayer:
    """The layer of a ``[d_out, d_in]`` weight, its stored sides capped at its own.

    A bias adds an input column; without ``projection`` the sides are whole.
    ``where`` are the :class:`FactoredLayer` fields that place it (``container``,
    ``param``, ``expert``, ``transposed``).
    """
    d_in += int(bias)
    k_in, k_out = (d_in, d_out) if projection is None else projection
    return FactoredLayer(
        name, module, bias, d_in, d_out, min(k_in, d_in), min(k_out, d_out), **where
    )


def _containers(model: nn.Module) -> dict[str, str]:
    """Module name -> the outermost :data:`WHOLE_MODULES` container strictly above it."""
    inside: dict[str, str] = {}
    for name, module in model.named_modules():
        if type(module) not in WHOLE_MODULES or name in inside:
            continue
        for sub, _ in module.named_modules():
            if sub:
                inside.setdefault(f"{name}.{sub}" if name else sub, name)
    return inside


def find_layers(
    model: nn.Module,
    grad_wrt: Sequence[str] | None,
    projection: tuple[int, int] | None,
) -> list[FactoredLayer]:
    """The modules with a layer-factor rule whose weight is differentiated, in model order."""
    register_optional_rules(model)  # Hugging Face's Conv1D and experts, once transformers is loaded
    wanted = None if grad_wrt is None else set(grad_wrt)
    inside = _containers(model)
    layers: list[FactoredLayer] = []
    offset = 0
    for name, module in model.named_modules():
        if type(module) in WHOLE_MODULES:
            for layer in _stacked_layers(name, module, wanted, projection, inside):
                layer.offset = offset
                offset += layer.width
                layers.append(layer)
        if type(module) not in LAYER_FACTORS:
            continue
        if isinstance(module, nn.Conv2d) and module.groups != 1:
            logger.info("influence: Conv2d %r has groups=%d; left out", name, module.groups)
            continue
        prefix = f"{name}." if name else ""
        weight_name = prefix + "weight"
        if wanted is not None and weight_name not in wanted:
            continue
        bias_param = getattr(module, "bias", None)
        bias = isinstance(bias_param, Tensor) and (wanted is None or prefix + "bias" in wanted)
        d_in, d_out = _layer_dims(module)
        layer = _factored(name, module, bias, d_in, d_out, projection, container=inside.get(name))
        layer.offset = offset
        offset += layer.width
        layers.append(layer)
    if not layers:
        allowed = ", ".join(sorted(t.__name__ for t in LAYER_FACTORS))
        raise ValueError(
            f"the model has no differentiated layer of a factored type ({allowed}, or the "
            "stacked expert weights of a mixture-of-experts container); K-FAC "
            "influence needs at least one. Check `grad_wrt`, register your layer type with "
            "@register_layer_factors, or use bayesian_influence."
        )
    return layers


def _stacked_layers(
    name: str,
    module: nn.Module,
    wanted: set[str] | None,
    projection: tuple[int, int] | None,
    inside: dict[str, str],
) -> Iterator[FactoredLayer]:
    """One layer per expert of each differentiated 3-D weight a container owns directly.

    The weights are ``[E, d_out, d_in]``, called as ``F.linear(x, W[e])``,
    or with transformers' ``is_transposed`` (gpt-oss, Aria) ``[E, d_in, d_out]``,
    called as ``x @ W[e]``. A parameter ``<weight>_bias`` ``[E, d_out]`` beside
    it (transformers' ``has_bias`` layout) is the experts' bias. Transformers
    classes outside ``@use_experts_implementation`` (Llama 4's experts, one
    ``bmm`` over all of them) are left out, logged.
    """
    prefix = f"{name}." if name else ""
    params = dict(module.named_parameters(recurse=False))
    cls = type(module)
    if cls.__module__.startswith("transformers.") and not hasattr(module, "is_transposed"):
        # Not an @use_experts_implementation class: its weights may be read whole
        # (Llama 4's bmm over every expert), which no per-expert layer captures.
        stacked = [prefix + n for n, p in params.items() if p.dim() == 3]
        if stacked:
            logger.info(
                "influence: %s is no @use_experts_implementation class (transformers' "
                "per-expert layout); its stacked weights %s are left out of the per-layer "
                "features",
                cls.__name__,
                stacked,
            )
        return
    transposed = bool(getattr(module, "is_transposed", False))
    for local, param in params.items():
        full = prefix + local
        if param.dim() != 3 or (wanted is not None and full not in wanted):
            continue
        experts = int(param.shape[0])
        d_in, d_out = (int(d) for d in (param.shape[1:] if transposed else param.shape[:0:-1]))
        bias_param = params.get(local + "_bias")
        bias = (
            bias_param is not None
            and tuple(bias_param.shape) == (experts, d_out)
            and (wanted is None or full + "_bias" in wanted)
        )
        for e in range(experts):
            yield _factored(
                f"{full}.{e}",
                module,
                bias,
                d_in,
                d_out,
                projection,
                container=inside.get(name, name),
                param=full,
                expert=e,
                transposed=transposed,
            )


# -- one hooked pass ---------------------------------------------------------------
def _unmapped_error(model: nn.Module, name: str, shape: tuple[int, ...], layout: RowLayout) -> str:
    return (
        f"layer {name!r} of {model_family(model)} returned shape {shape} for a batch of "
        f"{layout.batch_size}: its rows are neither the batch (dim 0) nor the batch flattened "
        f"with one of its lengths {sorted(layout.lengths)}, so they cannot be assigned to "
        "examples (a data-dependent subset of the tokens, as the experts of a mixture of "
        "experts see, or a computation shared by every example). Leave its parameters out of "
        "`grad_wrt`; if it is an expert, register its container type with "
        "gradsketch.attribution._layers.register_whole_module; or use method='trak' with "
        "HookGradientComputer, which hands such modules to the module that encloses them."
    )


def capture_layers(
    model: nn.Module,
    layers: Sequence[FactoredLayer],
    batch_output: Any,
    batch: Sequence[Any],
    sampled_loss: Any = None,
) -> tuple[dict[str, tuple[Tensor, Tensor, Tensor | None]], Any]:
    """One hooked forward, and a backward of ``F = sum_b f(z_b)``.

    With ``sampled_loss`` (``fn(model_output) -> [B]``, the output kept in the
    graph), a second backward of its sum gives the layers' output gradients
    under sampled labels (the true Fisher's); the forward is shared.

    Returns:
        ``{layer name: (a [B, T, d_in], g [B, T, d_out], g_sampled or None)}``
        (inputs detached; a layer called twice has its calls' positions
        concatenated) and the root module's (detached) output.

    Raises:
        HookComputationError: a layer's rows cannot be assigned to examples
            (the message names the model, the layer and what to do instead).
    """
    batch_size = int(batch[0].shape[0])
    layout = RowLayout(batch_size, batch_lengths(batch, batch_size))
    direct = [x for x in layers if x.container is None]
    groups: dict[str, list[FactoredLayer]] = {}
    for x in layers:
        if x.container is not None:
            groups.setdefault(x.container, []).append(x)
    seen: dict[str, list[CallRecord]] = {
        name: [] for name in [x.name for x in direct] + list(groups)
    }
    router = OutputRouter()
    root: list[Any] = []

    def make_hook(name: str, single: bool) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
            if single and not isinstance(out, Tensor):
                raise TypeError(
                    f"layer {name!r} ({type(module).__name__}) returned "
                    f"{type(out).__name__}; factored layers must return one tensor."
                )
            rows = layout.call_rows((args, kwargs), out)
            if rows is None:
                raise HookComputationError(_unmapped_error(model, name, first_shape(out), layout))
            call = CallRecord(detach_tree(args), detach_tree(kwargs), rows)
            floating = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor)]
            routed = router.route(out, call, separate=len(floating) > 1)
            seen[name].append(call)
            return routed

        return hook

    modules = dict(model.named_modules())
    handles = [
        x.module.register_forward_hook(make_hook(x.name, True), with_kwargs=True) for x in direct
    ]
    handles += [
        modules[name].register_forward_hook(make_hook(name, False), with_kwargs=True)
        for name in groups
    ]
    handles.append(
        model.register_forward_hook(
            lambda m, args, out: root.append(
                out if isinstance(out, Tensor) else getattr(out, "logits", out)
            )
        )
    )
    stacked = {id(x.module): x.module for x in layers if x.param is not None}
    with _eager_experts(stacked.values()):
        try:
            with torch.enable_grad():
                outputs = batch_output(model, *batch)
                calls = [c for name in seen for c in seen[name]]
                backward_to_outputs(outputs.sum(), calls, retain_graph=sampled_loss is not None)
                if sampled_loss is not None:
                    if len(root) != 1:
                        raise RuntimeError(
                            "curvature='sampled' needs the model's output from one forward call; "
                            f"the model was called {len(root)} times for one batch."
                        )
                    backward_to_outputs(sampled_loss(root[0]).sum(), calls, into="sampled")
        finally:
            for h in handles:
                h.remove()
        release_edges(calls)
        result: dict[str, tuple[Tensor, Tensor, Tensor | None]] = {}
        with_sampled = sampled_loss is not None
        for layer in direct:
            result[layer.name] = _direct_parts(layer, seen[layer.name], batch_size, with_sampled)
        for name, inner in groups.items():
            result.update(
                _container_parts(modules[name], name, inner, seen[name], batch_size, with_sampled)
            )
    if len(root) != 1:
        return result, None
    return result, (root[0].detach() if isinstance(root[0], Tensor) else root[0])


@contextlib.contextmanager
def _eager_experts(containers: Iterable[nn.Module]) -> Iterator[None]:
    """Transformers' experts modules run their eager forward (``F.linear`` per expert).

    ``@use_experts_implementation`` dispatches on the model config's
    ``_experts_implementation``; grouped or batched matmuls compute the same
    outputs without the per-expert ``F.linear`` calls that the capture reads.
    """
    saved: list[tuple[Any, Any]] = []
    for module in containers:
        config = getattr(module, "config", None)
        current = getattr(config, "_experts_implementation_internal", None)
        if current is not None and current != "eager" and all(c is not config for c, _ in saved):
            logger.debug("influence: %s runs its eager experts while capturing", type(module))
            saved.append((config, current))
            config._experts_implementation_internal = "eager"  # type: ignore[union-attr]
    try:
        yield
    finally:
        for config, value in reversed(saved):
            config._experts_implementation_internal = value


def _direct_parts(
    layer: FactoredLayer, calls: Sequence[CallRecord], batch_size: int, with_sampled: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(a, g, g_sampled)`` of a layer hooked on its own, its calls' positions concatenated."""
    if not calls:
        raise RuntimeError(
            f"layer {layer.name!r} was not called in the forward; influence needs every "
            "factored layer to run. Pass grad_wrt without its parameters."
        )
    rule = LAYER_FACTORS[type(layer.module)]
    parts_a, parts_g, parts_s = [], [], []
    for call in calls:
        args = call.rule_inputs(batch_size)
        a3, g3 = rule(layer.module, args, call.rule_grad(call.grads[0], batch_size))
        parts_a.append(a3.detach())
        parts_g.append(g3.detach())
        if with_sampled:
            gs = call.rule_grad(call.sampled[0], batch_size)
            parts_s.append(rule(layer.module, args, gs)[1].detach())
    return (
        torch.cat(parts_a, 1),
        torch.cat(parts_g, 1),
        torch.cat(parts_s, 1) if parts_s else None,
    )


def _container_parts(
    container: nn.Module,
    container_name: str,
    layers: Sequence[FactoredLayer],
    calls: Sequence[CallRecord],
    batch_size: int,
    with_sampled: bool,
) -> dict[str, tuple[Tensor, Tensor, Tensor | None]]:
    """``(a, g, g_sampled)`` of the layers inside a mixture-of-experts container.

    The container runs again on each example's rows (its inputs as captured,
    sliced by example), with hooks on its factored layers; one backward of
    ``<container(x_b), g_b>`` gives the layers' output gradients for that
    example alone. Rows are padded with zeros to the most any example has.
    """
    per_example: dict[str, list[list[tuple[Tensor, Tensor, Tensor | None]]]] = {
        x.name: [[] for _ in range(batch_size)] for x in layers
    }
    for call in calls:
        leaves, spec = tree_flatten((call.args, call.kwargs))
        split = [leaf_rows(t, call.rows) for t in leaves]
        views = [t if r is None else by_example(t, batch_size, r) for t, r in zip(leaves, split)]
        outs = call.grads_by_example(call.grads, batch_size)
        outs_s = call.grads_by_example(call.sampled, batch_size)
        for b in range(batch_size):
            inputs = [v[b] if r is not None else v for v, r in zip(views, split)]
            args, kwargs = tree_unflatten(inputs, spec)
            found = _rerun(
                container,
                layers,
                args,
                kwargs,
                [g[b] for g in outs],
                [g[b] for g in outs_s] if with_sampled else None,
            )
            for name, parts in found.items():
                per_example[name][b].extend(parts)
    used = {x.param for x in layers if any(per_example[x.name])}
    unused = sorted({x.param for x in layers if x.param is not None} - used)
    if calls and unused:
        raise HookComputationError(
            f"the stacked expert weights {unused} of {type(container).__name__} "
            f"({container_name!r}) were not called as F.linear(x, W[e]) (or x @ W[e] for "
            "transposed ones) while the container "
            "ran, so their per-expert inputs cannot be captured. Leave them out of `grad_wrt`, "
            "or use method='trak', whose per-example gradients take any experts forward."
        )
    return {x.name: _padded(per_example[x.name], x, with_sampled, container_name) for x in layers}


def _rerun(
    container: nn.Module,
    layers: Sequence[FactoredLayer],
    args: Any,
    kwargs: Any,
    grads: Sequence[Tensor],
    sampled: Sequence[Tensor] | None,
) -> dict[str, list[tuple[Tensor, Tensor, Tensor | None]]]:
    """The container on one example's rows; each inner layer call's ``(a, g, g_sampled)``."""
    router = OutputRouter()
    seen: dict[str, list[CallRecord]] = {x.name: [] for x in layers}

    def make_hook(name: str) -> Callable[..., Any]:
        def hook(module: nn.Module, a: tuple[Any, ...], out: Any) -> Any:
            call = CallRecord(detach_tree(a), {}, {})
            seen[name].append(call)
            return router.route(out, call, separate=False)

        return hook

    def record(name: str, x: Tensor, out: Tensor) -> Tensor:
        call = CallRecord((x.detach(),), {}, {})
        seen[name].append(call)
        routed: Tensor = router.route(out, call, separate=False)
        return routed

    handles = [x.module.register_forward_hook(make_hook(x.name)) for x in layers if x.param is None]
    experts = _StackedExperts([x for x in layers if x.param is not None], record)
    try:
        with torch.enable_grad():
            with experts:
                out = container(*args, **kwargs)
            floating = [
                t for t in tree_flatten(out)[0] if isinstance(t, Tensor) and t.is_floating_point()
            ]
            calls = [c for name in seen for c in seen[name]]
            if not calls:
                return {}
            backward_to_outputs(contract(floating, grads), calls, retain_graph=sampled is not None)
            if sampled is not None:
                backward_to_outputs(contract(floating, sampled), calls, into="sampled")
    finally:
        for h in handles:
            h.remove()
    release_edges(calls)
    found: dict[str, list[tuple[Tensor, Tensor, Tensor | None]]] = {}
    for x in layers:
        rule = LAYER_FACTORS[type(x.module)] if x.param is None else _stacked_factors
        for call in seen[x.name]:
            # One example's rows of a routed subset: a batch of one with those rows.
            a1 = tuple(t.unsqueeze(0) if isinstance(t, Tensor) else t for t in call.args)

            def one(g: Tensor | None, call: CallRecord = call) -> Tensor:
                return (torch.zeros_like(call.outputs[0]) if g is None else g).unsqueeze(0)

            a3, g3 = rule(x.module, a1, one(call.grads[0]))
            gs3 = rule(x.module, a1, one(call.sampled[0]))[1] if sampled is not None else None
            found.setdefault(x.name, []).append(
                (a3[0].detach(), g3[0].detach(), None if gs3 is None else gs3[0].detach())
            )
    return found


def _stacked_factors(
    module: nn.Module, inputs: tuple[Any, ...], grad_output: Tensor
) -> tuple[Tensor, Tensor]:
    """``a [1, R, d_in]``, ``g [1, R, d_out]`` of one call of an expert ``W[e]``."""
    x = inputs[0]
    return x.reshape(1, -1, x.shape[-1]), grad_output.reshape(1, -1, grad_output.shape[-1])


#: ``x @ W[e]``, however it is spelt.
_MATMULS = frozenset({torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__})


class _StackedExperts(TorchFunctionMode):
    """Hands the calls of the layers' stacked expert weights to ``record``.

    ``record(layer name, x, output)`` returns what the call returns. A call is
    expert ``e``'s when its weight is a view of a stacked ``W`` shaped and
    strided as ``W[e]`` (``e`` from the view's storage offset):
    ``F.linear(x, W[e])`` for ``[E, d_out, d_in]`` weights, ``x @ W[e]`` for
    transposed ``[E, d_in, d_out]`` ones. A bias ``B[e]`` added to the call's
    output (inside ``F.linear`` or after the product) has the same output gradient.
    """

    def __init__(
        self, layers: Sequence[FactoredLayer], record: Callable[[str, Tensor, Tensor], Tensor]
    ) -> None:
        super().__init__()
        self.stacked: dict[int, tuple[Tensor, bool, dict[int, str]]] = {}
        for x in layers:
            assert x.expert is not None
            weight = x.weight()
            self.stacked.setdefault(id(weight), (weight, x.transposed, {}))[2][x.expert] = x.name
        self.record = record

    def _layer(self, weight: Any, transposed: bool) -> str | None:
        base = getattr(weight, "_base", None)
        entry = None if base is None else self.stacked.get(id(base))
        if entry is None or entry[1] != transposed:
            return None
        stacked, _, names = entry
        if weight.shape != stacked.shape[1:] or weight.stride() != stacked.stride()[1:]:
            return None
        expert, rest = divmod(weight.storage_offset() - stacked.storage_offset(), stacked.stride(0))
        return names.get(expert) if rest == 0 else None

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is F.linear:
            x = args[0] if args else kwargs.get("input")
            name = self._layer(args[1] if len(args) > 1 else kwargs.get("weight"), False)
        elif func in _MATMULS and len(args) == 2:
            x = args[0]
            name = self._layer(args[1], True)
        else:
            return out
        if name is None or not isinstance(out, Tensor) or not isinstance(x, Tensor):
            return out
        return self.record(name, x, out)


def _padded(
    rows: Sequence[Sequence[tuple[Tensor, Tensor, Tensor | None]]],
    layer: FactoredLayer,
    with_sampled: bool,
    container: str,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Per-example row lists -> ``[B, R, d]`` tensors, zero rows after each example's own."""
    d_in = layer.d_in - int(layer.bias)
    ref = next((parts[0][0] for parts in rows if parts), None)
    if ref is None:
        logger.debug("influence: layer %r of %r saw no token in this batch", layer.name, container)
        weight = layer.weight()
        empty = weight.new_zeros(len(rows), 0, d_in), weight.new_zeros(len(rows), 0, layer.d_out)
        return empty[0], empty[1], (empty[1] if with_sampled else None)

    def joined(parts: Sequence[tuple[Tensor, Tensor, Tensor | None]], i: int) -> Tensor | None:
        pieces = [p[i] for p in parts]
        if not pieces or any(t is None for t in pieces):
            return None
        return torch.cat([t for t in pieces if t is not None], 0)

    cat = [tuple(joined(parts, i) for i in range(3)) for parts in rows]
    most = max(c[0].shape[0] for c in cat if c[0] is not None)

    def stack(i: int, width: int, like: Tensor) -> Tensor:
        out = like.new_zeros(len(rows), most, width)
        for b, c in enumerate(cat):
            t = c[i]
            if t is not None:
                out[b, : t.shape[0]] = t
        return out

    g_like = next(c[1] for c in cat if c[1] is not None)
    a = stack(0, d_in, ref)
    g = stack(1, layer.d_out, g_like)
    gs = stack(2, layer.d_out, g_like) if with_sampled else None
    return a, g, gs
