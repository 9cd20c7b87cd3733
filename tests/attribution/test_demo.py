"""Digits data, models and trainer; the demo pipeline at a tiny size."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch import nn

import gradsketch.attribution as attribution
from gradsketch.demos import (
    ARCHITECTURES,
    DemoSettings,
    DemoSettingsError,
    DigitsSettingsError,
    TrainSettings,
    accuracy,
    build_cnn,
    build_mlp,
    build_model,
    digits_lds_ground_truth,
    format_report,
    gallery_rows,
    load_digits_split,
    make_loader,
    margins,
    run_demo,
    to_numpy,
    train_digits_model,
    train_model,
    write_gallery,
)

TINY_TRAIN = TrainSettings(epochs=2, batch_size=64)


@pytest.fixture(scope="module")
def split():
    return load_digits_split(seed=0)


# -- data ------------------------------------------------------------------


def test_split_sizes_disjoint_and_deterministic(split):
    assert split.n_train + split.n_test == 1797
    assert split.n_test == round(1797 * 0.2)
    again = load_digits_split(seed=0)
    assert torch.equal(split.x_train, again.x_train)
    assert torch.equal(split.y_test, again.y_test)
    other = load_digits_split(seed=1)
    assert not torch.equal(split.y_train, other.y_train)
    # Disjoint: raw training and test images never coincide as (image, index)
    # sets, checked through the label histogram summing to the full data set.
    from sklearn.datasets import load_digits

    counts = np.bincount(load_digits().target, minlength=10)
    got = np.bincount(split.y_train.numpy(), minlength=10) + np.bincount(
        split.y_test.numpy(), minlength=10
    )
    np.testing.assert_array_equal(got, counts)


def test_split_standardised_with_training_statistics(split):
    x = split.images_train.reshape(split.n_train, 64).astype(np.float64)
    mean, std = x.mean(0), x.std(0)
    varying = std > 1e-6
    ref = (x - mean) / np.where(varying, std, 1.0)
    np.testing.assert_allclose(split.x_train.double().numpy(), ref, rtol=1e-6, atol=1e-6)
    xt = split.images_test.reshape(split.n_test, 64).astype(np.float64)
    ref_t = (xt - mean) / np.where(varying, std, 1.0)
    np.testing.assert_allclose(split.x_test.double().numpy(), ref_t, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.1, "0.2"], ids=["zero", "one", "negative", "str"])
def test_split_rejects_bad_fraction(bad):
    with pytest.raises(DigitsSettingsError, match=r"`test_fraction` must be .* got"):
        load_digits_split(test_fraction=bad)


# -- models ----------------------------------------------------------------


def test_mlp_has_85002_parameters_and_shapes():
    model = build_mlp(seed=0)
    assert sum(p.numel() for p in model.parameters()) == 85_002
    assert model(torch.zeros(3, 64)).shape == (3, 10)


def test_cnn_accepts_flat_inputs():
    model = build_cnn(seed=0)
    out = model(torch.randn(4, 64))
    assert out.shape == (4, 10)
    # Its first layer only reshapes: the same images in 1x8x8 form agree.
    x = torch.randn(2, 64)
    rest = nn.Sequential(*list(model)[1:])
    torch.testing.assert_close(model(x), rest(x.reshape(2, 1, 8, 8)))


def test_build_model_is_seeded_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a, b = build_model("mlp", seed=7), build_model("mlp", seed=7)
    assert torch.equal(torch.random.get_rng_state(), before)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    c = build_model("mlp", seed=8)
    assert not torch.equal(next(a.parameters()), next(c.parameters()))


def test_build_model_unknown_arch_lists_registry():
    allowed = ", ".join(repr(a) for a in sorted(ARCHITECTURES))
    with pytest.raises(DigitsSettingsError, match=rf"`arch` must be one of {allowed}, got 'vit'"):
        build_model("vit")


@pytest.mark.parametrize(
    ("builder", "kwargs", "match"),
    [
        (build_mlp, {"hidden": 0}, r"`hidden` must be a positive integer, got 0"),
        (build_cnn, {"channels": 2.5}, r"`channels` must be a positive integer, got 2.5"),
        (build_mlp, {"seed": "0"}, r"`seed` must be an int, got '0'"),
    ],
    ids=["hidden", "channels", "seed"],
)
def test_builders_validate(builder, kwargs, match):
    with pytest.raises(DigitsSettingsError, match=match):
        builder(**kwargs)


# -- training --------------------------------------------------------------


def test_training_is_deterministic_and_thread_independent(split):
    x, y = split.x_train[:300], split.y_train[:300]
    threads = torch.get_num_threads()
    a = train_digits_model(x, y, seed=3, settings=TINY_TRAIN)
    torch.set_num_threads(1)
    try:
        b = train_digits_model(x, y, seed=3, settings=TINY_TRAIN)
    finally:
        torch.set_num_threads(threads)
    assert torch.get_num_threads() == threads
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    c = train_digits_model(x, y, seed=4, settings=TINY_TRAIN)
    assert not torch.equal(next(a.parameters()), next(c.parameters()))
    assert not a.training


def test_default_training_reaches_high_accuracy(split):
    model = train_digits_model(split.x_train, split.y_train, seed=0)
    # Digits MLPs reach ~97-99% test accuracy; 0.95 leaves room for seeds.
    assert accuracy(model, split.x_test, split.y_test) > 0.95


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"epochs": 0}, r"`epochs` must be a positive integer, got 0"),
        ({"batch_size": -1}, r"`batch_size` must be a positive integer, got -1"),
        ({"lr": 0.0}, r"`lr` must be a finite number > 0, got 0.0"),
        ({"lr": math.nan}, r"`lr` must be a finite number > 0, got nan"),
        ({"weight_decay": -1e-3}, r"`weight_decay` must be a finite number >= 0, got -0.001"),
        ({"momentum": 1.0}, r"`momentum` must be in \[0, 1\), got 1.0"),
    ],
    ids=["epochs", "batch", "lr-zero", "lr-nan", "wd", "momentum"],
)
def test_train_settings_validate(kwargs, match):
    with pytest.raises(DigitsSettingsError, match=match):
        TrainSettings(**kwargs)


def test_train_model_rejects_mismatched_rows():
    with pytest.raises(DigitsSettingsError, match=r"`x` and `y` must hold the same"):
        train_model(build_mlp(), torch.zeros(4, 64), torch.zeros(3, dtype=torch.long))


def test_margins_match_float64_log_odds():
    model = build_mlp(seed=1)
    x = torch.randn(16, 64)
    y = torch.randint(0, 10, (16,), generator=torch.Generator().manual_seed(0))
    p = torch.softmax(model.double()(x.double()), dim=1).gather(1, y[:, None]).squeeze(1)
    ref = torch.log(p / (1 - p))
    got = margins(model.float(), x, y)
    torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=1e-4)


def test_make_loader_keeps_row_order():
    x = torch.arange(10.0)[:, None].expand(10, 64)
    y = torch.arange(10)
    rows = torch.cat([b[1] for b in make_loader(x, y, batch_size=3)])
    assert torch.equal(rows, y)


# -- demo pieces -------------------------------------------------------------


def test_lds_ground_truth_masks_are_halves_and_outputs_are_margins(split):
    settings = DemoSettings(lds_models=3, train=TINY_TRAIN, num_targets=5)
    x_t, y_t = split.x_test[:5], split.y_test[:5]
    masks, outputs = digits_lds_ground_truth(split, x_t, y_t, settings, progress=False)
    assert masks.shape == (3, split.n_train)
    np.testing.assert_array_equal(masks.sum(1), split.n_train // 2)
    assert len({m.tobytes() for m in masks}) == 3
    # Identity: model j is exactly train_digits_model on subset j, seed 10_001 + j.
    idx = torch.from_numpy(np.flatnonzero(masks[1]))
    model = train_digits_model(
        split.x_train[idx], split.y_train[idx], seed=10_002, settings=TINY_TRAIN
    )
    np.testing.assert_allclose(outputs[1], margins(model, x_t, y_t).double().numpy())


def test_gallery_rows_pick_distinct_classes_first():
    labels = torch.tensor([3, 3, 1, 4, 1, 5, 9, 2, 6])
    assert gallery_rows(labels, 6) == [0, 2, 3, 5, 6, 7]
    assert gallery_rows(torch.tensor([1, 1, 1]), 6) == [0, 1, 2]


def test_write_gallery_writes_png(tmp_path, split):
    scores = np.random.default_rng(0).standard_normal((split.n_train, 4))
    path = write_gallery(tmp_path / "g.png", scores, split, [0, 1, 2], top=3)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_to_numpy_accepts_tensor_memmap_and_array(tmp_path):
    ref = np.arange(6.0).reshape(3, 2)
    mm = np.lib.format.open_memmap(tmp_path / "m.npy", mode="w+", dtype=np.float32, shape=(3, 2))
    mm[:] = ref
    for value in (torch.from_numpy(ref), mm, ref.tolist()):
        got = to_numpy(value)
        assert got.dtype == np.float64
        np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_checkpoints": 0}, r"`num_checkpoints` must be a positive integer, got 0"),
        ({"lds_models": 2}, r"`lds_models` must be an integer >= 3, got 2"),
        ({"proj_dim": 1.5}, r"`proj_dim` must be a positive integer, got 1.5"),
        ({"arch": "rnn"}, r"`arch` must be one of 'cnn', 'mlp', got 'rnn'"),
        ({"lambda_reg": -1.0}, r"`lambda_reg` must be a finite number >= 0 or 'auto', got -1.0"),
        ({"lambda_reg": "big"}, r"`lambda_reg` must be .* got 'big'"),
        ({"seed": 1.0}, r"`seed` must be an int, got 1.0"),
    ],
    ids=["ckpts", "lds", "proj", "arch", "lam-neg", "lam-str", "seed"],
)
def test_demo_settings_validate(kwargs, match):
    with pytest.raises(DemoSettingsError, match=match):
        DemoSettings(**kwargs)


def test_format_report_lists_every_lds():
    summary = {
        "n_train": 10,
        "n_targets": 2,
        "lds": {"0.0": 0.25, "auto": 0.5},
        "checkpoint_test_accuracy": [0.9, 0.8],
        "timings_s": {"total": 2.0, "featurize": 0.5},
        "settings": {"num_checkpoints": 2, "proj_dim": 8, "lds_models": 3},
    }
    text = format_report(summary)
    assert "LDS (lambda_reg=0.0): 0.250" in text
    assert "LDS (lambda_reg=auto): 0.500" in text
    assert "test accuracy 0.850 (min 0.800)" in text
    assert "featurize 0.5 s" in text


# -- the pipeline at a tiny size -------------------------------------------

TINY = {
    "num_checkpoints": 2,
    "num_targets": 12,
    "lds_models": 4,
    "proj_dim": 32,
    "train": TINY_TRAIN,
    "progress": False,
}


@pytest.fixture(scope="module")
def tiny_demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    return out, run_demo(out, **TINY)


def test_tiny_demo_writes_outputs(tiny_demo):
    out, summary = tiny_demo
    assert (out / "gallery.png").read_bytes()[:4] == b"\x89PNG"
    stored = json.loads((out / "summary.json").read_text())
    assert stored["settings"]["proj_dim"] == 32
    assert stored["settings"]["train"]["epochs"] == 2
    assert set(stored["lds"]) == {"0.0", "auto", "ekfac"}
    # The gallery shows the method the LDS validates best, with its label share.
    assert stored["lds"][stored["gallery_lambda_reg"]] == max(stored["lds"].values())
    assert set(stored["top5_same_label"]) == set(stored["lds"])
    assert all(0.0 <= v <= 1.0 for v in stored["top5_same_label"].values())
    ekfac = np.load(out / "scores_ekfac.npy")
    assert ekfac.shape == (summary["n_train"], 12) and np.isfinite(ekfac).all()
    for value in stored["lds"].values():
        assert -1.0 <= value <= 1.0
    # Each LDS has its bootstrap interval over the retrains.
    assert set(stored["lds_ci95"]) == set(stored["lds"])
    assert all(-1.0 <= low <= high <= 1.0 for low, high in stored["lds_ci95"].values())
    assert "bootstrap 95 % intervals" in summary["report"]
    for phase in ("featurize", "finalize_features", "score", "lds_retrain", "total"):
        assert stored["timings_s"][phase] >= 0
    assert len(stored["checkpoint_test_accuracy"]) == 2
    scores = np.load(out / "scores.npy")
    assert scores.shape == (summary["n_train"], 12)
    assert np.isfinite(scores).all()
    assert "LDS (lambda_reg=0.0)" in summary["report"]
    assert "LDS (EK-FAC influence)" in summary["report"]


@pytest.mark.parametrize(
    ("lambda_reg", "file"), [(0.0, "scores.npy"), ("auto", "scores_auto.npy")], ids=["0", "auto"]
)
def test_tiny_demo_scores_equal_direct_traker_run(tiny_demo, tmp_path, split, lambda_reg, file):
    """The demo adds nothing to the scores: a fresh hand-written TRAKer loop agrees.

    For "auto" this also checks that reusing the store of the lambda=0 run
    (the demo does) gives the scores of a store built for "auto" alone.
    """
    out, _ = tiny_demo
    settings = DemoSettings(**{k: v for k, v in TINY.items() if k != "progress"})
    ckpts = [
        train_digits_model(split.x_train, split.y_train, seed=i, settings=TINY_TRAIN).state_dict()
        for i in range(2)
    ]
    traker = attribution.TRAKer(
        model=build_mlp(seed=0),
        task="image_classification",
        train_set_size=split.n_train,
        save_dir=str(tmp_path / "store"),
        device="cpu",
        proj_dim=32,
        use_half_precision=False,
        lambda_reg=lambda_reg,
        progress=False,
    )
    for i, ckpt in enumerate(ckpts):
        traker.load_checkpoint(ckpt, model_id=i)
        traker.featurize(batch=(split.x_train, split.y_train), num_samples=split.n_train)
    traker.finalize_features()
    for i, ckpt in enumerate(ckpts):
        traker.start_scoring_checkpoint(
            exp_name="direct", checkpoint=ckpt, model_id=i, num_targets=settings.num_targets
        )
        traker.score(batch=(split.x_test[:12], split.y_test[:12]), num_samples=12)
    direct = to_numpy(traker.finalize_scores(exp_name="direct"))
    np.testing.assert_allclose(np.load(out / file), direct, rtol=1e-4, atol=1e-6)


def test_demo_refuses_out_dir_with_other_settings(tiny_demo):
    out, _ = tiny_demo
    with pytest.raises(DemoSettingsError, match=r"holds a demo run with other settings") as info:
        run_demo(out, **{**TINY, "proj_dim": 16})
    assert '"proj_dim": 32' in str(info.value)
    assert '"proj_dim": 16' in str(info.value)


@pytest.mark.slow
def test_quick_demo_uses_quick_sizes(tmp_path):
    summary = run_demo(tmp_path, quick=True, proj_dim=16, report_auto=False, progress=False)
    settings = summary["settings"]
    assert {k: settings[k] for k in ("num_checkpoints", "num_targets", "lds_models")} == {
        "num_checkpoints": 2,
        "num_targets": 20,
        "lds_models": 5,
    }
    assert settings["train"]["epochs"] == 5
    # EK-FAC is reported by default; report_auto=False leaves out the "auto" TRAK run.
    assert set(summary["lds"]) == {"0.0", "ekfac"}
    assert not (tmp_path / "scores_auto.npy").exists()


def test_demo_rejects_too_many_targets(tmp_path):
    with pytest.raises(DemoSettingsError, match=r"`num_targets`=400 exceeds the 359 test digits"):
        run_demo(tmp_path, **{**TINY, "num_targets": 400})
