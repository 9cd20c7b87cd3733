"""The factored layers of a model, and one hooked pass capturing their inputs and output grads.

For every module with a layer-factor rule (:func:`register_layer_factors`:
Linear, Conv2d, Hugging Face ``Conv1D``) :func:`capture_layers` runs one
hooked forward and one backward of the task's summed output and returns,
per layer, the inputs ``a [B, T, d_in]`` and output gradients
``g [B, T, d_out]`` whose products ``sum_t g_t a_tᵀ`` are the per-example
weight gradients. K-FAC / EK-FAC fit their factors from them and the
Kronecker featurizer stores ``vec(sum_t g_t a_tᵀ)``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge

from gradsketch.attribution._layers import LAYER_FACTORS, register_optional_rules

__all__ = ["FactoredLayer", "capture_layers", "find_layers"]

logger = logging.getLogger(__name__)


@dataclass
class FactoredLayer:
    """A factored layer: its module, parameters and (projected) gradient shape."""

    name: str
    module: nn.Module
    bias: bool
    d_in: int  # inputs per position, with the bias column
    d_out: int
    k_in: int  # stored input side (d_in without projection)
    k_out: int
    offset: int = 0

    @property
    def width(self) -> int:
        return self.k_out * self.k_in


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


def find_layers(
    model: nn.Module,
    grad_wrt: Sequence[str] | None,
    projection: tuple[int, int] | None,
) -> list[FactoredLayer]:
    """The modules with a layer-factor rule whose weight is differentiated, in model order."""
    register_optional_rules(model)  # Hugging Face's Conv1D, once transformers is loaded
    wanted = None if grad_wrt is None else set(grad_wrt)
    layers: list[FactoredLayer] = []
    offset = 0
    for name, module in model.named_modules():
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
        d_in += int(bias)
        k_in, k_out = (d_in, d_out) if projection is None else projection
        layer = FactoredLayer(name, module, bias, d_in, d_out, min(k_in, d_in), min(k_out, d_out))
        layer.offset = offset
        offset += layer.width
        layers.append(layer)
    if not layers:
        allowed = ", ".join(sorted(t.__name__ for t in LAYER_FACTORS))
        raise ValueError(
            f"the model has no differentiated layer of a factored type ({allowed}); K-FAC "
            "influence needs at least one. Check `grad_wrt`, register your layer type with "
            "@register_layer_factors, or use bayesian_influence."
        )
    return layers


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
    """
    calls: dict[str, list[tuple[tuple[Any, ...], Any, Tensor]]] = {x.name: [] for x in layers}
    root: list[Any] = []
    dummy: dict[tuple[torch.dtype, torch.device], Tensor] = {}

    def make_hook(layer: FactoredLayer) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            if not isinstance(output, Tensor):
                raise TypeError(
                    f"layer {layer.name!r} ({type(module).__name__}) returned "
                    f"{type(output).__name__}; factored layers must return one tensor."
                )
            routed = output
            if not output.requires_grad:
                # Frozen weights and inputs so far: a zero that requires grad
                # gives the output a gradient edge.
                key = (output.dtype, output.device)
                if key not in dummy:
                    dummy[key] = torch.zeros(
                        (), dtype=output.dtype, device=output.device, requires_grad=True
                    )
                routed = output + dummy[key]
            args_d = tuple(t.detach() if isinstance(t, Tensor) else t for t in args)
            # The edge is taken now, before a caller's in-place op changes the value.
            calls[layer.name].append((args_d, get_gradient_edge(routed), output.detach()))
            return routed if routed is not output else None

        return hook

    handles = [x.module.register_forward_hook(make_hook(x)) for x in layers]
    handles.append(
        model.register_forward_hook(
            lambda m, args, out: root.append(
                out if isinstance(out, Tensor) else getattr(out, "logits", out)
            )
        )
    )
    try:
        with torch.enable_grad():
            outputs = batch_output(model, *batch)
            flat = [(x.name, i) for x in layers for i in range(len(calls[x.name]))]
            edges = [calls[n][i][1] for n, i in flat]
            grads = torch.autograd.grad(
                outputs.sum(), edges, allow_unused=True, retain_graph=sampled_loss is not None
            )
            sampled: Sequence[Tensor | None] = [None] * len(flat)
            if sampled_loss is not None:
                if len(root) != 1:
                    raise RuntimeError(
                        "curvature='sampled' needs the model's output from one forward call; "
                        f"the model was called {len(root)} times for one batch."
                    )
                sampled = torch.autograd.grad(sampled_loss(root[0]).sum(), edges, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    by_call = dict(zip(flat, grads))
    by_call_sampled = dict(zip(flat, sampled))
    result: dict[str, tuple[Tensor, Tensor, Tensor | None]] = {}
    for layer in layers:
        rule = LAYER_FACTORS[type(layer.module)]
        parts_a, parts_g, parts_s = [], [], []
        for i, (args, _, out) in enumerate(calls[layer.name]):
            g = by_call[(layer.name, i)]
            a3, g3 = rule(layer.module, args, torch.zeros_like(out) if g is None else g)
            parts_a.append(a3.detach())
            parts_g.append(g3.detach())
            if sampled_loss is not None:
                gs = by_call_sampled[(layer.name, i)]
                _, gs3 = rule(layer.module, args, torch.zeros_like(out) if gs is None else gs)
                parts_s.append(gs3.detach())
        if not parts_a:
            raise RuntimeError(
                f"layer {layer.name!r} was not called in the forward; influence needs every "
                "factored layer to run. Pass grad_wrt without its parameters."
            )
        result[layer.name] = (
            torch.cat(parts_a, 1),
            torch.cat(parts_g, 1),
            torch.cat(parts_s, 1) if parts_s else None,
        )
    if len(root) != 1:
        return result, None
    return result, (root[0].detach() if isinstance(root[0], Tensor) else root[0])
