"""benchmarks/bench_replay.py: the quick run measures every method in both settings."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from gradsketch.demos.protocols import replay as br
from helpers.benchmarks import load_benchmark


@pytest.mark.slow
def test_replay_run_is_the_demos_training_loop():
    """The replayed run equals ``train_digits_model`` (same init, order, schedule), float32.

    The two differ only in how torch's SGD fuses its updates: after 23 steps
    of float32 arithmetic the weights agree to a few ulps of their scale.
    """
    import torch

    from gradsketch.demos._digits import TrainSettings, load_digits_split, train_digits_model

    split = load_digits_split(seed=0)
    train = TrainSettings(epochs=1)
    run = br.digits_protocol(br.Sizes(epochs=1)).run(3)
    run.train()
    model = train_digits_model(split.x_train, split.y_train, seed=3, settings=train)
    for name, p in model.named_parameters():
        torch.testing.assert_close(run.final[name], p.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_quick_run_reports_every_method_in_both_settings(capsys):
    sizes = br.Sizes(epochs=1, num_targets=3, lds_models=3, seeds=2, cost_m=(1, 2))
    p = br.digits_protocol(sizes)
    summary = {
        "protocol": "digits",
        **br.run_lds(p, (0.5, 1.0), mean_of=(0.25, 0.5), bases=2, others=True, progress=False),
    }
    summary["cost"] = br.run_cost(p, 0.5)
    assert set(summary["lds"]) == {
        "replay@0.5",
        "replay@0.5-mean2",
        "replay@1",
        "replay@mean(0.25,0.5)",
        "replay@halves-mean2",
        *br.OTHER_METHODS,
    }
    settings = ("same-run", "fresh-seeds")
    for row in summary["lds"].values():
        assert set(row) == {*settings, *(f"{s}_ci95" for s in settings)}
        for setting in settings:
            low, high = row[f"{setting}_ci95"]
            assert np.isfinite([row[setting], low, high]).all() and low <= high
    # Each replay row is compared with the best other method of each setting, paired.
    diffs = summary["lds_diff"]
    assert set(diffs) == set(summary["lds"]) - set(br.OTHER_METHODS)
    for name, by_setting in diffs.items():
        for setting in settings:
            d = by_setting[setting]
            best = max(br.OTHER_METHODS, key=lambda m: summary["lds"][m][setting])
            assert d["minus"] == best
            expected = summary["lds"][name][setting] - summary["lds"][best][setting]
            assert d["diff"] == pytest.approx(expected, abs=2e-4)  # both rounded to 1e-4
    # Every method's cost is timed; a mean over runs costs the sum of its runs.
    assert set(summary["cpu_s"]) == set(summary["lds"])
    assert all(v > 0 for v in summary["cpu_s"].values())
    assert summary["cpu_s"]["replay@0.5-mean2"] > summary["cpu_s"]["replay@0.5"]
    assert set(summary["cost"]["cost"]) == {1, 2}
    assert all(row["train_runs_cpu"] > 0 for row in summary["cost"]["cost"].values())
    table = br.format_table(summary)
    assert "replay@0.5-mean2" in table and "s/query" in table and "CPU s" in table
    assert "minus" in table and "[95 %]" in table
    assert '"part": "lds"' in capsys.readouterr().out


@pytest.mark.bench
def test_bergson_side_by_side_agrees_on_the_same_run():
    """bergson's MAGIC and the replay train the same run (SGD: the same float ops up to
    fusing, a few float32 ulps over 23 steps) and give the same metagradients."""
    pytest.importorskip("bergson.magic.trainer")
    sizes = br.Sizes(epochs=1, num_targets=2, bergson_queries=1)
    with warnings.catch_warnings():
        # torch.distributed.checkpoint's notices about saving without a process group
        # (bergson keeps its checkpoints with it), nothing of ours.
        warnings.simplefilter("ignore")
        record = br.run_bergson(br.digits_protocol(sizes), 1.0)
    assert record["final_params_max_abs_diff"] < 1e-6
    assert min(record["corr"]) > 0.999999 and record["max_rel_diff"] < 1e-4


@pytest.mark.slow
def test_warmup_reaches_both_loops_and_the_ops_part_counts():
    """``--warmup-steps``: the replay's rates are the demo's warmup schedule, and the run
    equals the demo's torch loop on it (float32, a few ulps over the run); ``--part ops``
    counts more operations per reverse step than per training step."""
    import dataclasses

    import torch

    from gradsketch.demos.lm import lr_multiplier

    sizes = dataclasses.replace(br.SIZES["lm"][True], warmup_steps=3)
    p = br.lm_protocol(sizes)
    run = p.run(p.base_seed)
    steps = run.settings.num_steps
    assert run.settings.lr == [1e-3 * lr_multiplier(t, steps, 3) for t in range(steps)]
    assert run.settings.lr[0] == 0.0 < run.settings.lr[1] < run.settings.lr[3]
    run.train()
    for name, value in p.torch_train(p.base_seed).items():
        torch.testing.assert_close(run.final[name], value, rtol=0, atol=1e-5)
    ops = br.run_ops(p, 1.0)
    for m in sizes.cost_m:
        assert ops[f"reverse_ops_per_step_m{m}"] > ops["train_ops_per_step"] > 0
    assert "ops per step" in br.format_table({"protocol": "lm", "ops": ops})


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--protocol", "digits", "--lr", "1e-4"], "--lr: the language-model protocols only"),
        (["--protocol", "lm", "--pretrain-chunks", "64"], "--protocol lm-finetune only"),
        (["--protocol", "lm-finetune", "--pretrain-chunks", "0"], "lm-finetune needs chunks"),
        (["--protocol", "lm", "--cost-m", "1", "64"], "--cost-m 64 exceeds the 16 queries"),
    ],
)
def test_protocol_arguments_are_refused_where_they_do_not_apply(argv, match, capsys):
    with pytest.raises(SystemExit):
        load_benchmark("bench_replay").main(argv)
    assert match in capsys.readouterr().err


@pytest.mark.slow
def test_finetune_protocol_replays_a_finetune_of_the_pretrained_model():
    """``lm-finetune``: every run starts from one pretrained model (a fresh seed changes the
    order only), and the replay equals the demo's torch loop from those weights (float32)."""
    import torch

    from gradsketch.demos.lm import LMDemoSettings, build_lm

    p = br.lm_protocol(br.SIZES["lm-finetune"][True])
    assert p.name == "lm-finetune"
    first, second = p.build(0).state_dict(), p.build(5).state_dict()
    scratch = build_lm(LMDemoSettings(chunk_len=p.sizes.chunk_len), seed=0).state_dict()
    for name, value in first.items():
        assert torch.equal(value, second[name]), name
    assert not torch.equal(first["lm_head.weight"], scratch["lm_head.weight"])
    run = p.run(p.base_seed)
    assert run.settings.lr[0] == pytest.approx(1e-4)
    run.train()
    for name, value in p.torch_train(p.base_seed).items():
        torch.testing.assert_close(run.final[name], value, rtol=0, atol=1e-5)


def test_ridge_datamodel_recovers_an_exactly_linear_datamodel():
    """Outputs exactly linear in the 0/1 masks of halves: the datamodel equals the true
    coefficients up to their common offset (every half holds 6 of the 12 rows, so the
    offset is not identified) and up to the ridge's shrinkage, a factor ``λ/(λ + e)``
    with ``e`` near ``N/4 = 100`` for the ``λ = 0.1`` the held-out fifth picks (0.1 %
    of coefficients of size about 1: within 0.01), and ranks new halves perfectly."""
    rng = np.random.default_rng(0)
    masks = np.stack([br.subset_mask(rng, 12) for _ in range(400)])
    beta = rng.normal(size=(12, 3))
    fitted, lam = br.ridge_datamodel(masks, masks @ beta + 5.0)
    assert lam == 0.1
    np.testing.assert_allclose(fitted - fitted.mean(0), beta - beta.mean(0), atol=0.01)
    new = np.stack([br.subset_mask(rng, 12) for _ in range(50)])
    assert br.lds(fitted, (new, new @ beta)) == 1.0
    with pytest.raises(ValueError, match=r"at least 15 retrains.*--fit-models 20"):
        br.ridge_datamodel(masks[:14], (masks @ beta)[:14])


def test_seed_noise_bound_measures_the_share_of_variance_the_half_explains():
    """Outputs ``f(S) + ε_seed`` with ``Var f = 1`` and ``Var ε = 3``: ``ρ = 1/4``.

    With ``N = 4000`` halves and 8 targets the mean of the 8 sample correlations has
    standard error about ``(1 − ρ²)/√N/√8 = 0.0052``; the test allows 5 of them
    (0.026) for ``ρ`` and the same, times ``d√ρ/dρ = 1`` at ``ρ = 1/4``, for ``√ρ``.
    A predictor equal to ``f`` itself reaches the bound: its correlation with one
    seed's outputs is ``√ρ = 0.5`` within the same tolerance.
    """
    rng = np.random.default_rng(1)
    f = rng.normal(size=(4000, 8))
    first = f + np.sqrt(3.0) * rng.normal(size=f.shape)
    second = f + np.sqrt(3.0) * rng.normal(size=f.shape)
    rho, bound = br.seed_noise_bound(first, second)
    assert rho == pytest.approx(0.25, abs=0.026)
    assert bound == pytest.approx(0.5, abs=0.026)
    reached = np.mean([np.corrcoef(f[:, j], first[:, j])[0, 1] for j in range(8)])
    assert reached == pytest.approx(bound, abs=0.026)


@pytest.mark.slow
def test_ceiling_part_reports_both_settings_and_the_seed_noise():
    sizes = br.Sizes(epochs=1, num_targets=3, lds_models=4)
    summary = br.run_ceiling(br.digits_protocol(sizes), 0.5, fit_models=20, pairs=3)
    for setting in ("same-run", "fresh-seeds"):
        row = summary[setting]
        assert row["ridge"] in br.RIDGES
        for key in ("replay", "datamodel", "replay_held_out", "datamodel_held_out"):
            assert np.isfinite(row[key]) and -1.0 <= row[key] <= 1.0
    assert summary["seed_noise"]["pairs"] == 3
    assert 0.0 <= summary["seed_noise"]["bound"] <= 1.0
    table = br.format_table({"protocol": "digits", "ceiling": summary})
    assert "datamodel of 20 retrains" in table and "two seeds of one half" in table
