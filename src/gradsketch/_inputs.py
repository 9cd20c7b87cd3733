"""A model's input expectations, read from its layers and checked before any forward pass.

A batch of the wrong width, of another dtype than the model's, or with a
label the classifier has no logit for ends in torch's own error deep in the
forward ("mat1 and mat2 shapes cannot be multiplied", "index 10 is out of
bounds"), naming no argument. Where the model shows what it expects, these
checks say it first, with what was given and the fix.

What is read: the first layer a chain of ``nn.Sequential`` containers reaches
(``Linear``, ``Conv1d`` / ``Conv2d`` / ``Conv3d``, ``Embedding``), after the
parameter-free modules before it (``Flatten``, ``Unflatten``, activations),
which are run on a shape-only ``meta`` tensor; and the number of classes, a
Hugging Face config's ``num_labels`` or the output width of a ``Sequential``'s
last ``Linear``. A model whose first or last layer cannot be read that way
(any other ``forward``) is not checked: the checks never refuse a batch the
model could take.

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    >>> check_model_inputs(model, torch.zeros(2, 4), argument="x")  # fits
    >>> check_model_inputs(model, torch.zeros(2, 5), argument="x")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    gradsketch.errors.BatchFormatError: `x` has shape (2, 5): 5 features per example, but ...
    >>> class_count(model)
    3
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from gradsketch.errors import BatchFormatError

__all__ = ["check_labels", "check_model_inputs", "class_count"]

#: Layer types whose input expectation can be read from their settings.
INPUT_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding)


def _owns_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def _chain(model: nn.Module) -> list[nn.Module]:
    """The modules a ``Sequential`` chain applies in order (nested chains flattened)."""
    if type(model) is not nn.Sequential:
        return [model]
    out: list[nn.Module] = []
    for child in model:
        out += _chain(child)
    return out


def _first_layer(model: nn.Module) -> tuple[list[nn.Module], nn.Module] | None:
    """``(parameter-free modules before it, the layer)`` the input reaches first, or None."""
    if type(model) is not nn.Sequential:
        return None
    chain = _chain(model)
    for i, module in enumerate(chain):
        if type(module) in INPUT_LAYERS:
            return chain[:i], module
        if _owns_parameters(module) or any(True for _ in module.parameters()):
            return None
    return None


def _name(model: nn.Module, layer: nn.Module) -> str:
    return next((n for n, m in model.named_modules() if m is layer), "?")


def _layer_text(model: nn.Module, layer: nn.Module) -> str:
    return f"first layer {_name(model, layer)!r} ({layer})"


def check_model_inputs(model: nn.Module, x: Any, *, argument: str) -> None:
    """Raise :class:`BatchFormatError` where ``x`` cannot be the model's input.

    Checks the dtype (indices for an ``Embedding``, the weight's floating dtype
    otherwise), the width (``Linear``'s ``in_features``), the channels and
    dimensions (convolutions) and the index range (``Embedding``'s
    ``num_embeddings``) against the model's first layer (module docstring).

    Args:
        model: the model.
        x: the batch's input (``[B, ...]``), as the model is called on it.
        argument: how to name ``x`` in the message (``"batch[0]"``).
    """
    found = _first_layer(model) if isinstance(x, Tensor) else None
    if found is None:
        return
    before, layer = found
    where = _layer_text(model, layer)
    if isinstance(layer, nn.Embedding):
        _check_indices(x, layer, where, argument)
        return
    weight = layer.weight
    if not (x.is_floating_point() or x.is_complex()):
        raise BatchFormatError(
            f"`{argument}` holds {x.dtype} values, but the model's {where} takes {weight.dtype} "
            f"inputs. Cast them: `{argument}.to({weight.dtype})`."
        )
    if x.dtype != weight.dtype:
        raise BatchFormatError(
            f"`{argument}` is {x.dtype} but the model's parameters are {weight.dtype} (its "
            f"{where}). Cast the inputs with `.to({weight.dtype})`, or the model with "
            f"`model.to({x.dtype})` (and pass its parameters again)."
        )
    shape = torch.empty(x.shape, dtype=x.dtype, device="meta")
    for module in before:
        try:
            shape = module(shape)
        except Exception as exc:
            if type(module) not in (nn.Flatten, nn.Unflatten):
                return  # a module that cannot run on shapes alone: nothing to read
            # A reshape that fails on the shape fails on the data.
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise BatchFormatError(
                f"`{argument}` has shape {tuple(x.shape)}, which the model's module "
                f"{_name(model, module)!r} ({module}) cannot reshape ({reason}); its "
                f"{where} comes next. Pass inputs shaped as the model was built for."
            ) from None
    if not isinstance(shape, Tensor):
        return
    seen = tuple(shape.shape)
    after = f" (after {', '.join(type(m).__name__ for m in before)})" if before else ""
    if isinstance(layer, nn.Linear):
        if seen and seen[-1] == layer.in_features:
            return
        width = seen[-1] if seen else 0
        raise BatchFormatError(
            f"`{argument}` has shape {tuple(x.shape)}: {width} features per example{after}, but "
            f"the model's {where} expects {layer.in_features}. Pass inputs of width "
            f"{layer.in_features} (the features the model was built for), or build its first "
            f"layer for {width}."
        )
    assert isinstance(weight, Tensor)
    spatial = weight.dim() - 2
    channels = int(layer.in_channels)  # type: ignore[arg-type]
    if len(seen) == spatial + 2 and seen[1] == channels:
        return
    raise BatchFormatError(
        f"`{argument}` has shape {tuple(x.shape)}{after}, seen by the model's {where} as "
        f"{seen}; it expects [batch, {channels} channels, {spatial} spatial dims]. Pass "
        f"inputs shaped [batch, {channels}, ...], or build its first layer for {seen[1:2]} "
        "channels."
    )


def _check_indices(x: Tensor, layer: nn.Embedding, where: str, argument: str) -> None:
    if x.is_floating_point() or x.is_complex():
        raise BatchFormatError(
            f"`{argument}` holds {x.dtype} values, but the model's {where} looks up integer "
            f"indices. Pass token ids: `{argument}.long()` if they are whole numbers."
        )
    if x.numel() == 0:
        return
    low, high = int(x.min()), int(x.max())
    if low < 0 or high >= layer.num_embeddings:
        bad = low if low < 0 else high
        raise BatchFormatError(
            f"`{argument}` holds index {bad}, but the model's {where} has "
            f"{layer.num_embeddings} rows (indices 0 to {layer.num_embeddings - 1}). Encode the "
            "inputs with the model's own vocabulary, or grow the embedding."
        )


def class_count(model: nn.Module) -> int | None:
    """The number of classes the model gives logits for, where it can be read (else None).

    A Hugging Face config's ``num_labels``, or the output width of the last
    layer of a ``Sequential`` chain when that layer is a ``Linear``.
    """
    config = getattr(model, "config", None)
    labels = getattr(config, "num_labels", None)
    if isinstance(labels, int) and labels > 0:
        return labels
    if type(model) is not nn.Sequential:
        return None
    owners = [m for m in _chain(model) if any(True for _ in m.parameters())]
    if owners and type(owners[-1]) is nn.Linear:
        return int(owners[-1].out_features)
    return None


def check_labels(labels: Any, classes: int | None, *, argument: str) -> None:
    """Raise :class:`BatchFormatError` for a class label outside ``[0, classes)``.

    Args:
        labels: ``[B]`` integer class labels.
        classes: the number of classes (``None``: unknown, only ``< 0`` is refused).
        argument: how to name ``labels`` in the message.
    """
    if not isinstance(labels, Tensor) or labels.numel() == 0:
        return
    if labels.is_floating_point() or labels.is_complex():
        return  # soft or float labels are the task's business
    low, high = int(labels.min()), int(labels.max())
    if low < 0:
        raise BatchFormatError(
            f"`{argument}` holds label {low}; class labels are 0, 1, ... (one per logit). "
            "Drop or relabel those examples."
        )
    if classes is not None and high >= classes:
        raise BatchFormatError(
            f"`{argument}` holds label {high}, but the model has {classes} classes (labels 0 "
            f"to {classes - 1}). Fix the labels, or give the model a head with {high + 1} "
            "outputs."
        )
