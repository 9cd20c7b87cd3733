"""Which TRAKer arguments each method cannot use: one table, one refusal.

A method that cannot use an argument refuses every value of it but its
default (and the values a row lists as harmless). The table is keyed by
``(method, argument)``; a method is looked up by its name, then by its
kind (``"projected"`` features, ``"per-layer"`` features), then as ``"*"``
(every method). A row ``None`` says that a method does use the argument
that its kind or ``"*"`` refuses.

Example:
    >>> refuse_unused("replay", "replay", {"proj_dim": 2048}, {"proj_dim": 2048})
    >>> refuse_unused("replay", "replay", {"proj_dim": 64}, {"proj_dim": 2048})
    Traceback (most recent call last):
    ValueError: `proj_dim`=64 does not apply to method='replay' (...); leave it at its default ...
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gradsketch.attribution._kfac import LAYER_AUTO_DAMPING_FRACTION, check_damping_fraction
from gradsketch.attribution._scores import check_lambda


@dataclass(frozen=True)
class Refusal:
    """Why a method refuses an argument, and the fix.

    Attributes:
        says: what follows ```arg`=value`` in the message (``{method}`` and
            ``{default}`` are filled in).
        fix: how to call instead (same fields).
        harmless: values refused neither (besides the argument's default).
        show_value: show the value given (off where its repr is long).
    """

    says: str
    fix: str
    harmless: tuple[Any, ...] = ()
    show_value: bool = True


#: TRAKer arguments that method="replay" cannot use, and why (the command line's reasons too).
REPLAY_UNUSED_ARGUMENTS: dict[str, str] = {
    "proj_dim": "the metagradient is exact, nothing is projected",
    "projector": "the metagradient is exact, nothing is projected",
    "projector_seed": "the metagradient is exact, nothing is projected",
    "proj_max_batch_size": "the metagradient is exact, nothing is projected",
    "lambda_reg": "the metagradient inverts no curvature, so there is nothing to damp",
    "score_computer": "scores come from the reverse pass through training, not a kernel",
    "gradient_computer": "the replay differentiates the whole training run itself",
    "grad_wrt": "the replay trains, and so differentiates, every parameter",
    "mask": "the replay trains, and so differentiates, every parameter",
    "curvature": "no curvature is fitted",
    "projection": "nothing is projected",
    "sample_seed": "no labels are sampled",
    "use_half_precision": "the replay runs in the model's own dtype",
    "dtype": "the replay runs in the model's own dtype (scores are stored in float64)",
    "chunk_rows": "scores are stored one query per row",
    "precision": "scores come from the reverse pass, not a GEMM",
    "saver": "scores are stored in the TRAKer's store under `save_dir`",
    "del_grads": "no training features are stored",
    "rows": "the replay keeps the rows it trains on; it has no gradients to recompute",
}

_DEFAULT_FIX = "leave it at its default ({default!r})"

#: ``(method or kind or "*", argument) -> Refusal`` (``None``: the method uses it).
ARGUMENT_REFUSALS: dict[tuple[str, str], Refusal | None] = {
    **{
        ("replay", name): Refusal(f"does not apply to method='replay' ({why})", _DEFAULT_FIX)
        for name, why in REPLAY_UNUSED_ARGUMENTS.items()
    },
    ("*", "saver"): Refusal(
        "does not apply to method={method!r} (gradsketch stores features in a resumable zarr "
        "store under `save_dir`; a custom saver is not supported)",
        "pass saver=None",
    ),
    ("*", "replay"): Refusal(
        "is the replayable run of method='replay', but method={method!r}",
        "pass method='replay', or drop `replay`",
        show_value=False,
    ),
    ("replay", "replay"): None,
    ("replay", "projection"): Refusal(
        f"does not apply to method='replay' ({REPLAY_UNUSED_ARGUMENTS['projection']})",
        _DEFAULT_FIX,
        harmless=(None,),
    ),
    ("replay", "rows"): Refusal(
        "does not apply to method='replay' (the replay keeps the rows it trains on; it has "
        "no gradients to recompute)",
        _DEFAULT_FIX,
        harmless=("stored",),
    ),
    ("*", "score_computer"): Refusal(
        "is TRAK's own kernel; method={method!r} scores with its preconditioner",
        "pass score_computer=None",
    ),
    ("trak", "score_computer"): None,
    ("*", "del_grads"): Refusal(
        "is not supported by method={method!r}: the stored training gradients are what "
        "queries are scored against",
        "pass del_grads=False",
    ),
    ("trak", "del_grads"): None,
    ("projected", "curvature"): Refusal(
        "needs a per-layer method ('identity', 'kfac', 'ekfac'); method={method!r} "
        "preconditions with its own matrix of the projected features",
        "pass method='ekfac' (or another per-layer method), or leave curvature='loss'",
    ),
    ("projected", "projection"): Refusal(
        "projects each layer's inputs and output gradients for the per-layer methods; "
        "method={method!r} takes `projector` or `proj_dim`",
        "pass projection=None",
        harmless=(None,),
    ),
    ("*", "damping_fraction"): Refusal(
        "sets the per-layer methods' lambda_reg='auto' damping (a fraction of each layer's "
        "mean eigenvalue); method={method!r} has no per-layer curvature",
        "pass method='kfac' or 'ekfac', or drop `damping_fraction`",
    ),
    ("per-layer", "damping_fraction"): None,
    ("identity", "damping_fraction"): Refusal(
        "sets the damping of a curvature, and method='identity' has none",
        "drop `damping_fraction`",
    ),
    ("per-layer", "use_half_precision"): Refusal(
        "is not supported by method={method!r}: its features' squares feed the curvature",
        "pass use_half_precision=False",
        harmless=(False,),
    ),
}


def refusal(method: str, kind: str, argument: str) -> Refusal | None:
    """The row of :data:`ARGUMENT_REFUSALS` for ``argument`` under ``method`` (of ``kind``)."""
    for key in (method, kind, "*"):
        if (key, argument) in ARGUMENT_REFUSALS:
            return ARGUMENT_REFUSALS[(key, argument)]
    return None


def _same(value: Any, other: Any) -> bool:
    if value is other:
        return True
    try:
        return bool(value == other)
    except (TypeError, ValueError, RuntimeError):  # tensors, masks: not comparable
        return False


def refuse_unused(
    method: str, kind: str, given: Mapping[str, Any], defaults: Mapping[str, Any]
) -> None:
    """Refuse the first argument of ``given`` that ``method`` cannot use.

    Args:
        method: the method's name.
        kind: its kind: ``"projected"``, ``"per-layer"`` or ``"replay"``.
        given: argument name -> value passed.
        defaults: argument name -> default (a value equal to it is never refused).

    Raises:
        ValueError: naming the argument, its value, the method, why and the fix.
    """
    for name, value in given.items():
        row = refusal(method, kind, name)
        default = defaults.get(name)
        if row is None or _same(value, default) or any(_same(value, h) for h in row.harmless):
            continue
        fields = {"method": method, "default": default}
        shown = f"={value!r}" if row.show_value else ""
        raise ValueError(
            f"`{name}`{shown} {row.says.format(**fields)}; {row.fix.format(**fields)}."
        )


def checked_damping(
    lambda_reg: float | str | None,
    damping_fraction: float,
    method: str,
    layered: bool,
    logger: logging.Logger,
) -> tuple[float | str, float]:
    """``TRAKer``'s ``lambda_reg`` (``None``: the method's default) and ``damping_fraction``.

    ``None`` is TRAK's 0 and the per-layer curvature methods' ``"auto"``
    (chosen on the protocol suite's first half). A ``damping_fraction`` other
    than its default needs ``lambda_reg="auto"``, whose damping it sets;
    an undamped per-layer curvature method is warned about.

    Raises:
        ValueError: a bad value, or a ``damping_fraction`` without ``"auto"``.
    """
    if lambda_reg is None:
        lambda_reg = "auto" if layered and method != "identity" else 0.0
    lam = check_lambda(lambda_reg)
    fraction = check_damping_fraction(damping_fraction)
    if fraction != LAYER_AUTO_DAMPING_FRACTION and lam != "auto":
        raise ValueError(
            f"`damping_fraction`={fraction} sets the damping of lambda_reg='auto', but "
            f"lambda_reg={lam!r}; pass lambda_reg='auto', or drop `damping_fraction`."
        )
    if layered and method != "identity" and lam == 0:
        logger.warning(
            "TRAKer(method=%r, lambda_reg=0): no damping, so directions of near-zero "
            "curvature dominate the scores; pass lambda_reg='auto' (0.3 of each layer's "
            "mean eigenvalue) or a positive number.",
            method,
        )
    return lam, fraction
