"""``linearize_at="auto"``: the replay's linearization chosen from validation retrains."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

from gradsketch._settings import SettingsMismatchError
from gradsketch.attribution import (
    AUTO_CANDIDATES,
    AutoLinearization,
    ReplayAttributor,
    ReplaySettings,
)
from gradsketch.attribution._replay_auto import halves_masks
from helpers.attribution import replay_mlp

N, STEPS, BATCH, R = 24, 12, 6, 8
#: SGD with momentum and L2 decay (every default candidate is scored), and Adam with L2
#: (full_batch below 1 is skipped).
SGD = {"optimizer": "sgd", "lr": 0.3, "momentum": 0.9, "weight_decay": 0.01}
ADAM_L2 = {"optimizer": "adam", "lr": 0.05, "weight_decay": 0.01, "eps": 1e-6}


def _data() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``N`` float64 training rows and 5 validation rows of 4 features, 3 classes."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(N + 5, 4, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (N + 5,), generator=gen)
    return (x[:N], y[:N]), (x[N:], y[N:])


def _replay(kw, **extra) -> ReplayAttributor:
    train, _ = _data()
    return ReplayAttributor(
        replay_mlp(),
        "image_classification",
        train,
        num_steps=STEPS,
        batch_size=BATCH,
        progress=False,
        **kw,
        **extra,
    )


def _auto(kw, *, seed=0, **extra) -> ReplayAttributor:
    _, val = _data()
    auto = AutoLinearization(queries=val, retrains=R, seed=seed, side_by_side=3)
    r = _replay(kw, linearize_at="auto", auto_linearize=auto, **extra)
    r.train()
    return r


def _truth(kw, masks):
    """``[R, m]`` validation outputs of one retrain per mask (kept_mean: the retrains a
    torch loop makes on the kept rows), the slow way."""
    _, val = _data()
    truth = _replay(kw)
    truth.train()
    return np.stack([truth.outputs(val, truth.retrain(mask)).double().numpy() for mask in masks])


def _brute_force_lds(kw, at, loss, masks, outputs):
    """LDS of one candidate by the slow way: a replay built at it, a Spearman correlation
    per validation query (scipy), their mean."""
    _, val = _data()
    r = _replay(kw, linearize_at=at, subset_loss=loss)
    r.train()
    scores = r.metagradients(val).double().numpy()
    predicted = masks.numpy() @ scores
    return float(
        np.mean([spearmanr(predicted[:, j], outputs[:, j])[0] for j in range(scores.shape[1])])
    )


@pytest.mark.parametrize("kw", [SGD, ADAM_L2], ids=["sgd-momentum-l2", "adam-l2"])
def test_the_choice_is_the_brute_force_best_of_the_same_candidates_on_the_same_halves(kw):
    """Each candidate's LDS equals the slow evaluation's, and the choice is their argmax.

    The fast path retrains the halves side by side (``retrain_many``, one
    ``vmap`` per step); the slow one retrains them one by one: the outputs
    differ by the order of a few float64 sums (~1e-15 relative after 12
    steps), far below the gaps between distinct outputs of 8 retrains, so the
    ranks, hence each Spearman correlation, are equal; 1e-9 only absorbs the
    rounding of the mean. The adopted run's metagradients are those of an
    attributor built at the chosen setting, bit for bit (same operations).
    """
    r = _auto(kw)
    choice = r.linearization
    assert choice is not None
    masks = halves_masks(N, R, 0)
    scored = [(at, loss) for at, loss in AUTO_CANDIDATES if f"{loss}@{at:g}" in choice.lds]
    outputs = _truth(kw, masks)
    brute = {
        f"{loss}@{at:g}": _brute_force_lds(kw, at, loss, masks, outputs) for at, loss in scored
    }
    assert set(choice.lds) == set(brute)
    for label, value in brute.items():
        assert abs(choice.lds[label] - value) <= 1e-9, label
    assert choice.label == max(brute, key=lambda k: brute[k])  # first listed on a tie
    assert (r.settings.linearize_at, r.settings.subset_loss) == (
        choice.linearize_at,
        choice.subset_loss,
    )
    _, val = _data()
    explicit = _replay(kw, linearize_at=choice.linearize_at, subset_loss=choice.subset_loss)
    explicit.train()
    assert torch.equal(r.metagradients(val), explicit.metagradients(val))
    if kw is ADAM_L2:
        assert set(choice.skipped) == {"full_batch@0.5", "full_batch@0.25"}
        assert all("weight_decay" in why for why in choice.skipped.values())
    else:
        assert not choice.skipped
        assert len(set(choice.lds.values())) > 1  # the candidates differ here


def test_the_choice_is_reproducible_for_a_seed_and_the_halves_follow_the_seed():
    """Same seed: the same LDS per candidate, bit for bit, and the same choice; another
    seed draws other halves (so other LDS figures)."""
    a, b, c = _auto(SGD, seed=5), _auto(SGD, seed=5), _auto(SGD, seed=6)
    assert a.linearization is not None and b.linearization is not None
    assert c.linearization is not None
    assert a.linearization.lds == b.linearization.lds
    assert a.linearization.record() == b.linearization.record()
    assert a.linearization.lds != c.linearization.lds
    masks = halves_masks(N, R, 5)
    assert torch.equal(masks, halves_masks(N, R, 5))
    assert (masks.sum(1) == N // 2).all()
    assert not torch.equal(masks, halves_masks(N, R, 6))


def test_the_cost_and_the_choice_are_logged(caplog):
    """The log line names the choice, every candidate's LDS and the CPU seconds; the
    choice holds the retrain count and one timing per scored candidate."""
    with caplog.at_level(logging.INFO, logger="gradsketch.attribution._replay_auto"):
        r = _auto(SGD)
    choice = r.linearization
    assert choice is not None
    assert choice.retrains == R and choice.seed == 0 and choice.truth_loss == "kept_mean"
    assert set(choice.candidate_cpu_s) == set(choice.lds)
    assert choice.retrain_cpu_s > 0 and all(v > 0 for v in choice.candidate_cpu_s.values())
    assert choice.cpu_s == pytest.approx(
        choice.retrain_cpu_s + sum(choice.candidate_cpu_s.values())
    )
    (line,) = [rec.getMessage() for rec in caplog.records if "chose" in rec.getMessage()]
    assert f"chose {choice.label}" in line
    assert f"{R} same-initialization retrains" in line
    assert "CPU s" in line
    for label in choice.lds:
        assert label in line


def test_the_choice_is_recorded_with_stored_scores_and_another_is_refused(tmp_path):
    """``score`` stores the choice's record beside the settings; a rerun with another
    seed (another choice record) is refused with both values shown."""
    _, val = _data()
    r = _auto(SGD, save_dir=tmp_path)
    r.score(val, exp_name="q")
    stored = json.loads((tmp_path / "q" / "settings.json").read_text())
    assert stored["linearize_auto"] == r.linearization.record()
    assert stored["linearize_auto"]["chosen"] == r.linearization.label
    assert stored["linearize_at"] == r.linearization.linearize_at
    again = _auto(SGD, save_dir=tmp_path)  # same seed: the same record, read back
    torch.testing.assert_close(again.score(val, exp_name="q"), r.finalize_scores("q"))
    other = _auto(SGD, seed=1, save_dir=tmp_path)
    assert other.linearization.record() != r.linearization.record()  # the seed differs
    with pytest.raises(SettingsMismatchError, match=r"linearize_auto"):
        other.score(val, exp_name="q")


def test_choose_linearization_leaves_the_attributor_as_it_is():
    """The method reports; only ``linearize_at="auto"`` adopts."""
    _, val = _data()
    r = _replay(SGD)
    r.train()
    before = r.metagradients(val)
    choice = r.choose_linearization(val, retrains=R, side_by_side=4)
    assert choice.label in choice.lds
    assert r.settings.linearize_at == 1.0 and r.settings.subset_loss == "kept_mean"
    assert r.linearization is None
    assert torch.equal(r.metagradients(val), before)


@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        (
            lambda: _replay(SGD, linearize_at="auto"),
            ValueError,
            r"`linearize_at`='auto' chooses .* `auto_linearize` is None; pass "
            r"auto_linearize=AutoLinearization\(queries=",
        ),
        (
            lambda: _replay(SGD, auto_linearize=AutoLinearization(queries=_data()[1])),
            ValueError,
            r"`auto_linearize` is given but `linearize_at`=1.0; .* pass that, or drop",
        ),
        (
            lambda: _replay(SGD, linearize_at="auto", auto_linearize={"queries": _data()[1]}),
            TypeError,
            r"`auto_linearize` must be an AutoLinearization, got dict",
        ),
        (
            lambda: AutoLinearization(),
            ValueError,
            r"`queries` of AutoLinearization is None: .* pass held-out examples",
        ),
        (
            lambda: AutoLinearization(queries=_data()[1], retrains=2),
            ValueError,
            r"`retrains` must be an integer >= 3, got 2; pass e.g. retrains=16",
        ),
        (
            lambda: AutoLinearization(queries=_data()[1], candidates=[(1.5, "kept_mean")]),
            ValueError,
            r"`candidates` holds linearize_at=1.5, above 1; give \(linearize_at, subset_loss\)",
        ),
        (
            lambda: AutoLinearization(queries=_data()[1], candidates=[(0.5, "mean")]),
            ValueError,
            r"`candidates` holds subset_loss='mean'; choose one of \['full_batch', 'kept_mean'\]",
        ),
        (
            lambda: AutoLinearization(queries=_data()[1], candidates="full_batch"),
            TypeError,
            r"`candidates`='full_batch' is not a sequence of pairs",
        ),
        (
            lambda: AutoLinearization(queries=_data()[1], candidates=[]),
            ValueError,
            r"`candidates` is empty",
        ),
        (
            lambda: ReplaySettings(linearize_at="automatic"),
            ValueError,
            r"`linearize_at` must be a finite number > 0.0, got 'automatic'.* or 'auto'",
        ),
    ],
    ids=[
        "auto-without-queries",
        "queries-without-auto",
        "not-a-settings-object",
        "no-validation-queries",
        "too-few-retrains",
        "candidate-above-one",
        "unknown-subset-loss",
        "candidates-not-pairs",
        "no-candidates",
        "unknown-string",
    ],
)
def test_bad_arguments_are_refused(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_a_run_without_two_rows_cannot_choose():
    """Halves need two rows: the refusal says so and names the fix."""
    train, val = _data()
    r = ReplayAttributor(
        replay_mlp(),
        "image_classification",
        (train[0][:1], train[1][:1]),
        num_steps=2,
        batch_size=1,
        progress=False,
    )
    with pytest.raises(ValueError, match=r"1 training row: 'auto' .* pass a number as"):
        r.choose_linearization(val, retrains=3)


@pytest.mark.slow
def test_the_protocol_suite_scores_the_auto_label_on_a_tiny_setup():
    """``replay_scores(run, "auto")`` chooses on held-out test digits and scores the
    setup's queries with the chosen setting; the choice stays on the run for the bench.
    Slow: 4 CPU s (16 retrains and four candidates, plus the digits' first load)."""
    from gradsketch.demos.protocols import suite as S

    run = S.SuiteRun(S.setup_named("A-mlp-sgd-mb").tiny())
    scores = S.replay_scores(run, "auto")
    assert scores.shape == (64, 4) and np.isfinite(scores).all()
    assert run.auto is not None and run.auto.linearization is not None
    choice = run.auto.linearization
    assert choice.retrains == S.AUTO_RETRAINS and choice.seed == S.AUTO_SEED
    assert choice.label in choice.lds
    val = S.validation_queries(run)
    assert val[0].shape[0] == S.AUTO_QUERIES
    assert not any(torch.equal(v, q) for v in val[0] for q in run.targets[0])  # held out
