"""The one SGMCMC chain loop: step, check, update, record, on a draw schedule.

Every sampler of the library (:func:`~gradsketch.sampling.estimate_learning_coeff`,
:func:`gradsketch.slt.sample` and the Bayesian influence's
:func:`~gradsketch.slt.sample_loss_draws`) runs its chains through
:func:`run_chain`. The loop owns the order of one step::

    zero grads -> loss = step_loss(step)  (forward + backward, accumulated)
               -> non-finite check        (the caller's error)
               -> optimizer.step(noise_generator=...)
               -> on_step(step, loss)
               -> on_draw(draw, step, loss)   on the schedule's draw steps
               -> tick()

and each caller keeps what is its own in the closures: which batches, how
losses are accumulated, what a draw records and how a failure reads.
Callbacks run after the update: they see the weights the step produced.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from gradsketch._checks import nonnegative_int, positive_int

__all__ = ["DrawSchedule", "run_chain"]

#: What a step's closure returns: a float, or a tensor of per-example losses.
LossT = TypeVar("LossT", torch.Tensor, float)


@dataclass(frozen=True)
class DrawSchedule:
    """Which sampler steps are draws: a burn-in, then one draw every ``num_steps_bw_draws``.

    A chain runs ``num_steps = num_burnin_steps + num_draws * num_steps_bw_draws``
    steps. With ``b`` burn-in steps and ``d`` steps between draws, draw ``k``
    (``0 <= k < num_draws``) is taken on step

    * ``b + k * d`` when ``after_update`` is False (devinterp's and the LLC
      estimators' rule: the draw's loss is that step's minibatch loss at the
      weights ``w_{b + k d}`` before its update);
    * ``b + (k + 1) * d - 1`` when ``after_update`` is True (the loss-draw
      sampler's rule: the draw evaluates the weights ``w_{b + (k + 1) d}``
      that the step's update produced).

    Attributes:
        num_draws: Draws per chain (>= 1).
        num_burnin_steps: Steps before the first draw's block (>= 0).
        num_steps_bw_draws: Steps per draw (>= 1).
        after_update: Draw on the last step of each block instead of the first.

    Example:
        >>> [DrawSchedule(3, 2, 2).draw_at(s) for s in range(8)]
        [None, None, 0, None, 1, None, 2, None]
        >>> [DrawSchedule(3, 2, 2, after_update=True).draw_at(s) for s in range(8)]
        [None, None, None, 0, None, 1, None, 2]
    """

    num_draws: int
    num_burnin_steps: int = 0
    num_steps_bw_draws: int = 1
    after_update: bool = False

    def __post_init__(self) -> None:
        positive_int("num_draws", self.num_draws)
        nonnegative_int("num_burnin_steps", self.num_burnin_steps)
        positive_int("num_steps_bw_draws", self.num_steps_bw_draws)

    @property
    def num_steps(self) -> int:
        """Sampler steps of one chain."""
        return self.num_burnin_steps + self.num_draws * self.num_steps_bw_draws

    def draw_at(self, step: int) -> int | None:
        """The draw that step ``step`` (0-based) takes, or None when it takes none."""
        d = self.num_steps_bw_draws
        shift = d - 1 if self.after_update else 0
        draw, since = divmod(step - self.num_burnin_steps - shift, d)
        if draw < 0 or since or draw >= self.num_draws:
            return None
        return draw


def _finite(loss: torch.Tensor | float) -> bool:
    if isinstance(loss, torch.Tensor):
        return bool(torch.isfinite(loss).all())
    return math.isfinite(loss)


def run_chain(
    optimizer: torch.optim.Optimizer,
    step_loss: Callable[[int], LossT],
    schedule: DrawSchedule,
    *,
    noise_generator: torch.Generator | None,
    nonfinite_error: Callable[[int, LossT], BaseException] | None = None,
    on_step: Callable[[int, LossT], object] | None = None,
    on_draw: Callable[[int, int, LossT], object] | None = None,
    tick: Callable[[], object] | None = None,
) -> None:
    """Run ``schedule.num_steps`` sampler steps of one chain, calling back as they go.

    Each step: ``optimizer.zero_grad(set_to_none=True)``; ``loss =
    step_loss(step)``, which runs the forward and backward passes (all of a
    step's micro-batches) and returns the step's loss as the caller wants it
    recorded; if ``nonfinite_error`` is given and ``loss`` has a NaN or
    infinite entry, ``raise nonfinite_error(step, loss)`` (before the update);
    ``optimizer.step(noise_generator=noise_generator)``; then, all after the
    update, ``on_step(step, loss)``, ``on_draw(draw, step, loss)`` when
    :meth:`DrawSchedule.draw_at` gives a draw, and ``tick()``.

    Gradients are left in place until the next step, so callbacks may read
    the step's ``p.grad``. Random state is the callers': the loop draws
    nothing itself, so the same closures and generators give the same chain.

    Args:
        optimizer: An SGMCMC sampler (its ``step`` takes ``noise_generator``).
        step_loss: ``step -> loss`` (a float or a tensor): forward + backward.
        schedule: Steps and draws of the chain.
        noise_generator: The sampler noise's generator (None: torch's global one).
        nonfinite_error: ``(step, loss) -> exception`` raised on a non-finite
            loss; None skips the check (and its device sync).
        on_step: ``(step, loss)`` after every update.
        on_draw: ``(draw, step, loss)`` after the update of each draw step.
        tick: Progress, once per step (e.g. a tqdm bar's ``update``).

    Example:
        >>> from gradsketch.sampling import SGMCMC
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> opt = SGMCMC.sgld([w], lr=1e-2, nbeta=10.0, localization=1.0)
        >>> def step_loss(step):
        ...     loss = (w - 1).pow(2).sum()
        ...     loss.backward()
        ...     return float(loss.detach())
        >>> draws = []
        >>> run_chain(opt, step_loss, DrawSchedule(3, num_burnin_steps=1),
        ...           noise_generator=torch.Generator().manual_seed(0),
        ...           on_draw=lambda draw, step, loss: draws.append((draw, step)))
        >>> draws
        [(0, 1), (1, 2), (2, 3)]
    """
    step_fn: Any = optimizer.step  # SGMCMC.step takes `noise_generator`
    for step in range(schedule.num_steps):
        optimizer.zero_grad(set_to_none=True)
        loss = step_loss(step)
        if nonfinite_error is not None and not _finite(loss):
            raise nonfinite_error(step, loss)
        step_fn(noise_generator=noise_generator)
        if on_step is not None:
            on_step(step, loss)
        if on_draw is not None:
            draw = schedule.draw_at(step)
            if draw is not None:
                on_draw(draw, step, loss)
        if tick is not None:
            tick()
