"""The workspace plan of a recording SGMCMC step.

A recording step writes, per parameter group, the ``r`` distinct vectors it
records into the rows of one ``[r, numel]`` block (:func:`workspace`). A
``[6, r]`` coefficient matrix (:func:`coefficients`) turns the rows' Gram
(:func:`gradsketch.sketch.reduce_workspace`) into every norm and inner
product of the six components, and :func:`sketch_components` names each
sketched component as ``a * (b * row)``, which
:func:`gradsketch.sketch.scatter_components_` sketches in one pass over the
rows in devinterp's order of rounding (:func:`reduce_plan`). :class:`GroupPlan`
keeps what a group needs between steps: its place in the sketch's index
space, its folded count-sketch table, the block and its views.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gradsketch.sketch import (
    CountSketch,
    SketchComponent,
    default_backend,
    reduce_workspace,
    scatter_components_,
)

__all__ = [
    "WIDE_TABLE_MAX",
    "GroupPlan",
    "coefficients",
    "direct_grads",
    "folded_table",
    "reduce_plan",
    "row_names",
    "segments",
    "sketch_components",
    "step_scratch",
    "workspace",
]

#: Largest group (coordinates) whose count-sketch table is kept in int64 (128 MB).
WIDE_TABLE_MAX = 1 << 24

#: The recorded components, in the order of the coefficient matrix's rows.
COMPONENTS = ("scaled_grad", "unscaled_grad", "localization", "weight_decay", "noise", "distance")


@dataclass
class GroupPlan:
    """What a parameter group's step needs; fixed at construction or cached between steps."""

    numel: int
    offset: int  # first coordinate of the group in the sketch's index space
    folded: torch.Tensor | None = None  # [numel] int16/32/64 count-sketch table (2k = trash)
    # Workspace [r, numel] and, per parameter, its rows as views shaped like the parameter.
    workspace: torch.Tensor | None = None
    workspace_names: tuple[str, ...] = ()
    views: list[dict[str, torch.Tensor]] | None = None
    # Coefficients C[6, r] turning the workspace rows into the six components,
    # valid while `coef_key` (the hyperparameters) is unchanged.
    coef_key: tuple[Any, ...] | None = None
    coef: torch.Tensor | None = None
    # The sketched components as (component, row, a, b): component = a * (b * row).
    components: list[SketchComponent] | None = None
    # [2, largest numel] noise and (w - c) of the unrecorded step, reused:
    # fresh megabyte temporaries cost page faults in a loop with backward passes.
    step_scratch: torch.Tensor | None = None
    # Zeros standing in for the gradient of a parameter that has none, when the
    # native kernels read gradients in place (see direct_grads).
    zeros: torch.Tensor | None = None


def folded_table(
    sketch: CountSketch, plan: GroupPlan, masks: list[torch.Tensor] | None
) -> torch.Tensor:
    """The group's ``[numel]`` folded table (unselected coordinates go to the trash bucket ``2k``).

    torch's scatter takes int64 indices. Without the native kernels (which
    read any width), up to :data:`WIDE_TABLE_MAX` coordinates the table is
    kept in int64 (8 bytes each). Otherwise the table has the narrowest
    type that holds ``2k + 1`` buckets (2 or 4 bytes each), widened tile by
    tile when torch scatters (see :func:`~gradsketch.sketch.scatter_components_`).

    Example:
        >>> sk = CountSketch.create(4, 2, seed=0)
        >>> table = folded_table(sk, GroupPlan(numel=4, offset=0), [torch.tensor([1, 0, 1, 1]) > 0])
        >>> int(table[1])  # the trash bucket 2k
        4
    """
    device = sketch.device
    trash = 2 * sketch.output_dim
    if plan.numel <= WIDE_TABLE_MAX and default_backend(device, kernel="scatter") != "native":
        narrow = torch.int64
    else:
        narrow = torch.int16 if trash < 2**15 else torch.int32
    if masks is None:
        return sketch.folded_table(plan.offset, plan.numel).to(narrow)
    sel = torch.cat([m.reshape(-1) for m in masks])
    table = torch.full((plan.numel,), trash, dtype=narrow, device=device)
    table[sel] = sketch.folded_table(plan.offset, int(sel.sum())).to(narrow)
    return table


def step_scratch(
    plan: GroupPlan, params: list[torch.Tensor], p: torch.Tensor
) -> torch.Tensor | None:
    """Two reusable ``p``-shaped buffers (noise, w - c); None for a parameter they cannot hold."""
    buf = plan.step_scratch
    if buf is None or buf.dtype != p.dtype or buf.device != p.device:
        largest = max(q.numel() for q in params if q.dtype == p.dtype and q.device == p.device)
        buf = plan.step_scratch = torch.empty(2, largest, dtype=p.dtype, device=p.device)
    if buf.shape[1] < p.numel():
        return None
    return buf[:, : p.numel()].view(2, *p.shape)


def row_names(fast: bool, *, weight_decay: float, localization: float, center: bool) -> list[str]:
    """The workspace rows of a step, in order.

    Identity (``fast``): the distinct raw vectors whose scalar multiples are
    the components (the weights only with weight decay, ``w - c`` only with
    localization about explicit centres ``c``). Otherwise the components
    themselves. ``distance``, which no sketch needs, always comes last, so
    the sketched rows form a prefix.

    Example:
        >>> row_names(True, weight_decay=0.1, localization=0.0, center=False)
        ['grad', 'noise', 'weight', 'distance']
    """
    if not fast:
        return list(COMPONENTS)
    names = ["grad", "noise"]
    if weight_decay:
        names.append("weight")
    if localization and center:
        names.append("center_diff")
    names.append("distance")
    return names


def workspace(
    plan: GroupPlan, names: list[str], params: list[torch.Tensor]
) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    """The group's ``[r, numel]`` rows and per-parameter views, allocated once.

    The update writes every recorded vector straight into its row (no
    block copy afterwards); the views are cached because building ``r``
    views per parameter per step is measurable Python overhead.
    """
    dtype = torch.promote_types(params[0].dtype, torch.float32) if params else torch.float32
    device = params[0].device if params else torch.device("cpu")
    ws = plan.workspace
    if (
        ws is None
        or ws.shape != (len(names), plan.numel)
        or ws.dtype != dtype
        or ws.device != device
        or plan.views is None
        or plan.workspace_names != tuple(names)
    ):
        ws = torch.empty(len(names), plan.numel, dtype=dtype, device=device)
        views: list[dict[str, torch.Tensor]] = []
        offset = 0
        for p in params:
            cols = slice(offset, offset + p.numel())
            views.append({name: ws[i, cols].view(p.shape) for i, name in enumerate(names)})
            offset += p.numel()
        plan.workspace, plan.views, plan.workspace_names = ws, views, tuple(names)
    assert plan.views is not None
    return ws, plan.views


def coefficients(
    plan: GroupPlan,
    names: list[str],
    fast: bool,
    sketch: CountSketch | None,
    *,
    half: float,
    root: float,
    nbeta: float,
    gamma: float,
    lam: float,
) -> torch.Tensor:
    """``C[6, r]`` (float64) with ``components = C @ rows``; cached per hyperparameters.

    Example:
        >>> plan = GroupPlan(numel=3, offset=0)
        >>> names = row_names(True, weight_decay=0.0, localization=1.0, center=False)
        >>> hyper = dict(half=0.05, root=0.3, nbeta=2.0, gamma=1.0, lam=0.0)
        >>> coefficients(plan, names, True, None, **hyper)
        tensor([[0.1000, 0.0000, 0.0000],
                [0.1000, 0.0000, 0.0000],
                [0.0000, 0.0000, 0.0500],
                [0.0000, 0.0000, 0.0000],
                [0.0000, 0.3000, 0.0000],
                [0.0000, 0.0000, 1.0000]], dtype=torch.float64)
    """
    key = (fast, tuple(names), half, root, nbeta, gamma, lam)
    if plan.coef_key == key and plan.coef is not None:
        return plan.coef
    row = {n: i for i, n in enumerate(names)}
    coef = torch.zeros(6, len(names), dtype=torch.float64)
    if fast:
        coef[0, row["grad"]] = coef[1, row["grad"]] = half * nbeta
        coef[2, row.get("center_diff", row["distance"])] = half * gamma
        if lam:
            coef[3, row["weight"]] = half * lam
        coef[4, row["noise"]] = root
        coef[5, row["distance"]] = 1.0
    else:
        coef[:, :] = torch.eye(6, dtype=torch.float64)
    plan.coef_key, plan.coef = key, coef
    if sketch is not None:
        plan.components = sketch_components(
            names, fast, half=half, root=root, nbeta=nbeta, gamma=gamma, lam=lam
        )
    return coef


def sketch_components(
    names: list[str],
    fast: bool,
    *,
    half: float,
    root: float,
    nbeta: float,
    gamma: float,
    lam: float,
) -> list[SketchComponent]:
    """The five sketched components as ``(component, row, a, b)``: ``a * (b * rows[row])``.

    ``a`` and ``b`` are devinterp's two factors in its order (``b`` applied
    first): the identity step's rows are raw, so its scaled gradient is
    ``(eps/2) * (nbeta * grad)``, its localization ``(eps/2) * (gamma * (w - c))``,
    its weight decay ``(eps/2) * (lambda * w)`` and its noise ``sqrt(eps) * xi``;
    every other step writes the components themselves (``a = b = 1``). A
    component that is zero (no localization, no weight decay) is left out:
    adding zeros changes no bucket.

    Example:
        >>> names = row_names(True, weight_decay=0.0, localization=1.0, center=False)
        >>> sketch_components(names, True, half=0.05, root=0.3, nbeta=2.0, gamma=1.0, lam=0.0)
        [(0, 0, 0.05, 2.0), (1, 0, 0.05, 2.0), (2, 2, 0.05, 1.0), (4, 1, 0.3, 1.0)]
    """
    row = {n: i for i, n in enumerate(names)}
    if not fast:
        return [(c, c, 1.0, 1.0) for c in range(5) if (c != 2 or gamma) and (c != 3 or lam)]
    out: list[SketchComponent] = [
        (0, row["grad"], half, nbeta),
        (1, row["grad"], half, nbeta),
    ]
    if gamma:
        out.append((2, row.get("center_diff", row["distance"]), half, gamma))
    if lam:
        out.append((3, row["weight"], half, lam))
    out.append((4, row["noise"], root, 1.0))
    return out


def direct_grads(params: list[torch.Tensor]) -> bool:
    """Whether the reduction can read every gradient in place (native kernels, CPU).

    It then needs no copy of the gradient into the workspace: each
    parameter's gradient is a row of its segment
    (:func:`gradsketch.sketch._backend.reduce_rows_`).
    """
    if not params or default_backend(params[0].device, kernel="scatter") != "native":
        return False
    dtype = torch.promote_types(params[0].dtype, torch.float32)
    for p in params:
        g = p.grad
        if g is not None and (g.dtype != dtype or g.device != p.device or not g.is_contiguous()):
            return False
    return True


def segments(
    plan: GroupPlan, params: list[torch.Tensor], views: list[dict[str, torch.Tensor]] | None
) -> list[list[torch.Tensor]]:
    """Per parameter, its rows for the reduction: the gradient, then its workspace rows."""
    assert views is not None
    out = []
    for p, rows in zip(params, views):
        grad = p.grad
        if grad is None:
            if plan.zeros is None or plan.zeros.numel() < p.numel():
                plan.zeros = torch.zeros(
                    plan.numel, dtype=torch.promote_types(p.dtype, torch.float32)
                )
            grad = plan.zeros[: p.numel()]
        out.append([grad.reshape(-1), *(v.reshape(-1) for v in rows.values())])
    return out


def reduce_plan(
    plan: GroupPlan,
    block: torch.Tensor,
    *,
    sketch: CountSketch | None,
    sketches: torch.Tensor | None,
    gram: bool,
    segments: list[list[torch.Tensor]] | None = None,
) -> torch.Tensor | None:
    """Gram matrix of the workspace rows (returned, on CPU); the sketches added to ``sketches``.

    :func:`~gradsketch.sketch.reduce_workspace` (of ``segments`` when
    given: the gradients are read in place) gives the Gram (every norm and
    inner product, float64 across tiles).
    :func:`~gradsketch.sketch.scatter_components_` adds each sketched
    component (:attr:`GroupPlan.components`) into its row of ``sketches``
    (``[5, k]`` float32, the running sketches of the step): every element
    scaled as devinterp scales it and added into its bucket in parameter
    order, so the sketches are bit-equal to devinterp's ``scatter_add_`` of
    each parameter's float32 component on the CPU.
    """
    rows = block if segments is None else segments
    result = None
    if gram:
        result = reduce_workspace(rows, gram=True, scratch=None, folded=None, rows=0)
    if sketch is not None and plan.components:
        assert sketches is not None and plan.folded is not None
        scatter_components_(sketches, plan.folded, rows, plan.components)
    return None if result is None else result.cpu()
