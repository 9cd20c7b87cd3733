"""Inputs and outputs a hooked module shares across the batch, expanded to it.

A module called once for the whole batch may return values that broadcast
over it (learned position embeddings of ``position_ids [1, T]``); the hook
engine (:mod:`~gradsketch.attribution._hook_computer`) expands those to one
row per example (views, no copies) so that each example's gradient is its own.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["broadcasts_over_batch", "expand_shared", "expand_to_batch"]


def broadcasts_over_batch(args: Any, kwargs: Any, output: Any) -> bool:
    """Whether a call saw no batch and returned values meant to broadcast over it.

    True when no input is floating point (indices such as ``position_ids
    [1, T]``, or nothing) and every floating output has a leading dim of 1:
    the same values for every example, as learned position embeddings give.
    A floating input would carry the batch itself (or be sequence-first).
    """
    inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
    if any(t.is_floating_point() or t.is_complex() for t in inputs):
        return False
    outs = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.is_floating_point()]
    return bool(outs) and all(t.dim() > 0 and t.shape[0] == 1 for t in outs)


def expand_shared(args: Any, kwargs: Any, output: Any, batch_size: int) -> Any:
    """``output`` with its shared ``[1, ...]`` floating tensors expanded (views) to the batch.

    Shared: computed without any floating input of the call (found by
    walking the output's autograd graph, which must not reach an input's).
    Returns ``output`` itself when nothing is shared or it cannot be told
    (no input requires grad, or the graph is too large to walk).
    """
    sources = [
        t
        for t in tree_flatten((args, kwargs))[0]
        if isinstance(t, Tensor) and t.is_floating_point() and t.requires_grad
    ]
    leading_one = [
        t
        for t in tree_flatten(output)[0]
        if isinstance(t, Tensor) and t.is_floating_point() and t.dim() and t.shape[0] == 1
    ]
    if not sources or not leading_one:
        return output
    inputs = {get_gradient_edge(t).node for t in sources}
    shared = {id(t) for t in leading_one if not _reaches(t, inputs)}
    if not shared:
        return output

    def expand(t: Any) -> Any:
        if isinstance(t, Tensor) and id(t) in shared:
            return t.expand(batch_size, *t.shape[1:])
        return t

    return tree_map(expand, output)


def _reaches(t: Tensor, nodes: set[Any], limit: int = 10_000) -> bool:
    """Whether ``t``'s autograd graph reaches one of ``nodes`` (True past ``limit`` nodes)."""
    if t.grad_fn is None:
        return False
    stack, visited = [t.grad_fn], set()
    while stack:
        node = stack.pop()
        if node in nodes:
            return True
        if node in visited:
            continue
        visited.add(node)
        if len(visited) > limit:
            return True
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return False


def expand_to_batch(tree: Any, batch_size: int) -> Any:
    """Every tensor with a leading dim of 1 expanded (a view) to ``batch_size``."""

    def expand(t: Any) -> Any:
        if isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == 1:
            return t.expand(batch_size, *t.shape[1:])
        return t

    return tree_map(expand, tree)
