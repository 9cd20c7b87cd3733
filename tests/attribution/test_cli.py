"""`gradsketch attribute CONFIG.py`: config loading, validation and a tiny run."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

import gradsketch.attribution as attribution
from gradsketch.cli import (
    MODEL_NAMES,
    REQUIRED_NAMES,
    AttributeSettings,
    ConfigError,
    attribute_command,
    batch_size,
    load_config,
    read_config,
)
from gradsketch.demos import build_mlp, load_digits_split, make_loader, to_numpy

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

TINY_CONFIG = """
import torch
from gradsketch.demos import (
    TrainSettings, build_mlp, load_digits_split, make_loader, train_model,
)

_split = load_digits_split(seed=0)
_x, _y = _split.x_train[:40], _split.y_train[:40]
_fast = TrainSettings(epochs=2, batch_size=16)

def build_model():
    return build_mlp(hidden=16, seed=0)

_m0 = train_model(build_model(), _x, _y, seed=0, settings=_fast)
torch.save(build_mlp(hidden=16, seed=1).state_dict(), {ckpt_path!r})
checkpoints = [_m0.state_dict(), {ckpt_path!r}]
train_loader = make_loader(_x, _y, batch_size=16)
target_loader = make_loader(_split.x_test[:6], _split.y_test[:6], batch_size=4)
task = "image_classification"
proj_dim = 16
lambda_reg = {lambda_reg!r}
"""


def write_config(tmp_path: Path, body: str, name: str = "config.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


@pytest.fixture
def tiny_config(tmp_path):
    def make(lambda_reg=0.0):
        return write_config(
            tmp_path,
            TINY_CONFIG.format(ckpt_path=str(tmp_path / "ckpt1.pt"), lambda_reg=lambda_reg),
        )

    return make


# -- validation --------------------------------------------------------------


def minimal(**overrides):
    x, y = torch.zeros(4, 64), torch.zeros(4, dtype=torch.long)
    names = {
        "model": build_mlp(hidden=4),
        "checkpoints": [build_mlp(hidden=4).state_dict()],
        "train_loader": make_loader(x, y, batch_size=2),
        "target_loader": make_loader(x[:2], y[:2], batch_size=2),
        "task": "image_classification",
    }
    names.update(overrides)
    return {k: v for k, v in names.items() if v is not ...}


def test_read_config_resolves_defaults():
    config = read_config(minimal())
    assert config["settings"] == AttributeSettings(
        proj_dim=2048, lambda_reg=0.0, train_set_size=4, num_targets=2
    )
    assert len(config["checkpoints"]) == 1


def test_read_config_calls_build_model():
    config = read_config(minimal(model=..., build_model=lambda: build_mlp(hidden=3)))
    assert config["model"][0].out_features == 3


@pytest.mark.parametrize("missing", REQUIRED_NAMES)
def test_missing_required_name_is_named(missing):
    required = ", ".join(f"`{n}`" for n in REQUIRED_NAMES)
    with pytest.raises(ConfigError, match=rf"does not define `{missing}`; required: {required}"):
        read_config(minimal(**{missing: ...}))


def test_missing_model_lists_both_spellings():
    with pytest.raises(ConfigError, match=r"does not define `model` or `build_model`"):
        read_config(minimal(model=...))
    assert MODEL_NAMES == ("model", "build_model")


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"model": "resnet"}, r"`model` must be a torch.nn.Module, got str"),
        ({"checkpoints": "ckpt.pt"}, r"`checkpoints` must be a non-empty list .* got str"),
        ({"checkpoints": []}, r"`checkpoints` must be a non-empty list .* got list"),
        (
            {"checkpoints": ["/no/such/ckpt.pt"]},
            r"`checkpoints\[0\]` is the path '/no/such/ckpt.pt'",
        ),
        (
            {"checkpoints": [3]},
            r"`checkpoints\[0\]` must be a state dict or a path to one, got int",
        ),
        ({"train_loader": 5}, r"`train_loader` must be an iterable of batches .* got int"),
        (
            {"target_loader": iter([])},
            r"`target_loader` has no sized `dataset`.*`num_targets = \.\.\.`",
        ),
        ({"proj_dim": 0}, r"`proj_dim` must be a positive integer, got 0"),
        ({"lambda_reg": -0.5}, r"`lambda_reg` must be a finite number >= 0 or 'auto', got -0.5"),
        ({"lambda_reg": "ridge"}, r"`lambda_reg` must be .* got 'ridge'"),
        ({"projector_seed": 1.5}, r"`projector_seed` must be an int, got 1.5"),
        (
            {"memory_budget": 0},
            r"`memory_budget` must be a positive integer or None, got 0; set a number of bytes",
        ),
        ({"memory_budget": 1.5e9}, r"`memory_budget` must be .* got 1500000000.0"),
        ({"gradients": "autograd"}, r"`gradients` must be one of .*'vmap'\], got 'autograd'"),
        ({"method": "lissa"}, r"`method` must be one of \['ekfac', .*\], got 'lissa'"),
        ({"curvature": "hessian"}, r"`curvature` must be one of \['loss', .*got 'hessian'"),
    ],
    ids=[
        "model-type",
        "ckpt-str",
        "ckpt-empty",
        "ckpt-path",
        "ckpt-type",
        "loader",
        "unsized",
        "proj",
        "lambda-neg",
        "lambda-str",
        "seed",
        "budget-zero",
        "budget-float",
        "gradients",
        "method",
        "curvature",
    ],
)
def test_invalid_config_values(overrides, match):
    with pytest.raises(ConfigError, match=match):
        read_config(minimal(**overrides))


def test_load_config_rejects_missing_and_non_python(tmp_path):
    with pytest.raises(ConfigError, match=r"`config_path` must be an existing .py file, got"):
        load_config(tmp_path / "absent.py")
    other = tmp_path / "config.yaml"
    other.write_text("proj_dim: 3\n")
    with pytest.raises(ConfigError, match=r"`config_path` must be an existing .py file"):
        load_config(other)


def test_load_config_executes_file(tmp_path):
    module = load_config(write_config(tmp_path, "proj_dim = 7\n"))
    assert module.proj_dim == 7


@pytest.mark.parametrize(
    ("batch", "rows"),
    [
        (torch.zeros(5, 2), 5),
        ((torch.zeros(3, 2), torch.zeros(3)), 3),
        ([torch.zeros(2, 1)], 2),
        ({"input_ids": torch.zeros(4, 7), "labels": torch.zeros(4)}, 4),
    ],
    ids=["tensor", "tuple", "list", "dict"],
)
def test_batch_size(batch, rows):
    assert batch_size(batch) == rows


def test_batch_size_rejects_non_tensor():
    with pytest.raises(ConfigError, match=r"batches must be tensors.*first entry is str"):
        batch_size(("a", "b"))


# -- running -----------------------------------------------------------------


def test_attribute_command_matches_direct_traker(tiny_config, tmp_path):
    """The command is the TRAKer loop: same scores as calling TRAKer by hand."""
    out = tmp_path / "out"
    summary = attribute_command(tiny_config(), out, progress=False)
    scores = np.load(out / "scores.npy")
    assert scores.shape == (40, 6) == tuple(summary["scores_shape"])
    assert np.isfinite(scores).all()
    stored = json.loads((out / "summary.json").read_text())
    assert stored["settings"]["proj_dim"] == 16
    assert stored["num_checkpoints"] == 2
    assert set(stored["top_proponents"]) == {str(t) for t in range(6)}
    for t, top in stored["top_proponents"].items():
        assert top == np.argsort(-scores[:, int(t)], kind="stable")[:5].tolist()

    config = read_config(load_config(tmp_path / "config.py"))
    direct = direct_scores(config, tmp_path / "direct", proj_dim=16)
    np.testing.assert_allclose(scores, direct, rtol=1e-5, atol=1e-7)


def direct_scores(config, save_dir, **options):
    """The TINY_CONFIG pipeline written out with TRAKer by hand."""
    traker = attribution.TRAKer(
        model=config["model"],
        task="image_classification",
        train_set_size=40,
        save_dir=str(save_dir),
        device="cpu",
        use_half_precision=False,
        progress=False,
        **options,
    )
    split = load_digits_split(seed=0)
    for i, ckpt in enumerate(config["checkpoints"]):
        traker.load_checkpoint(ckpt, model_id=i)
        traker.featurize(batch=(split.x_train[:40], split.y_train[:40]), num_samples=40)
    traker.finalize_features()
    for i, ckpt in enumerate(config["checkpoints"]):
        traker.start_scoring_checkpoint("t", ckpt, model_id=i, num_targets=6)
        traker.score(batch=(split.x_test[:6], split.y_test[:6]), num_samples=6)
    return to_numpy(traker.finalize_scores("t"))


def test_attribute_command_with_hooks_matches_vmap_on_the_same_projector(tiny_config, tmp_path):
    """`gradients = "hooks"` runs the hook path (the default CountSketchProjector) and records
    it; its scores are those of the vmap path given the same projector (same map)."""
    path = tiny_config()
    path.write_text(path.read_text() + '\ngradients = "hooks"\n')
    summary = attribute_command(path, tmp_path / "hooks", progress=False)
    assert summary["settings"]["gradients"] == "hooks"
    hooks = np.load(tmp_path / "hooks" / "scores.npy")
    config = read_config(load_config(path))
    vmap = direct_scores(config, tmp_path / "vmap", proj_dim=16)
    np.testing.assert_allclose(hooks, vmap, rtol=1e-4, atol=1e-5 * np.abs(vmap).max())


def test_attribute_command_runs_every_method(tiny_config, tmp_path):
    """`method = "ekfac"` in a config runs TRAKer(method="ekfac") on the same pipeline."""
    path = tiny_config("auto")
    path.write_text(path.read_text() + '\nmethod = "ekfac"\n')
    summary = attribute_command(path, tmp_path / "ekfac", progress=False)
    assert summary["settings"]["method"] == "ekfac"
    got = np.load(tmp_path / "ekfac" / "scores.npy")
    config = read_config(load_config(path))
    want = direct_scores(config, tmp_path / "direct", method="ekfac", lambda_reg="auto")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


def test_attribute_command_rerun_is_identical(tiny_config, tmp_path):
    path = tiny_config()
    attribute_command(path, tmp_path / "out", progress=False)
    first = np.load(tmp_path / "out" / "scores.npy")
    attribute_command(path, tmp_path / "out", progress=False)
    np.testing.assert_array_equal(np.load(tmp_path / "out" / "scores.npy"), first)


def test_attribute_command_auto_lambda(tiny_config, tmp_path):
    summary = attribute_command(tiny_config("auto"), tmp_path / "out", progress=False)
    assert summary["settings"]["lambda_reg"] == "auto"
    assert np.isfinite(np.load(tmp_path / "out" / "scores.npy")).all()


def test_attribute_command_checks_row_counts(tmp_path):
    body = TINY_CONFIG.format(ckpt_path=str(tmp_path / "c.pt"), lambda_reg=0.0)
    body += "\ntrain_set_size = 40\nnum_targets = 5\n"
    with pytest.raises(
        ConfigError, match=r"`target_loader` yielded more than 5 rows but `num_targets` is 5"
    ):
        attribute_command(write_config(tmp_path, body), tmp_path / "out", progress=False)
    body = body.replace("num_targets = 5", "num_targets = 7")
    with pytest.raises(ConfigError, match=r"`target_loader` yielded 6 rows but `num_targets` is 7"):
        attribute_command(write_config(tmp_path, body), tmp_path / "out2", progress=False)


def test_example_config_runs(tmp_path):
    summary = attribute_command(EXAMPLES / "attribute_config.py", tmp_path, progress=False)
    assert summary["scores_shape"] == [600, 50]
    assert "scored 50 targets" in summary["report"]


def test_attribute_command_keeps_scores_over_budget_on_disk(tmp_path):
    """A score matrix above `memory_budget` stays in the store's zarr array, never loaded.

    proj_dim 4 makes the smallest valid budget (about 450 bytes for the
    inverse and one row) smaller than the 40 x 6 float32 scores (960 bytes).
    """
    base = TINY_CONFIG.format(ckpt_path=str(tmp_path / "c.pt"), lambda_reg=0.0)
    base = base.replace("proj_dim = 16", "proj_dim = 4")
    in_memory = attribute_command(
        write_config(tmp_path, base, "mem.py"), tmp_path / "mem", progress=False
    )
    assert not in_memory["scores_on_disk"]
    out = tmp_path / "disk"
    (out).mkdir()
    np.save(out / "scores.npy", np.zeros(1))  # a stale file from an earlier run
    summary = attribute_command(
        write_config(tmp_path, base + "\nmemory_budget = 600\n", "disk.py"), out, progress=False
    )
    where = out / "trak_store" / "scores" / "targets"
    assert summary["scores_on_disk"] and summary["settings"]["memory_budget"] == 600
    assert summary["files"]["scores"] == str(where)
    assert f"zarr array {where}" in summary["report"]
    assert not (out / "scores.npy").exists()
    on_disk = zarr.open_array(str(where), mode="r")[:]
    # Same scores up to the tiling of the GEMMs (float32 sums in another order).
    ref = np.load(tmp_path / "mem" / "scores.npy")
    np.testing.assert_allclose(on_disk, ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())
    assert summary["top_proponents"]["0"] == np.argsort(-on_disk[:, 0], kind="stable")[:5].tolist()


# -- method = "replay" ----------------------------------------------------------

REPLAY_CONFIG = """
from gradsketch.demos import build_mlp, load_digits_split, make_loader

_split = load_digits_split(seed=0)
model = build_mlp(hidden=16, seed=0)
train_loader = make_loader(_split.x_train[:40], _split.y_train[:40], batch_size=16)
target_loader = make_loader(_split.x_test[:6], _split.y_test[:6], batch_size=4)
task = "image_classification"
method = "replay"
replay = dict(optimizer="sgd", lr=0.1, momentum=0.9, num_steps=6, batch_size=8, seed=3)
"""


def test_attribute_command_replays_the_run(tmp_path):
    """`method = "replay"`: the command trains the run from the model's weights on every
    training row and scores by its metagradients, as ReplayAttributor does by hand; a rerun
    reads the finished store back."""
    path = write_config(tmp_path, REPLAY_CONFIG)
    summary = attribute_command(path, tmp_path / "out", progress=False)
    scores = np.load(tmp_path / "out" / "scores.npy")
    assert scores.shape == (40, 6) == tuple(summary["scores_shape"])
    settings = summary["settings"]
    assert settings["method"] == "replay" and settings["replay"]["num_steps"] == 6
    assert not {"proj_dim", "lambda_reg", "gradients"} & set(settings)
    assert "by replaying one run (6 sgd steps)" in summary["report"]

    split = load_digits_split(seed=0)
    direct = attribution.ReplayAttributor(
        build_mlp(hidden=16, seed=0),
        "image_classification",
        (split.x_train[:40], split.y_train[:40]),
        attribution.ReplaySettings(
            optimizer="sgd", lr=0.1, momentum=0.9, num_steps=6, batch_size=8, seed=3
        ),
        progress=False,
    )
    direct.train()
    want = direct.score((split.x_test[:6], split.y_test[:6])).numpy().astype(np.float32)
    np.testing.assert_allclose(scores, want, rtol=1e-6, atol=1e-7 * np.abs(want).max())
    attribute_command(path, tmp_path / "out", progress=False)
    np.testing.assert_array_equal(np.load(tmp_path / "out" / "scores.npy"), scores)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"method": "replay"}, r'`method = "replay"` needs `replay`, the run to train'),
        (
            {"method": "replay", "replay": {"optimizer": "sgd"}, "proj_dim": 64},
            r'`method = "replay"` does not use `proj_dim` \(`proj_dim`: the metagradient is '
            r"exact, nothing is projected\)",
        ),
        (
            {
                "method": "replay",
                "replay": {"optimizer": "sgd"},
                "checkpoints": [build_mlp(hidden=4).state_dict()] * 2,
            },
            r"trains one run, from one state, but `checkpoints` holds 2",
        ),
        (
            {"method": "replay", "replay": {"optimizer": "lbfgs"}},
            r"`replay` is not valid ReplaySettings: `optimizer`='lbfgs' cannot be replayed",
        ),
        ({"replay": {"optimizer": "sgd"}}, r"`replay` is the run of `method = \"replay\"`"),
    ],
    ids=["no-replay", "proj-dim", "two-checkpoints", "bad-settings", "not-replay-method"],
)
def test_replay_config_errors_name_the_fix(overrides, match):
    with pytest.raises(ConfigError, match=match):
        read_config(minimal(**overrides))


def test_replay_config_needs_no_checkpoints():
    """Without `checkpoints` the run starts from the model's own weights."""
    config = read_config(
        minimal(checkpoints=..., method="replay", replay={"optimizer": "adamw", "lr": 0.01})
    )
    model_state = config["model"].state_dict()
    (start,) = config["checkpoints"]
    assert all(torch.equal(start[k], v) for k, v in model_state.items())
    assert config["settings"].replay == attribution.ReplaySettings(optimizer="adamw", lr=0.01)
