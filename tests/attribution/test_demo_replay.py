"""The digits demo's replay: TRAKer(method="replay") on train_model's own run, the CLI flag."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from gradsketch.attribution import ReplayAttributor
from gradsketch.cli import app
from gradsketch.demos._attribution import DemoSettings, attribute_digits, format_report, run_demo
from gradsketch.demos._digits import (
    TrainSettings,
    build_model,
    load_digits_split,
    replay_settings,
    train_digits_model,
)


@pytest.mark.slow
def test_demo_replay_replays_train_model_and_scores_through_the_trak_loop(tmp_path):
    """One epoch (23 steps), 3 targets: the replayed run is train_digits_model's.

    The demo linearizes at ``replay_linearize_at`` (0.25): its scores are the
    replay's at that point, and the same replay at 1 trains the ordinary run.

    Tolerance of the weights: the same steps, rows and rates, computed by
    torch.optim.SGD on the model's backward against the replay's functional
    step on torch.func.grad; both in float32 on one thread, differing only in
    operation order: per step ~ lr · 4 ε₃₂ · |g| (≤ 0.05 · 5e-7 · 1) plus
    ε₃₂ |θ|, over 23 steps < 1e-5 on weights of size ≤ 0.3.
    """
    split = load_digits_split(seed=0)
    settings = DemoSettings(num_targets=3, train=TrainSettings(epochs=1), seed=0)
    init = build_model(settings.arch, seed=0).state_dict()
    scores, timings = attribute_digits(
        [init],
        split,
        settings,
        save_dir=tmp_path / "r",
        lambda_reg=0.0,
        method="replay",
        progress=False,
    )
    assert scores.shape == (split.n_train, 3) and set(timings) >= {"featurize", "score"}
    assert settings.replay_linearize_at == 0.25
    run = replay_settings(split.n_train, settings.train, seed=0)
    references = {}
    for at in (0.25, 1.0):
        references[at] = ReplayAttributor(
            build_model(settings.arch, seed=0),
            "image_classification",
            (split.x_train, split.y_train),
            dataclasses.replace(run, linearize_at=at),
            progress=False,
        )
        references[at].train()
    np.testing.assert_array_equal(
        scores, references[0.25].score((split.x_test[:3], split.y_test[:3])).double().numpy()
    )
    trained = train_digits_model(split.x_train, split.y_train, seed=0, settings=settings.train)
    for name, p in trained.named_parameters():
        torch.testing.assert_close(references[1.0].final[name], p.detach(), rtol=0, atol=1e-5)


def test_replay_settings_follow_train_model():
    s = replay_settings(1438, TrainSettings(epochs=2, lr=0.1, momentum=0.5), seed=4)
    assert (s.optimizer, s.num_steps, s.momentum, s.weight_decay, s.seed) == (
        "sgd",
        46,
        0.5,
        TrainSettings().weight_decay,
        4,
    )
    assert s.lr[0] == 0.1 and s.lr[23] == pytest.approx(0.05) and s.lr[-1] > 0


def test_report_names_the_replay_and_its_gallery():
    summary = {
        "n_train": 10,
        "n_targets": 2,
        "lds": {"ekfac": 0.5, "replay": 0.4},
        "checkpoint_test_accuracy": [0.9],
        "timings_s": {"total": 1.0},
        "settings": {"num_checkpoints": 1, "proj_dim": 8, "lds_models": 3},
        "files": {"gallery": "g.png", "gallery_replay": "r.png", "summary": "s.json"},
    }
    report = format_report(summary)
    assert "LDS (replay metagradients through checkpoint 0's run, its targets): 0.400" in report
    assert "replay gallery: r.png" in report
    assert "minus EK-FAC" not in report and "[" not in report  # no intervals measured
    summary["lds"]["ekfac_replay_targets"] = 0.3
    summary["lds_ci95"] = {"replay": [0.2, 0.6], "replay_minus_ekfac": [-0.05, 0.25]}
    report = format_report(summary)
    assert "its targets): 0.400 [0.20, 0.60]" in report
    assert "replay minus EK-FAC on the replay's targets: +0.100 [-0.05, 0.25]" in report


@pytest.mark.slow
def test_demo_with_the_replay_reports_its_paired_difference_to_ekfac(tmp_path):
    """The demo's summary gives the replay's LDS and its lead over EK-FAC with intervals."""
    summary = run_demo(
        tmp_path,
        num_checkpoints=1,
        num_targets=6,
        lds_models=5,
        proj_dim=32,
        train=TrainSettings(epochs=1),
        report_auto=False,
        report_replay=True,
        replay_targets=3,
        progress=False,
    )
    ci = summary["lds_ci95"]
    assert set(ci) == {"0.0", "ekfac", "replay", "ekfac_replay_targets", "replay_minus_ekfac"}
    assert all(low <= high for low, high in ci.values())
    assert "replay minus EK-FAC on the replay's targets" in summary["report"]


def test_cli_demo_has_the_replay_flag_and_refuses_it_with_lm(tmp_path):
    result = CliRunner().invoke(app, ["demo", "--help"])
    assert result.exit_code == 0 and "--replay" in result.output
    result = CliRunner().invoke(app, ["demo", "--lm", "--replay", "--out", str(tmp_path / "o")])
    text = re.sub(r"[│╭╮╰╯─\s]+", " ", result.output)  # rich's box, unwrapped
    assert result.exit_code == 2 and "the --lm job has no replay" in text


@pytest.mark.parametrize(
    ("flags", "expected"), [([], True), (["--replay"], True), (["--no-replay"], False)]
)
def test_cli_demo_runs_the_replay_unless_told_not_to(tmp_path, monkeypatch, flags, expected):
    """``make demo`` (no flag) includes the replay; ``--no-replay`` leaves it out."""
    import gradsketch.demos as demo_module

    seen = {}

    def fake_run_demo(out, **kwargs):
        seen.update(kwargs)
        return {"report": "ok"}

    monkeypatch.setattr(demo_module, "run_demo", fake_run_demo)
    args = ["demo", *flags, "--no-verbose", "--out", str(tmp_path / "o")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert seen == {"quick": False, "report_replay": expected}
