"""apply_factorization: what is replaced, what is skipped and why, optimizers, report."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from gradsketch.factorize import (
    FactorizationReport,
    FactorizedConv2d,
    FactorizedLinear,
    apply_factorization,
)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.grouped = nn.Conv2d(32, 32, 3, padding=1, groups=4)
        self.narrow = nn.Conv2d(32, 4, 1)
        self.attn = nn.MultiheadAttention(64, 4, batch_first=True)
        self.fc = nn.Linear(64, 64)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.narrow(torch.relu(self.grouped(torch.relu(self.conv(x)))))  # [B, 4, 4, 4]
        tokens = h.flatten(2).transpose(1, 2).repeat(1, 1, 16)  # [B, 16, 64]
        tokens, _ = self.attn(tokens, tokens, tokens)
        return self.head(torch.relu(self.fc(tokens))).mean(1)


def _settings(**kw):
    base = dict(min_channels=8, min_features=32, latent_channels=8, latent_features=16)
    base.update(kw)
    return base


def test_report_names_replacements_and_reasons():
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(8, 16, 8, 8)
    report = apply_factorization(model, calibration_data=x, **_settings())
    replaced = {r.name: r for r in report.replaced}
    skipped = {s.name: s.reason for s in report.skipped}
    assert set(replaced) == {"conv", "fc"}
    assert isinstance(model.conv, FactorizedConv2d) and isinstance(model.fc, FactorizedLinear)
    assert "grouped convolution (groups=4)" in skipped["grouped"]
    assert "below `min_channels`=8" in skipped["narrow"]
    assert "MultiheadAttention reads `.weight` directly" in skipped["attn.out_proj"]
    assert "min(in, out)=10 is below `min_features`=32" in skipped["head"]
    assert isinstance(model.attn.out_proj, nn.Linear)
    assert model(x).shape == (8, 10)  # still runs, attention included
    conv = replaced["conv"]
    assert (conv.rank, conv.in_size, conv.out_size, conv.nmse_on) == (8, 16, 32, "calibration_data")
    assert conv.params_before == 32 * 16 * 9 + 32
    assert conv.params_after == 8 * 16 * 9 + 32 * 8 + 32
    assert conv.macs_after == 8 * (144 + 32) < conv.macs_before == 144 * 32
    assert 0.0 <= conv.nmse < 1.0
    assert report.params_saved == sum(r.params_before - r.params_after for r in report.replaced)


def test_calibrated_surgery_keeps_low_rank_model_exact():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    with torch.no_grad():
        for lin in (model[0], model[2]):
            lin.weight.copy_(torch.randn(64, 8) @ torch.randn(8, 64) / 8)
    x = torch.randn(256, 64)
    before = model(x).detach()
    report = apply_factorization(model, min_features=32, latent_features=8, calibration_data=x)
    assert len(report.replaced) == 2 and all(r.nmse < 1e-8 for r in report.replaced)
    torch.testing.assert_close(model(x), before, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("form", ["tensor", "tuple", "dict"])
def test_calibration_data_forms(form):
    class KwNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(32, 32)

        def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
            return self.fc(x) * scale

    model = KwNet()
    x = torch.randn(64, 32)
    data = {"tensor": x, "tuple": (x, 2.0), "dict": {"x": x, "scale": 2.0}}[form]
    report = apply_factorization(model, min_features=16, latent_features=4, calibration_data=data)
    assert report.replaced[0].nmse_on == "calibration_data"
    assert model.training  # training mode restored after the eval-mode capture


def test_layers_not_called_on_calibration_data_are_skipped():
    model = nn.ModuleDict({"used": nn.Linear(32, 32), "unused": nn.Linear(32, 32)})
    model.forward = lambda x: model["used"](x)  # type: ignore[method-assign]
    report = apply_factorization(
        model, min_features=16, latent_features=4, calibration_data=torch.randn(40, 32)
    )
    assert [r.name for r in report.replaced] == ["used"]
    assert report.skipped[0].name == "unused"
    assert report.skipped[0].reason == "not called on `calibration_data`"


def test_transformer_layer_and_tied_weights_are_left_intact():
    torch.manual_seed(0)
    enc = nn.TransformerEncoderLayer(64, 4, dim_feedforward=64, batch_first=True)
    emb = nn.Linear(64, 64)
    tied = nn.Linear(64, 64)
    tied.weight = emb.weight
    model = nn.ModuleDict({"enc": enc, "emb": emb, "tied": tied})
    report = apply_factorization(model, min_features=32, latent_features=8)
    reasons = {s.name: s.reason for s in report.skipped}
    assert "TransformerEncoderLayer reads `.weight`" in reasons["enc.linear1"]
    assert "shared (tied)" in reasons["emb"] and "shared (tied)" in reasons["tied"]
    assert not report.replaced
    enc.eval()
    with torch.no_grad():
        assert enc(torch.randn(2, 5, 64)).shape == (2, 5, 64)


def test_shared_module_and_subclass_are_skipped():
    class MyLinear(nn.Linear):
        pass

    shared = nn.Linear(32, 32)
    model = nn.Sequential(shared, nn.ReLU(), shared, MyLinear(32, 32))
    report = apply_factorization(model, min_features=16, latent_features=4)
    reasons = {s.name: s.reason for s in report.skipped}
    assert "registered under several names" in reasons["0"]
    assert "MyLinear subclasses Linear" in reasons["3"]


def test_disabled_kinds_and_speedup_limit():
    model = nn.Sequential(nn.Conv2d(16, 16, 1), nn.Linear(16, 16))
    report = apply_factorization(model, factorize_convs=False, min_features=8, latent_features=12)
    reasons = {s.name: s.reason for s in report.skipped}
    assert reasons["0"] == "`factorize_convs` is False"
    assert "latent size 12 would not save multiply-adds (needs <= 7)" in reasons["1"]


def test_already_factorized_children_are_not_touched():
    model = nn.Sequential(FactorizedLinear(64, 64, latent_features=8))
    report = apply_factorization(model, min_features=1, latent_features=2)
    assert not report.replaced and not report.skipped


def test_optimizers_follow_the_new_parameters():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(16, 32)
    model(x).sum().backward()
    opt.step()
    old = model[0].weight
    apply_factorization(model, min_features=16, latent_features=4, optimizers=opt)
    params = opt.param_groups[0]["params"]
    assert all(p is not old for p in params) and old not in opt.state
    assert {id(p) for p in params} == {id(p) for p in model.parameters()}
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()


def test_report_json_round_trip(tmp_path):
    model = nn.Sequential(nn.Linear(32, 32), nn.Conv2d(8, 8, 3, groups=2))
    report = apply_factorization(model, min_features=16, latent_features=4, min_channels=1)
    text = report.to_json(tmp_path / "r.json")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data == json.loads(text)
    assert data["replaced"][0]["name"] == "0" and data["skipped"][0]["name"] == "1"
    assert data["params_saved"] == report.params_saved
    assert data["settings"]["latent_features"] == 4
    assert "factorized 1 layer(s), skipped 1" in str(report)
    assert isinstance(report, FactorizationReport)


def test_surgery_then_load_state_dict_round_trip():
    torch.manual_seed(0)
    make = lambda: nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))  # noqa: E731
    model = make()
    apply_factorization(
        model, min_features=16, latent_features=6, calibration_data=torch.randn(64, 32)
    )
    other = make()
    apply_factorization(other, min_features=16, latent_features=6)
    other.load_state_dict(model.state_dict())
    x = torch.randn(5, 32)
    torch.testing.assert_close(other(x), model(x))


# ----------------------------------------------------------------- error paths


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (
            {"min_features": -1},
            ValueError,
            r"`min_features` must be a non-negative integer, got -1",
        ),
        (
            {"min_channels": 1.5},
            ValueError,
            r"`min_channels` must be a non-negative integer, got 1.5",
        ),
        ({"latent_features": 0}, ValueError, r"`latent_features` must be an int >= 1"),
        ({"latent_channels": "x"}, TypeError, r"`latent_channels` must be an int >= 1 .*'x'"),
        ({"optimizers": [1]}, TypeError, r"`optimizers` must be an Optimizer .* int"),
        ({"calibration_data": 3, "min_features": 1}, TypeError, r"`calibration_data` must be"),
    ],
    ids=["min-features", "min-channels", "latent-zero", "latent-str", "optimizers", "calib"],
)
def test_bad_settings_are_refused(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        apply_factorization(nn.Sequential(nn.Linear(32, 32)), **kwargs)


def test_wrapped_or_non_module_models_are_refused():
    with pytest.raises(ValueError, match=r"wrapped in DataParallel; apply factorization to"):
        apply_factorization(nn.DataParallel(nn.Linear(4, 4)))
    with pytest.raises(TypeError, match=r"`model` must be a torch.nn.Module; got str"):
        apply_factorization("model")  # type: ignore[arg-type]
