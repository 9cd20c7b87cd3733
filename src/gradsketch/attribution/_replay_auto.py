"""``linearize_at="auto"``: the replay's linearization chosen from validation retrains.

Which linearization predicts a run's retrains best depends on the run: on the
protocol suite's first half ``full_batch`` at 0.5 beat ``kept_mean`` at 1 by
+0.13 [0.03, 0.23] same-initialization LDS on a long momentum-SGD CNN run, and
lost by 0.08 [0.06, 0.11] on a minibatch-SGD MLP run
(:mod:`gradsketch.demos.protocols.suite`). So the choice is measured per run:

1. draw ``R`` random halves of the training rows (``seed``);
2. retrain the run on each, from its own initialization and batch order
   (:meth:`ReplayRun.retrain_many`, ``side_by_side`` runs per ``vmap``), with
   the run's ``subset_loss``: the same-initialization truth;
3. train and reverse the run at each candidate ``(linearize_at, subset_loss)``
   for the validation queries, and score its metagradients by LDS against
   those retrains;
4. keep the candidate with the highest LDS (the first listed on a tie).

Cost: ``R`` retrains plus, per candidate, one training run and one reverse
pass over the validation queries; both are logged in CPU seconds
(``time.process_time``, this process) with the choice.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from gradsketch._checks import check_int, check_number, positive_int
from gradsketch._device import to_device
from gradsketch.attribution._lds import linear_datamodeling_score
from gradsketch.attribution._replay_reverse import ReversePass
from gradsketch.attribution._replay_run import (
    SUBSET_LOSSES,
    ReplayRun,
    fingerprint,
    materialize,
)

logger = logging.getLogger(__name__)

#: Candidates of ``linearize_at="auto"``: ``(linearize_at, subset_loss)``. ``kept_mean``
#: at any number is the ordinary run (its metagradients only scale), so it enters once;
#: ``full_batch`` at ``a`` scales the loss by ``a`` (the suite's best on a long SGD run).
AUTO_CANDIDATES: tuple[tuple[float, str], ...] = (
    (1.0, "kept_mean"),
    (1.0, "full_batch"),
    (0.5, "full_batch"),
    (0.25, "full_batch"),
)
#: Validation retrains drawn by default: enough for a rank correlation per query
#: (LDS needs 3 at least), few against the hundreds a datamodel needs.
AUTO_RETRAINS = 16


def label_of(linearize_at: float, subset_loss: str) -> str:
    """``"subset_loss@linearize_at"``, e.g. ``"full_batch@0.5"``."""
    return f"{subset_loss}@{linearize_at:g}"


@dataclass
class AutoLinearization:
    """How ``linearize_at="auto"`` chooses (its record is saved beside stored scores).

    Attributes:
        queries: validation queries, in any form ``train_data`` takes. Use
            held-out examples, not those you will score: the choice is then
            made on data it is not reported on.
        retrains: ``R`` random halves retrained for the truth (at least 3).
        candidates: ``(linearize_at, subset_loss)`` pairs, each number in
            (0, 1] and each loss one of :data:`SUBSET_LOSSES`.
        seed: seed of the halves (the choice is reproducible for a seed).
        side_by_side: retrains trained at once (one ``vmap`` per step).

    Example:
        >>> from gradsketch.attribution import ReplayAttributor
        >>> gen = torch.Generator().manual_seed(0)
        >>> x = torch.randn(20, 4, generator=gen, dtype=torch.float64)
        >>> y = torch.arange(20) % 3
        >>> auto = AutoLinearization(queries=(x[16:], y[16:]), retrains=8)
        >>> replay = ReplayAttributor(
        ...     torch.nn.Linear(4, 3).double(), "image_classification", (x[:16], y[:16]),
        ...     num_steps=6, batch_size=4, lr=0.5, linearize_at="auto",
        ...     auto_linearize=auto, progress=False)
        >>> replay.train()
        >>> replay.linearization.label in replay.linearization.lds
        True
    """

    queries: Any = None
    retrains: int = AUTO_RETRAINS
    candidates: Sequence[tuple[float, str]] = AUTO_CANDIDATES
    seed: int = 0
    side_by_side: int = 16

    def __post_init__(self) -> None:
        if self.queries is None:
            raise ValueError(
                "`queries` of AutoLinearization is None: 'auto' scores each candidate on "
                "validation queries; pass held-out examples, e.g. "
                "AutoLinearization(queries=(x_val, y_val))."
            )
        check_int("retrains", self.retrains, low=3, fix="pass e.g. retrains=16")
        check_int("seed", self.seed)
        positive_int("side_by_side", self.side_by_side)
        self.candidates = checked_candidates(self.candidates)


def checked_candidates(candidates: Any) -> tuple[tuple[float, str], ...]:
    """``candidates`` as distinct ``(number in (0, 1], subset_loss)`` pairs, refused otherwise."""
    fix = f"give (linearize_at, subset_loss) pairs such as {list(AUTO_CANDIDATES[:2])}"
    if isinstance(candidates, (str, bytes)) or not isinstance(candidates, Sequence):
        raise TypeError(f"`candidates`={candidates!r} is not a sequence of pairs; {fix}.")
    out: list[tuple[float, str]] = []
    for pair in candidates:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"`candidates` holds {pair!r}, not a pair; {fix}.")
        at, loss = pair
        at = check_number("linearize_at", at, low=0.0, strict=True, fix=fix)
        if at > 1.0:
            raise ValueError(f"`candidates` holds linearize_at={at!r}, above 1; {fix}.")
        if loss not in SUBSET_LOSSES:
            raise ValueError(
                f"`candidates` holds subset_loss={loss!r}; choose one of {sorted(SUBSET_LOSSES)}."
            )
        if (float(at), loss) not in out:
            out.append((float(at), loss))
    if not out:
        raise ValueError(f"`candidates` is empty; {fix}.")
    return tuple(out)


@dataclass
class LinearizationChoice:
    """What ``linearize_at="auto"`` chose, from what, and at what cost.

    Attributes:
        linearize_at: the chosen number.
        subset_loss: the chosen loss normalization.
        lds: ``label -> LDS`` of every candidate scored (validation queries
            against the ``retrains`` same-initialization retrains).
        skipped: ``label -> reason`` for candidates left out for this run.
        retrains: how many halves were retrained.
        seed: the halves' seed.
        truth_loss: the ``subset_loss`` of the retrains (what is predicted).
        queries: fingerprint of the validation queries.
        retrain_cpu_s: CPU seconds of the retrains.
        candidate_cpu_s: ``label -> CPU seconds`` of each candidate's
            training and reverse pass.
    """

    linearize_at: float
    subset_loss: str
    lds: dict[str, float]
    skipped: dict[str, str]
    retrains: int
    seed: int
    truth_loss: str
    queries: str
    retrain_cpu_s: float
    candidate_cpu_s: dict[str, float] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """The chosen candidate's label, e.g. ``"full_batch@0.5"``."""
        return label_of(self.linearize_at, self.subset_loss)

    @property
    def cpu_s(self) -> float:
        """CPU seconds of the whole choice: retrains plus every candidate."""
        return self.retrain_cpu_s + sum(self.candidate_cpu_s.values())

    def record(self) -> dict[str, Any]:
        """What fixes the choice (stored with the scores): no timings, no LDS figures."""
        return {
            "chosen": self.label,
            "candidates": sorted([*self.lds, *self.skipped]),
            "retrains": self.retrains,
            "seed": self.seed,
            "truth_loss": self.truth_loss,
            "queries": self.queries,
        }


def skip_reason(run: ReplayRun, linearize_at: float, subset_loss: str) -> str | None:
    """Why a candidate is left out for ``run`` (``None``: it is scored).

    ``full_batch`` below 1 scales the loss but not ``adam``'s L2
    ``weight_decay``, which then outweighs it and trains another, useless
    model (issue 50: at 1e-4 the weight norm fell from 12.0 to 0.005).
    """
    s = run.settings
    if subset_loss == "full_batch" and linearize_at < 1.0:
        if s.optimizer == "adam" and s.weight_decay > 0:
            return (
                "adam's L2 weight_decay is not scaled with the loss, so below 1 it outweighs "
                "the loss and trains another model"
            )
    return None


def halves_masks(n_train: int, count: int, seed: int) -> Tensor:
    """``[count, n_train]`` float64 0/1 masks, each keeping ``⌊n/2⌋`` rows drawn by ``seed``."""
    gen = torch.Generator().manual_seed(int(seed))
    masks = torch.zeros(count, n_train, dtype=torch.float64)
    for k in range(count):
        masks[k, torch.randperm(n_train, generator=gen)[: n_train // 2]] = 1.0
    return masks


def retrained_outputs(
    run: ReplayRun, masks: Tensor, batch: tuple[Tensor, ...], side_by_side: int
) -> Tensor:
    """``[R, m]`` validation outputs of ``run`` retrained at each mask (same init and order).

    Models ``vmap`` cannot trace are retrained one mask at a time.
    """
    outs: list[Tensor] = []
    for start in range(0, masks.shape[0], side_by_side):
        chunk = masks[start : start + side_by_side]
        try:
            thetas = list(run.retrain_many(chunk))
            params = [run.layout.views(theta) for theta in thetas]
        except RuntimeError as exc:
            if "vmap" not in str(exc):
                raise
            params = [run.retrain(w) for w in chunk]
        outs.extend(run.outputs(batch, p).double().cpu() for p in params)
    return torch.stack(outs)


def choose(run: ReplayRun, auto: AutoLinearization) -> tuple[LinearizationChoice, ReplayRun]:
    """The best of ``auto``'s candidates for ``run`` and its trained run (module docstring).

    The truth is ``run`` retrained at each half with its own ``subset_loss``
    (``run``'s ``linearize_at`` plays no part: the masks are the weights).
    """
    queries, candidates, retrains = auto.queries, auto.candidates, auto.retrains
    seed, side_by_side = auto.seed, auto.side_by_side
    pairs = checked_candidates(candidates)
    check_int("retrains", retrains, low=3, fix="pass e.g. retrains=16")
    check_int("seed", seed)
    positive_int("side_by_side", side_by_side)
    if run.n_train < 2:
        raise ValueError(
            f"the run has {run.n_train} training row: 'auto' retrains halves of the rows and "
            "needs at least 2; pass a number as `linearize_at`."
        )
    batch = to_device(materialize(queries, run.task), run.device)
    masks = halves_masks(run.n_train, retrains, seed)
    c0 = time.process_time()
    truth = retrained_outputs(run, masks, batch, side_by_side)
    retrain_cpu = time.process_time() - c0
    lds: dict[str, float] = {}
    skipped: dict[str, str] = {}
    cpu: dict[str, float] = {}
    best: tuple[float, str, ReplayRun] | None = None
    for at, loss in pairs:
        label = label_of(at, loss)
        reason = skip_reason(run, at, loss)
        if reason is not None:
            skipped[label] = reason
            continue
        c0 = time.process_time()
        candidate = run.relinearized(at, loss)
        candidate.train()
        scores = ReversePass(candidate).reverse(batch, progress=False)
        cpu[label] = time.process_time() - c0
        value = linear_datamodeling_score(
            scores.double().cpu().numpy(), masks.numpy(), truth.numpy()
        )
        lds[label] = value
        if not math.isnan(value) and (best is None or value > best[0]):
            best = (value, label, candidate)
    if best is None:
        raise ValueError(
            f"no candidate of `candidates`={list(pairs)} has an LDS on these validation queries "
            f"(scored: {lds}; skipped: {skipped}); their retrained outputs may not vary: pass "
            "other validation queries, more `retrains`, or a number as `linearize_at`."
        )
    chosen = best[2].settings
    choice = LinearizationChoice(
        linearize_at=float(chosen.linearize_at),
        subset_loss=chosen.subset_loss,
        lds=lds,
        skipped=skipped,
        retrains=retrains,
        seed=seed,
        truth_loss=run.settings.subset_loss,
        queries=fingerprint(batch),
        retrain_cpu_s=retrain_cpu,
        candidate_cpu_s=cpu,
    )
    logger.info(
        "linearize_at='auto' chose %s: LDS %s on %d validation queries against %d "
        "same-initialization retrains (seed %d)%s; cost %.1f CPU s (retrains %.1f, candidates "
        "%s)",
        choice.label,
        {k: round(v, 4) for k, v in lds.items()},
        int(batch[0].shape[0]),
        retrains,
        seed,
        f"; skipped {skipped}" if skipped else "",
        choice.cpu_s,
        retrain_cpu,
        {k: round(v, 1) for k, v in cpu.items()},
    )
    return choice, best[2]
