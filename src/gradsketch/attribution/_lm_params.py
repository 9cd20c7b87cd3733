"""Which weights attribution differentiates: names, patterns, a ParamMask, or the trainable ones.

Language-model attribution is commonly restricted to some weights (the
attention and MLP projections, or a LoRA adapter's). :func:`select_parameters`
turns the ways a user says so into parameter names in model order, which
:class:`TRAKer` records in its settings (so a store featurized with one
restriction refuses to resume with another).
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Iterable
from typing import Any

from torch import nn

from gradsketch.masked import ParamMask

logger = logging.getLogger(__name__)

_WILDCARDS = frozenset("*?[")


def _patterns(grad_wrt: str | Iterable[str]) -> list[str]:
    if isinstance(grad_wrt, str):
        return [p.strip() for p in grad_wrt.split("|") if p.strip()]
    items = list(grad_wrt)
    bad = [p for p in items if not isinstance(p, str)]
    if bad:
        raise TypeError(f"`grad_wrt` must hold parameter names or patterns (str); got {bad[:3]!r}.")
    return items


def _from_mask(model: nn.Module, mask: ParamMask, *, whole: bool) -> list[str]:
    names = [n for n, _ in model.named_parameters()]
    unknown = [n for n in mask.names if n not in set(names)]
    if unknown:
        raise ValueError(
            f"`grad_wrt` is a ParamMask naming {unknown[:5]}, which are not parameters of the "
            f"model (it has {names[:5]}...). Build it from this model, e.g. "
            "ParamMask.from_patterns(model, include=[...])."
        )
    counts = mask.counts()
    chosen = [n for n in names if counts.get(n, 0) > 0]
    if whole:
        partial = [n for n in chosen if counts[n] != mask[n].numel()]
        if partial:
            raise ValueError(
                f"`grad_wrt` is a ParamMask selecting only some entries of {partial[:5]}; "
                "grad_wrt takes whole parameters. Pass it as `mask=` instead (the projector "
                "then sees the selected entries only)."
            )
    return chosen


def select_parameters(
    model: nn.Module, grad_wrt: str | Iterable[str] | ParamMask | None, mask: Any = None
) -> list[str] | None:
    """Names of the parameters to differentiate, in model order (``None``: all of them).

    Args:
        model: the model.
        grad_wrt: ``None``; parameter names or fnmatch patterns (``*`` also
            matches dots), as a list or one string with patterns separated
            by ``|``; or a :class:`~gradsketch.masked.ParamMask` selecting
            whole parameters.
        mask: the projector's entry-level ParamMask, if any: without
            ``grad_wrt``, only parameters it selects entries of are
            differentiated.

    With ``grad_wrt=None`` and no mask, a model whose parameters are partly
    frozen (``requires_grad=False``, as a ``peft`` LoRA model's base weights)
    is differentiated with respect to its trainable parameters only.

    Raises:
        ValueError: a pattern or name matches no parameter (some names are
            listed), an empty selection, or a ParamMask that selects part of
            a parameter.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> select_parameters(model, "*.weight|1.bias")
        ['0.weight', '1.weight', '1.bias']
        >>> _ = model[0].requires_grad_(False)
        >>> select_parameters(model, None)
        ['1.weight', '1.bias']
    """
    params = dict(model.named_parameters())
    names = list(params)
    if grad_wrt is None:
        if mask is not None:
            return _from_mask(model, mask, whole=False)
        trainable = [n for n, p in params.items() if p.requires_grad]
        if 0 < len(trainable) < len(names):
            logger.info(
                "differentiating the %d trainable parameters only (%d frozen); pass grad_wrt to "
                "choose others",
                len(trainable),
                len(names) - len(trainable),
            )
            return trainable
        return None
    if isinstance(grad_wrt, ParamMask):
        chosen = _from_mask(model, grad_wrt, whole=True)
    else:
        hits: set[str] = set()
        unmatched = []
        for pattern in _patterns(grad_wrt):
            if _WILDCARDS & set(pattern):
                matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
            else:
                matched = [pattern] if pattern in params else []
            if not matched:
                unmatched.append(pattern)
            hits.update(matched)
        if unmatched:
            raise ValueError(
                f"`grad_wrt` names {unmatched} match no parameter of the model; it has "
                f"{len(names)} parameters, e.g. {names[:6]}. Use names from "
                "model.named_parameters() or fnmatch patterns such as '*.q_proj.weight'."
            )
        chosen = [n for n in names if n in hits]
    if not chosen:
        raise ValueError(
            f"`grad_wrt`={grad_wrt!r} selects no parameter; select at least one of {names[:6]}..."
        )
    return chosen
