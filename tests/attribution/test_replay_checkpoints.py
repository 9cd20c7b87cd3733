"""The replay averaged over checkpoints (``metagradients(at_steps=...)``) and its blend."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gradsketch.attribution import ReplayAttributor
from helpers.attribution import (
    REPLAY_BATCH,
    REPLAY_N,
    REPLAY_OPTIMIZERS,
    REPLAY_STEPS,
    replay_data,
    replay_mlp,
    trained_replay,
)


def _prefix(optimizer: str, kw: dict[str, Any], steps: int) -> ReplayAttributor:
    """The replay of the tests' run stopped after ``steps`` steps (its first batches and rates)."""
    r = ReplayAttributor(
        replay_mlp(),
        "image_classification",
        replay_data(REPLAY_N),
        optimizer=optimizer,
        num_steps=steps,
        batch_size=REPLAY_BATCH,
        progress=False,
        **kw,
    )
    r.train()
    return r


@pytest.mark.parametrize(
    ("optimizer", "kw", "jvp_min_block"),
    [pytest.param(*p.values, 1, id=f"{p.id}-forward-over-reverse") for p in REPLAY_OPTIMIZERS]
    + [pytest.param(*REPLAY_OPTIMIZERS[2].values, 16, id="adam-l2-autograd")],
)
def test_at_steps_is_the_mean_of_the_truncated_runs_metagradients(optimizer, kw, jvp_min_block):
    """One pass with ``at_steps`` equals the mean of separate replays of the first t steps.

    The slow reference replays each prefix of the run on its own (``num_steps=t``:
    the same initialization, batches and rates for its t steps) and averages the
    metagradients, float64. Both compute the same sums; the one pass only adds the
    checkpoints' query gradients into the adjoint before the later steps' terms
    are summed, so they agree to a reordering bound like a block of queries
    against single queries, ``T · D · ε · max|s|`` (T = 10 steps, D = 5 terms per
    contraction, ε = 1.1e-16), taken 4 times over for the three runs averaged.
    """
    x, y = replay_data(REPLAY_N)
    queries = (x[:3], y[:3])
    steps = (3, 7, REPLAY_STEPS)
    r = trained_replay(optimizer, kw)
    r._jvp_min_block = jvp_min_block
    fast = r.metagradients(queries, at_steps=steps)
    parts = []
    for t in steps:
        prefix = _prefix(optimizer, kw, t)
        prefix._jvp_min_block = jvp_min_block
        parts.append(prefix.metagradients(queries))
    slow = torch.stack(parts).mean(dim=0)
    bound = 4 * REPLAY_STEPS * 5 * torch.finfo(torch.float64).eps * float(slow.abs().max())
    assert float((fast - slow).abs().max()) <= bound
    # T alone is the ordinary metagradient; an early checkpoint's differs from it.
    ordinary = r.metagradients(queries)
    assert torch.equal(r.metagradients(queries, at_steps=[REPLAY_STEPS]), ordinary)
    torch.testing.assert_close(parts[-1], ordinary, rtol=0, atol=bound)
    assert float((parts[0] - parts[-1]).abs().max()) > 1e-3


def test_thirds_are_the_ceilings_of_t_over_three():
    """``"thirds"`` of T = 10 steps: ⌈10/3⌉, ⌈20/3⌉, 10 = 4, 7, 10."""
    r = trained_replay("sgd", {"lr": 0.3})
    x, y = replay_data(REPLAY_N)
    torch.testing.assert_close(
        r.metagradients((x[:2], y[:2]), at_steps="thirds"),
        r.metagradients((x[:2], y[:2]), at_steps=[10, 4, 7, 7]),
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize(
    ("at_steps", "match"),
    [
        ([0], r"`at_steps`=\[0\].*1 <= t <= num_steps=10"),
        ([11], r"`at_steps`=\[11\].*1 <= t <= num_steps=10"),
        ([], r"`at_steps`=\[\].*'thirds'"),
        ("halves", r"`at_steps`='halves'.*'thirds'"),
    ],
    ids=["zero", "past-the-end", "empty", "unknown-name"],
)
def test_invalid_at_steps_are_refused(at_steps, match):
    r = trained_replay("sgd", {"lr": 0.3})
    x, y = replay_data(REPLAY_N)
    with pytest.raises(ValueError, match=match):
        r.metagradients((x[:2], y[:2]), at_steps=at_steps)


def test_blend_is_the_weighted_mean_of_z_scored_columns():
    """Against an explicit float64 z-score: each column's mean 0, standard deviation 1.

    The blend is invariant to each method's scale and offset per column, up to
    rounding: 1e-12 on values of order 1; an offset c on a column of spread s
    costs ε · c / s = 1.1e-16 · 5 / 1e-6 ≈ 5.6e-10, allowed 4 times over. A column
    without spread is 0.
    """
    g = torch.Generator().manual_seed(0)
    a = torch.randn(50, 3, generator=g, dtype=torch.float64)
    b = torch.randn(50, 3, generator=g, dtype=torch.float64)
    b[:, 2] = 7.0

    def z(s: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(s)
        for j in range(s.shape[1]):
            col = s[:, j]
            sd = ((col - col.mean()) ** 2).mean().sqrt()
            out[:, j] = (col - col.mean()) / sd if sd > 0 else 0.0
        return out

    blended = ReplayAttributor.blend(a, b, weight=0.3)
    torch.testing.assert_close(blended, 0.3 * z(a) + 0.7 * z(b), rtol=0, atol=1e-12)
    scaled = ReplayAttributor.blend(1e-6 * a + 5.0, 1e4 * b, weight=0.3)
    torch.testing.assert_close(scaled, blended, rtol=0, atol=4 * 5.6e-10)
    torch.testing.assert_close(ReplayAttributor.blend(a, b, weight=1.0), z(a), rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("other", "weight", "match"),
    [
        (torch.zeros(4, 2), 0.5, r"`scores` \(4, 3\) and `other` \(4, 2\) differ"),
        (torch.zeros(4, 3), 1.5, r"`weight`=1.5.*\[0, 1\]"),
        (torch.zeros(4, 3), -0.1, r"`weight`"),
    ],
    ids=["shapes", "weight-above-1", "weight-below-0"],
)
def test_invalid_blends_are_refused(other, weight, match):
    with pytest.raises(ValueError, match=match):
        ReplayAttributor.blend(torch.zeros(4, 3), other, weight=weight)


def test_the_full_batch_adam_l2_warning_names_the_blend(caplog):
    """The run the suite's replay alone cannot predict is told the rule chosen on half A."""
    x, y = replay_data(REPLAY_N)
    with caplog.at_level("WARNING", logger="gradsketch.attribution._replay"):
        ReplayAttributor(
            replay_mlp(),
            "image_classification",
            (x, y),
            optimizer="adam",
            lr=0.01,
            weight_decay=1e-4,
            batch_size=REPLAY_N,
            num_steps=REPLAY_STEPS,
            progress=False,
        )
    notes = [r.getMessage() for r in caplog.records if "protocol suite" in r.getMessage()]
    assert len(notes) == 1
    assert "ReplayAttributor.blend(replay.metagradients(queries, at_steps='thirds')" in notes[0]
    assert "0.48-0.50 fresh seeds" in notes[0]
