"""The per-layer methods' default for vocabulary-sized layers: left out of the curvature.

A language model's LM head (tied to the token embedding or not) is a layer
with ``d_out`` = the vocabulary. Its K-FAC output-side factor is
``d_out² `` float64 numbers, and so is its eigenbasis: 20 GB each at GPT-2's
50,257 tokens, before a single document. Kronfluence tracks the blocks'
attention and MLP weights only; so do the per-layer methods by default:
where ``grad_wrt`` is not given, a factored layer with a side equal to an
``nn.Embedding``'s vocabulary of more than :data:`VOCABULARY_FACTOR_LIMIT`
rows is left out, with a logged line. ``grad_wrt`` naming the head (e.g.
``"lm_head.weight|transformer.h.*"``) keeps it, and ``projection=(k_in,
k_out)`` makes its factors small, so the default then does not apply.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from torch import nn

from gradsketch.attribution._layer_capture import FactoredLayer, find_layers

__all__ = ["VOCABULARY_FACTOR_LIMIT", "default_layer_parameters"]

#: A vocabulary side above this many rows is left out of the per-layer
#: curvature by default (8,192² float64 = 512 MiB per factor, and as much
#: again for its eigenbasis).
VOCABULARY_FACTOR_LIMIT = 8192


def vocabulary_sizes(model: nn.Module) -> set[int]:
    """The row counts of the model's ``nn.Embedding`` layers above the limit."""
    return {
        int(m.num_embeddings)
        for m in model.modules()
        if isinstance(m, nn.Embedding) and m.num_embeddings > VOCABULARY_FACTOR_LIMIT
    }


def vocabulary_layers(model: nn.Module, layers: Sequence[FactoredLayer]) -> list[FactoredLayer]:
    """The layers of ``layers`` with a vocabulary-sized side (LM heads, tied or not)."""
    sizes = vocabulary_sizes(model)
    return [x for x in layers if x.k_out in sizes or x.k_in in sizes]


def default_layer_parameters(
    model: nn.Module, grad_wrt: list[str] | None, logger: logging.Logger
) -> list[str] | None:
    """``grad_wrt`` for a per-layer method the user gave no ``grad_wrt`` (or mask) to.

    Args:
        model: the model.
        grad_wrt: :func:`select_parameters`' choice (``None``: every parameter).
        logger: where the layers left out are reported.

    Returns:
        ``grad_wrt`` unchanged when no factored layer is vocabulary-sized; else
        the same parameters without those layers' weight and bias (listed by name).
    """
    try:
        layers = find_layers(model, grad_wrt, None)
    except ValueError:  # no factored layer: the featurizer reports it
        return grad_wrt
    big = vocabulary_layers(model, layers)
    if not big:
        return grad_wrt
    names = grad_wrt if grad_wrt is not None else [n for n, _ in model.named_parameters()]
    dropped = {p for x in big for p in x.param_names}
    kept = [n for n in names if n not in dropped]
    # A tied head's weight is named for the embedding in named_parameters(); the layer
    # is matched by its own name, so listing the other names leaves it out either way.
    own = {id(p) for p in model.parameters()}
    named = {n for n, _ in model.named_parameters()}
    for x in big:
        tied = x.param_names[0] not in named and id(x.weight()) in own
        how = (
            "it shares the embedding's weight; pass projection=(k_in, k_out) to project it"
            if tied
            else f"pass grad_wrt naming {x.param_names[0]!r} to include it, or "
            "projection=(k_in, k_out) to project it"
        )
        logger.info(
            "per-layer curvature: layer %r (%d x %d, a vocabulary side) is left out by default: "
            "its factors would take %.1f GB in float64; %s.",
            x.name,
            x.d_out,
            x.d_in,
            8 * 2 * (x.k_in**2 + x.k_out**2) / 1e9,
            how,
        )
    return kept
