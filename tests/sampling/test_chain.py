"""The one chain loop: draw schedule, callback order and arguments, non-finite hook, weights."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from gradsketch.sampling import SGMCMC
from gradsketch.sampling._chain import DrawSchedule, run_chain


class RecordingSGD(torch.optim.SGD):
    """Plain gradient descent that takes ``noise_generator`` and logs its calls to ``log``."""

    def __init__(self, params: Any, lr: float, log: list[tuple[Any, ...]]) -> None:
        super().__init__(params, lr=lr)
        self.log = log

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.log.append(("zero_grad", set_to_none))
        super().zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None, *, noise_generator: torch.Generator | None = None) -> Any:  # type: ignore[override]
        self.log.append(("step", noise_generator))
        return super().step(closure)


@pytest.mark.parametrize(
    ("burnin", "between", "draws", "after_update", "expected"),
    [
        # Hand-listed draw steps: draw k on step b + k d (before), b + (k + 1) d - 1 (after).
        (0, 1, 3, False, [0, 1, 2]),
        (0, 1, 3, True, [0, 1, 2]),
        (2, 1, 2, False, [2, 3]),
        (2, 1, 2, True, [2, 3]),
        (0, 3, 2, False, [0, 3]),
        (0, 3, 2, True, [2, 5]),
        (4, 2, 3, False, [4, 6, 8]),
        (4, 2, 3, True, [5, 7, 9]),
        (1, 4, 1, True, [4]),
    ],
    ids=["d1", "d1-after", "burnin", "burnin-after", "d3", "d3-after", "both", "both-after", "one"],
)
def test_draw_schedule_takes_the_documented_steps(
    burnin: int, between: int, draws: int, after_update: bool, expected: list[int]
) -> None:
    schedule = DrawSchedule(draws, burnin, between, after_update=after_update)
    assert schedule.num_steps == burnin + draws * between
    taken = [(s, schedule.draw_at(s)) for s in range(-2, schedule.num_steps + 3)]
    assert [s for s, d in taken if d is not None] == expected
    assert [d for _, d in taken if d is not None] == list(range(draws))


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0,), r"`num_draws` must be a positive integer, got 0"),
        ((True,), r"`num_draws` must be a positive integer, got True of type bool"),
        ((2, -1), r"`num_burnin_steps` must be a non-negative integer, got -1"),
        ((2, 0, 0), r"`num_steps_bw_draws` must be a positive integer, got 0"),
    ],
    ids=["no-draws", "bool", "negative-burnin", "no-steps-between"],
)
def test_draw_schedule_refuses_bad_counts(args: tuple[Any, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DrawSchedule(*args)


def test_callbacks_run_in_order_with_documented_arguments() -> None:
    log: list[tuple[Any, ...]] = []
    w = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    opt = RecordingSGD([w], lr=0.1, log=log)
    gen = torch.Generator().manual_seed(0)

    def step_loss(step: int) -> float:
        log.append(("loss", step, w.grad is None))
        loss = (w - 1).pow(2).sum()
        loss.backward()
        return float(step) + 0.5

    run_chain(
        opt,
        step_loss,
        DrawSchedule(2, num_burnin_steps=1, num_steps_bw_draws=2),
        noise_generator=gen,
        on_step=lambda step, loss: log.append(("on_step", step, loss)),
        on_draw=lambda draw, step, loss: log.append(("on_draw", draw, step, loss)),
        tick=lambda: log.append(("tick",)),
    )
    expected: list[tuple[Any, ...]] = []
    for step in range(5):
        # Grads are cleared before each closure (set to None), the step gets the generator.
        expected += [("zero_grad", True), ("loss", step, True), ("step", gen)]
        expected.append(("on_step", step, step + 0.5))
        if step in (1, 3):
            expected.append(("on_draw", (step - 1) // 2, step, step + 0.5))
        expected.append(("tick",))
    assert log == expected


def test_callbacks_see_the_weights_after_the_update_and_the_steps_gradient() -> None:
    """``w_{t+1} = w_t - lr * 2 (w_t - 1)`` from ``w_0 = 0``, lr = 0.1: ``w_t = 1 - 0.8^t``.

    Step ``t`` returns the loss at ``w_t``, ``(w_t - 1)^2 = 0.64^t``; its callbacks
    see ``w_{t+1}`` and the gradient ``2 (w_t - 1) = -2 * 0.8^t``.
    """
    w = torch.nn.Parameter(torch.zeros((), dtype=torch.float64))
    opt = RecordingSGD([w], lr=0.1, log=[])
    seen: list[tuple[int, float, float, float]] = []

    def step_loss(step: int) -> torch.Tensor:
        loss = (w - 1).pow(2)
        loss.backward()
        return loss.detach()

    def on_draw(draw: int, step: int, loss: torch.Tensor) -> None:
        assert w.grad is not None
        seen.append((step, float(loss), float(w.detach()), float(w.grad)))

    run_chain(opt, step_loss, DrawSchedule(3, 1, 2), noise_generator=None, on_draw=on_draw)
    assert [s for s, *_ in seen] == [1, 3, 5]
    for step, loss, weight, grad in seen:
        assert loss == pytest.approx(0.64**step, rel=1e-14)
        assert weight == pytest.approx(1 - 0.8 ** (step + 1), rel=1e-14)
        assert grad == pytest.approx(-2 * 0.8**step, rel=1e-14)


@pytest.mark.parametrize(
    "bad",
    [math.nan, math.inf, torch.tensor([[0.5, math.nan], [1.0, 2.0]])],
    ids=["nan", "inf", "tensor-entry"],
)
def test_a_non_finite_loss_raises_the_callers_error_before_the_update(bad: Any) -> None:
    w = torch.nn.Parameter(torch.zeros((), dtype=torch.float64))
    log: list[tuple[Any, ...]] = []
    opt = RecordingSGD([w], lr=0.1, log=log)
    draws: list[int] = []

    def step_loss(step: int) -> Any:
        (w - 1).pow(2).backward()
        if step == 2:
            return bad
        return torch.ones(2, 2) if isinstance(bad, torch.Tensor) else 1.0

    def error(step: int, loss: Any) -> RuntimeError:
        return RuntimeError(f"chain 7 diverged at step {step} with loss {loss!r}")

    with pytest.raises(RuntimeError, match=r"chain 7 diverged at step 2 with loss") as info:
        run_chain(
            opt,
            step_loss,
            DrawSchedule(5),
            noise_generator=None,
            nonfinite_error=error,
            on_draw=lambda draw, step, loss: draws.append(draw),
        )
    assert repr(bad) in str(info.value)
    # Two updates (steps 0 and 1), none on step 2, no draw of step 2.
    assert [e[0] for e in log].count("step") == 2
    assert draws == [0, 1]
    assert float(w.detach()) == pytest.approx(1 - 0.8**2, rel=1e-14)


def test_without_a_nonfinite_error_the_loss_is_not_checked() -> None:
    w = torch.nn.Parameter(torch.zeros(()))
    opt = RecordingSGD([w], lr=0.1, log=[])
    losses: list[float] = []

    def step_loss(step: int) -> float:
        (w - 1).pow(2).backward()
        return math.nan

    run_chain(
        opt,
        step_loss,
        DrawSchedule(3),
        noise_generator=None,
        on_draw=lambda draw, step, loss: losses.append(loss),
    )
    assert len(losses) == 3 and all(math.isnan(x) for x in losses)


def _sgld_draws(seed: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).double()
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)
    opt = SGMCMC.sgld(model.parameters(), lr=1e-2, nbeta=4.0, localization=10.0)
    draws: list[torch.Tensor] = []

    def step_loss(step: int) -> torch.Tensor:
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        return loss.detach()

    run_chain(
        opt,
        step_loss,
        DrawSchedule(4, 2, 3),
        noise_generator=torch.Generator().manual_seed(seed),
        on_draw=lambda draw, step, loss: draws.append(model.weight.detach().clone()),
    )
    return draws


def test_the_chain_is_fixed_by_its_noise_generator() -> None:
    first, again, other = _sgld_draws(5), _sgld_draws(5), _sgld_draws(6)
    assert len(first) == 4
    for a, b in zip(first, again):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(first[-1], other[-1])
