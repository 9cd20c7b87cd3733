"""The protocol suite: its split, its runs (replay = torch loop), its ground truths and scores."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
import torch
from torch import nn

from gradsketch.attribution import ReplayAttributor
from gradsketch.attribution._replay_run import batch_order
from gradsketch.demos.protocols import suite as S

DIGITS = [s for s in S.SETUPS if not s.is_lm]


def _float64(setup: S.Setup) -> tuple[S.Setup, S.DigitsData]:
    tiny = setup.tiny()
    d = S.digits_data(tiny)
    return tiny, S.DigitsData(d.x.double(), d.y, d.xq.double(), d.yq)


def _replay64(setup: S.Setup, data: S.DigitsData, **kw: object) -> ReplayAttributor:
    return ReplayAttributor(
        S.build(setup, setup.seed, torch.float64),
        "image_classification",
        data.train,
        S.replay_settings(setup, setup.seed, **kw),  # type: ignore[arg-type]
        progress=False,
    )


# -- the split -----------------------------------------------------------------------------
def test_split_covers_the_issue_list_in_both_halves() -> None:
    """Each half has >= 4 setups; between them the suite covers every item the issue lists."""
    assert len(S.SETUPS) >= 8
    assert len({s.name for s in S.SETUPS}) == len(S.SETUPS)
    for half in S.HALVES:
        setups = [s for s in S.SETUPS if s.half == half]
        assert len(setups) >= 4
        assert all(s.name.startswith(f"{half}-") for s in setups)
        assert {s.optimizer for s in setups} == {"sgd", "adam", "adamw"}
        assert {"mlp", "cnn"} <= {s.model for s in setups}
    every = S.SETUPS
    assert any(s.optimizer == "sgd" and not s.momentum and s.batch_size for s in every)
    assert any(s.optimizer == "sgd" and s.momentum and s.batch_size for s in every)
    assert any(s.optimizer == "adam" and s.decay == "L2" and s.batch_size is None for s in every)
    assert any(s.optimizer == "adam" and s.decay == "L2" and s.batch_size for s in every)
    assert any(s.optimizer == "adamw" and s.schedule == "warmup-cosine" for s in every)
    assert {s.model for s in every} == set(S.MODELS)
    assert min(s.steps for s in DIGITS) <= 100 and max(s.steps for s in DIGITS) >= 500


def test_the_issues_unseen_run_is_in_half_b() -> None:
    """The issue's run: MLP 64-32-10, 1,000 / 100 rows, full-batch Adam 1e-2, L2 1e-4, 300 steps."""
    issue = S.setup_named("B-mlp-adam-l2-fb-issue")
    assert (issue.half, issue.model, issue.width, issue.n_train, issue.n_queries) == (
        "B",
        "mlp",
        32,
        1000,
        100,
    )
    assert (issue.optimizer, issue.lr, issue.weight_decay, issue.decay) == (
        "adam",
        1e-2,
        1e-4,
        "L2",
    )
    assert (issue.batch_size, issue.steps, issue.schedule) == (None, 300, "constant")
    shapes = [tuple(p.shape) for p in S.build(issue, 0).parameters()]
    assert shapes == [(32, 64), (32,), (10, 32), (10,)]


def test_recommendations_name_known_candidates() -> None:
    assert set(S.RECOMMENDED["replay"]) == {"sgd", "adam", "adamw"}
    assert set(S.RECOMMENDED["replay"].values()) <= {*S.REPLAY_CANDIDATES, *S.BLEND_CANDIDATES}
    assert set(S.RECOMMENDED["others"]) <= set(S.OTHER_CANDIDATES)


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        ("constant", [1.0, 1.0, 1.0, 1.0, 1.0]),
        ("cosine", [1.0, 0.8536, 0.5, 0.1464, 0.0]),
        ("warmup-cosine", [0.0, 0.5, 1.0, 0.5, 0.0]),
        ("warmup-linear", [0.0, 0.5, 1.0, 0.6667, 0.3333]),
    ],
    ids=["constant", "cosine", "warmup-cosine", "warmup-linear"],
)
def test_schedules(schedule: str, expected: list[float]) -> None:
    """Rates of steps 0..4 of ``T = 4`` (cosine) or ``T = 5`` with 2 warmup steps."""
    total = 4 if schedule in ("cosine", "warmup-cosine") else 5
    setup = S.Setup("x", "A", "mlp", "sgd", 1.0, schedule, total, warmup=2)
    got = [setup.multiplier(t) for t in range(5)]
    assert got == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("half", "C", "`half`='C'"),
        ("model", "resnet", "`model`='resnet'"),
        ("schedule", "step", "`schedule`='step'"),
        ("optimizer", "rmsprop", "`optimizer`='rmsprop'"),
    ],
    ids=["half", "model", "schedule", "optimizer"],
)
def test_setup_refuses_unknown_values(field: str, value: str, match: str) -> None:
    base = S.SETUPS[0]
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(base, **{field: value})  # type: ignore[arg-type]


def test_unknown_setup_name_lists_the_suite() -> None:
    with pytest.raises(ValueError, match="`setup`='nope' is not in the suite; choose one of"):
        S.setup_named("nope")


def test_build_refuses_gpt2() -> None:
    with pytest.raises(ValueError, match="lm_protocol_of"):
        S.build(S.setup_named("A-gpt2-scratch"), 0)


# -- the runs ------------------------------------------------------------------------------
@pytest.mark.parametrize("setup", DIGITS, ids=[s.name for s in DIGITS])
def test_replay_trains_the_torch_loops_model(setup: S.Setup) -> None:
    """The replay's run and the torch loop (``torch.optim``, ``LambdaLR``) agree in float64.

    Both apply the same float operations to the same batches; torch's foreach
    kernels may reorder a few, so each step can differ by a few float64 ulps
    (~1e-16 relative) and 12 steps of a width-8 model stay far below 1e-10.
    """
    tiny, data = _float64(setup)
    replay = _replay64(tiny, data)
    replay.train()
    ours = replay.retrain(torch.ones(tiny.n_train, dtype=torch.float64))
    loop = S.torch_train(tiny, data, None, tiny.seed)
    assert S.max_abs_diff(ours, dict(loop.named_parameters())) < 1e-10


def _kept_rows_loop(setup: S.Setup, data: S.DigitsData, mask: np.ndarray) -> nn.Module:
    """The slow reference of a same-initialization retrain: the run's own order, kept rows only.

    Each step takes the run's batch, drops the left-out rows and averages the
    loss over the kept ones; a batch with none left steps on a zero gradient.
    """
    model = S.build(setup, setup.seed, torch.float64)
    opt = S.torch_optimizer(setup, model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, setup.multiplier)
    keep = torch.from_numpy(mask)
    order = batch_order(setup.n_train, setup.rows_per_step(setup.n_train), setup.steps, seed=0)
    for batch in order:
        opt.zero_grad(set_to_none=False)
        rows = batch[keep[batch]]
        if len(rows):
            nn.functional.cross_entropy(model(data.x[rows]), data.y[rows]).backward()
        else:
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
        opt.step()
        sched.step()
    return model


@pytest.mark.parametrize(
    "name", ["A-mlp-sgd-mb", "B-mlp-adam-l2-fb-issue", "A-cnn-adamw-warmcos-short"]
)
def test_same_init_truth_is_the_retrain_on_kept_rows(name: str) -> None:
    """``kept_mean`` retrains at a 0/1 mask equal the kept-rows loop (float64, < 1e-10 as above)."""
    tiny, data = _float64(dataclasses.replace(S.setup_named(name), seed=0))
    replay = _replay64(tiny, data)
    replay.train()
    mask = S.halves(tiny.n_train, 1, 3)[0]
    ours = replay.retrain(torch.from_numpy(mask.astype(np.float64)))
    ref = _kept_rows_loop(tiny, data, mask)
    assert S.max_abs_diff(ours, dict(ref.named_parameters())) < 1e-10


def test_suite_run_truths_and_scores_fit_together() -> None:
    """Truths have one row per half; fresh retrains are the torch loop; scores are [n, m]."""
    run = S.SuiteRun(S.setup_named("A-mlp-sgd-mb").tiny())
    masks = S.halves(run.n_train, 3, 0)
    assert masks.shape == (3, 64) and (masks.sum(1) == 32).all()
    same = S.same_init_retrains(run, masks)
    fresh = S.fresh_seed_retrains(run, masks, 7)
    assert same.shape == fresh.shape == (3, 4)
    loop = S.torch_train(run.setup, run.data, np.flatnonzero(masks[1]), 8)
    np.testing.assert_array_equal(fresh[1], S.margins(loop, run.targets))
    scores = S.replay_scores(run, "kept_mean@1")
    assert scores.shape == (64, 4) and np.isfinite(scores).all()


def test_blend_candidates_name_known_parts() -> None:
    for label, (replay, other, how, weight) in S.BLEND_CANDIDATES.items():
        assert replay in S.REPLAY_CANDIDATES and other in S.OTHER_CANDIDATES, label
        assert how in ("z", "rank") and 0 <= weight <= 1, label


def test_blend_scores_reuse_their_parts_and_rank_blends_rank() -> None:
    """The recommended Adam blend is the z-blend of its two parts, each scored once (cached).

    The rank blend of two columns is the mean of their ranks over n rows divided by n
    (exact: ranks are integers). The z blend is checked against an explicit
    formula in tests/attribution/test_replay_checkpoints.py.
    """
    label = S.RECOMMENDED["replay"]["adam"]
    replay, other, _, weight = S.BLEND_CANDIDATES[label]
    rng = np.random.default_rng(0)
    # A run whose parts are already scored (SuiteRun.scores): nothing is trained.
    run = types.SimpleNamespace(
        scores={replay: rng.normal(size=(64, 4)), other: rng.normal(size=(64, 4))}
    )
    scores = S.replay_scores(run, label)  # type: ignore[arg-type]
    assert set(run.scores) == {label, replay, other}
    np.testing.assert_array_equal(
        scores, S.blend(run.scores[replay], run.scores[other], weight=weight)
    )
    assert S.replay_scores(run, label) is scores  # type: ignore[arg-type]
    a = np.array([[3.0], [1.0], [2.0], [0.0]])
    b = np.array([[0.0], [1.0], [2.0], [3.0]])
    np.testing.assert_array_equal(S.blend(a, b, how="rank"), (a + b) / 8)
    with pytest.raises(ValueError, match=r"`how`='mean'"):
        S.blend(a, b, how="mean")


def test_ceiling_recovers_a_linear_datamodel() -> None:
    """Outputs linear in the mask plus noise: the fitted datamodel ranks held-out halves well.

    ``y = mask @ β + ε`` with ``β ~ N(0, 1)`` over 40 rows and ``ε ~ N(0, 0.1²)``:
    across halves ``Var(mask @ β) ≈ 40 · ¼ = 10``, so the true correlation is
    ``√(10 / 10.01) ≈ 0.9995``; 300 fitting halves for 40 coefficients leave
    a fitting error of about ``√(40/300) · 0.1`` per output, so the LDS of
    the fit on 50 fresh halves stays above 0.95 (and the true β's too).
    """
    rng = np.random.default_rng(0)
    beta = rng.normal(size=(40, 3))

    def draw(count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        masks = S.halves(40, count, seed)
        return masks, masks @ beta + 0.1 * rng.normal(size=(count, 3))

    fit, evaluation = draw(300, 1), draw(50, 2)
    row = S.datamodel_ceiling(*fit, {"eval": evaluation})["eval"]
    assert row["lds"] > 0.95 and row["ci95"][0] <= row["lds"] <= row["ci95"][1]
    assert S.lds_row(beta, evaluation)[0] > 0.95


@pytest.mark.slow
def test_bench_quick_runs_one_setup(capsys: pytest.CaptureFixture[str]) -> None:
    """``bench_protocols.py --quick`` prints loop, truth, lds, paired and ceiling lines."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).parents[2] / "benchmarks" / "bench_protocols.py"
    spec = importlib.util.spec_from_file_location("bench_protocols", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--half", "B", "--quick", "--setups", "B-mlp-adam-l2-fb-issue"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    parts = [r["part"] for r in rows]
    assert parts[:3] == ["setup", "loop", "truth"] and parts.count("ceiling") == 1
    lds = [r for r in rows if r["part"] == "lds"]
    others = len(S.RECOMMENDED["others"])
    assert len(lds) == 1 + others
    assert all(-1 <= r["same_init"] <= 1 and "fresh_seed_ci95" in r for r in lds)
    pairs = [r for r in rows if r["part"] == "paired"]
    assert len(pairs) == 2 * others  # per truth, the replay against each other method
    for truth in ("same_init", "fresh_seed"):
        best = [r for r in pairs if r["truth"] == truth and r["best_other"]]
        assert len(best) == 1
        scored = {r["method"]: r[truth] for r in lds}
        assert best[0]["replay_minus_other"] == pytest.approx(
            scored[S.RECOMMENDED["replay"]["adam"]] - scored[best[0]["other"]], abs=2e-4
        )
    ceiling = next(r for r in rows if r["part"] == "ceiling")
    assert ceiling["fit_retrains"] == 20 and "target" in ceiling


@pytest.mark.slow
@pytest.mark.parametrize("name", ["A-gpt2-scratch", "B-gpt2-finetune"])
def test_gpt2_setups_replay_the_lm_loop(name: str) -> None:
    """The GPT-2 setups at test size: the replay trains the LM demo's loop, truths fit together.

    float32 through 8 AdamW steps: each step can move a weight by up to ``lr``
    and the two paths round differently (~1e-7 relative per operation), so
    1e-5 bounds the difference (as ``test_bench_replay`` does for this loop).
    """
    run = S.SuiteRun(S.setup_named(name).tiny())
    ours = run.truth_run.retrain(torch.ones(run.n_train))
    assert S.max_abs_diff(ours, run.torch_final()) < 1e-5
    masks = S.halves(run.n_train, 2, 0)
    assert S.same_init_retrains(run, masks).shape == (2, 4)
    assert S.fresh_seed_retrains(run, masks, 5).shape == (2, 4)


# -- the ceiling and paired comparisons ----------------------------------------------------
def test_side_by_side_retrains_equal_one_by_one() -> None:
    """Same-init retrains trained side by side (one vmap per step) equal the one-by-one loop.

    float32, 12 SGD steps of a width-8 MLP: the two paths differ only in the
    order of a few reductions (~6e-8 relative each), and margins of order 1
    move by far less than 1e-5 after 12 steps.
    """
    run = S.SuiteRun(S.setup_named("A-mlp-sgd-mb").tiny())
    masks = S.halves(run.n_train, 5, 4)
    one = S.same_init_retrains(run, masks)
    many = S.same_init_retrains(run, masks, side_by_side=2)
    np.testing.assert_allclose(many, one, rtol=0, atol=1e-5)
    assert np.ptp(one, axis=0).max() > 1e-3  # the masks change the outputs


def test_ceiling_curve_rows_grow_and_stop_at_the_budget() -> None:
    """Each size reached gives one row (replay beside it); a spent budget ends with `stopped_at`."""
    from gradsketch.demos.protocols.ceiling import ceiling_curve

    run = S.SuiteRun(S.setup_named("A-mlp-sgd-mb").tiny())
    evaluation_masks = S.halves(run.n_train, 8, 10_000)
    evaluation = (evaluation_masks, S.same_init_retrains(run, evaluation_masks))
    replay = S.replay_scores(run, "kept_mean@1")
    rows = list(
        ceiling_curve(run, evaluation, [15, 30], budget_cpu_s=1e9, replay=replay, side_by_side=10)
    )
    assert [r["fit_retrains"] for r in rows] == [15, 30]
    assert rows[0]["retrains_cpu_s"] < rows[1]["retrains_cpu_s"]
    for r in rows:
        assert -1 <= r["lds"] <= 1 and r["ridge"] > 0
        assert r["replay_same_init"] == S.lds_row(replay, evaluation)[0]
        assert r["target"] in ("holds", "misses", "ceiling below 0.85")
    cut = list(ceiling_curve(run, evaluation, [15, 30], budget_cpu_s=1e-9, side_by_side=15))
    assert [r.get("fit_retrains") for r in cut] == [15, None]
    assert cut[-1]["stopped_at"] == 15 and cut[-1]["not_reached"] == [30]
    assert "replay_same_init" not in cut[0]


def test_ceiling_curve_refuses_too_few_retrains() -> None:
    from gradsketch.demos.protocols.ceiling import ceiling_curve

    run = S.SuiteRun(S.setup_named("A-mlp-sgd-mb").tiny())
    truth = (np.zeros((3, 64), bool), np.zeros((3, 4)))
    with pytest.raises(ValueError, match=r"`sizes`=\[10, 100\]: a datamodel needs at least 15"):
        next(ceiling_curve(run, truth, [10, 100], budget_cpu_s=1.0))


@pytest.mark.parametrize(
    ("replay", "ceiling", "expected"),
    [(0.81, 0.9, "holds"), (0.79, 0.85, "misses"), (0.5, 0.84, "ceiling below 0.85")],
    ids=["holds", "misses", "low-ceiling"],
)
def test_verdict(replay: float, ceiling: float, expected: str) -> None:
    from gradsketch.demos.protocols.ceiling import verdict

    assert verdict(replay, ceiling) == expected


def test_paired_difference_is_the_difference_of_the_two_lds() -> None:
    """The paired estimate is LDS(a) − LDS(b) on the same retrains; a better `a` excludes 0.

    ``a`` is the true linear model of outputs ``masks @ a + noise`` (noise sd
    1 against a signal sd of √(30/4) ≈ 2.7: LDS ≈ 0.93), ``b`` is ``a`` plus
    noise of sd 1 per score (its predictions gain variance 30/4 · 1: LDS
    ≈ 0.66), so over 60 retrains the gap of ~0.27 sits many bootstrap
    standard errors (~0.05) above 0.
    """
    from gradsketch.demos.protocols.ceiling import paired

    rng = np.random.default_rng(0)
    a = rng.normal(size=(30, 4))
    b = a + rng.normal(size=(30, 4))
    masks = S.halves(30, 60, 1)
    truth = (masks, masks @ a + rng.normal(size=(60, 4)))
    diff, (low, high) = paired(a, b, truth)
    assert diff == pytest.approx(S.lds_row(a, truth)[0] - S.lds_row(b, truth)[0], abs=2e-4)
    assert 0 < low <= diff <= high
