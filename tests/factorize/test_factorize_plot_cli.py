"""plot_rank_curve and the factorize command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from gradsketch.factorize import (
    apply_factorization,
    factorize_command,
    plot_rank_curve,
)

EXAMPLE_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "factorize_config.py"


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_rank_curve_png_and_monotone(tmp_path, kind):
    torch.manual_seed(0)
    if kind == "linear":
        module, x, top = nn.Linear(40, 24), torch.randn(300, 40), 23
    else:
        module, x, top = nn.Conv2d(6, 12, 3, stride=2), torch.randn(8, 6, 9, 9), 11
    curve = plot_rank_curve(module, x, tmp_path / "sub" / "curve.png")
    assert curve.path is not None and curve.path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert curve.ranks == sorted(curve.ranks) and curve.ranks[-1] == top
    assert all(a >= b - 1e-9 for a, b in zip(curve.nmse, curve.nmse[1:]))
    assert curve.max_rank == (14 if kind == "linear" else 9)


def test_rank_curve_errors():
    with pytest.raises(TypeError, match=r"`module` must be one of the registered types; got ReLU"):
        plot_rank_curve(nn.ReLU(), torch.randn(3, 3))
    with pytest.raises(ValueError, match=r"`ranks\[...\]` must be an integer in \[1, 8\), got 8"):
        plot_rank_curve(nn.Linear(8, 8), torch.randn(20, 8), ranks=[2, 8])


def test_factorize_command_on_example_config(tmp_path):
    report = factorize_command(EXAMPLE_CONFIG, tmp_path / "out")
    data = json.loads((tmp_path / "out" / "factorization_report.json").read_text())
    assert {r["name"] for r in data["replaced"]} == {"2", "5"}
    assert {s["name"] for s in data["skipped"]} == {"0", "7"}
    assert data["settings"]["calibrated"] is True
    assert [r.name for r in report.replaced] == ["2", "5"]
    # Reload: rebuild, apply the recorded settings, load the saved state_dict.
    namespace: dict = {}
    exec(EXAMPLE_CONFIG.read_text(), namespace)
    model = namespace["build_model"]()
    settings = {
        k: data["settings"][k]
        for k in ("min_channels", "latent_channels", "min_features", "latent_features")
    }
    apply_factorization(model, **settings)
    model.load_state_dict(torch.load(tmp_path / "out" / "factorized_state_dict.pt"))
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 10)


def test_factorize_command_with_model_object_and_no_calibration(tmp_path):
    cfg = tmp_path / "cfg.py"
    cfg.write_text("import torch\nmodel = torch.nn.Linear(64, 64)\nmin_features = 8\n")
    # A bare Linear is the root module itself: nothing inside it to replace.
    report = factorize_command(cfg, tmp_path / "o")
    assert report.replaced == [] and (tmp_path / "o" / "factorized_state_dict.pt").exists()


@pytest.mark.parametrize(
    ("body", "exc", "match"),
    [
        ("x = 1\n", ValueError, r"defines neither `model` nor `build_model\(\)`"),
        ("model = 3\n", ValueError, r"config `model` must be a torch.nn.Module; got int"),
    ],
    ids=["no-model", "not-module"],
)
def test_factorize_command_config_errors(tmp_path, body, exc, match):
    cfg = tmp_path / "cfg.py"
    cfg.write_text(body)
    with pytest.raises(exc, match=match):
        factorize_command(cfg, tmp_path / "out")


def test_factorize_command_missing_config(tmp_path):
    match = r"`config_path` must be an existing \.py file, got '.*nope.py'"
    with pytest.raises(FileNotFoundError, match=match):
        factorize_command(tmp_path / "nope.py", tmp_path / "out")
