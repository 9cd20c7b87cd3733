"""``TRAKer(projection="auto")``: per-layer rows projected (LoGra) only where exact rows do not fit.

The model is an MLP 32-24-3 (float64 rows): exact per-layer rows are
``33 * 24 + 25 * 3 = 867`` numbers a document (6,944 bytes with Q), rows
projected to 16 per side ``16 * 16 + 16 * 3 = 304`` (2,440 bytes; the last
layer's output side is capped at its 3 outputs). With 12 documents the exact
rows need 83,328 bytes and the projected ones 29,280, so a free disk of
50,000 bytes (``GRADSKETCH_AVAILABLE_DISK``) holds the projected rows only,
and 1,000 bytes neither.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from gradsketch.attribution import TRAKer
from gradsketch.attribution._projection_default import DEFAULT_SIDE

N, D_IN, HIDDEN, CLASSES = 12, 32, 24, 3
LOGGER = "gradsketch.attribution.TRAKer"
#: Bytes free where only the projected rows fit, and where nothing per document does.
PROJECTED_ONLY, NOTHING = 50_000, 1_000


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES))
    return net.double()


def _traker(path, **kwargs) -> TRAKer:
    options = {"method": "ekfac", "dtype": torch.float64, "logging_level": logging.INFO}
    return TRAKer(
        _model(),
        "image_classification",
        N,
        save_dir=path,
        device="cpu",
        progress=False,
        **{**options, **kwargs},
    )


def _scores(traker: TRAKer):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N + 2, D_IN, generator=g, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (N + 2,), generator=g)
    state = _model().state_dict()
    traker.load_checkpoint(state, model_id=0)
    traker.featurize((x[:N], y[:N]), num_samples=N)
    traker.finalize_features()
    traker.start_scoring_checkpoint("q", state, model_id=0, num_targets=2)
    traker.score((x[N:], y[N:]), num_samples=2)
    return traker.finalize_scores("q")


def test_exact_rows_where_they_fit(tmp_path, monkeypatch):
    monkeypatch.delenv("GRADSKETCH_AVAILABLE_DISK", raising=False)
    traker = _traker(tmp_path / "s")
    assert traker.projection is None and traker.rows == "stored"


def test_projected_rows_where_only_they_fit(tmp_path, monkeypatch, caplog):
    """The default equals an explicit ``projection=(16, 16)``, bit for bit, and is logged."""
    monkeypatch.setenv("GRADSKETCH_AVAILABLE_DISK", str(PROJECTED_ONLY))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        auto = _traker(tmp_path / "auto")
    assert auto.projection == (DEFAULT_SIDE, DEFAULT_SIDE) and auto.rows == "stored"
    (line,) = [r.getMessage() for r in caplog.records if "projection='auto'" in r.getMessage()]
    assert "(16, 16) per layer (LoGra)" in line
    assert "~83.3 kB on disk but 50.0 kB is free" in line and "~29.3 kB (2.4 kB per" in line
    assert "pass projection=None" in line and "rows='recompute'" in line
    assert auto.settings.record()["projector"]["projection"] == [16, 16]
    explicit = _traker(tmp_path / "explicit", projection=(16, 16))
    assert (_scores(auto) == _scores(explicit)).all()
    # A reopened store keeps its projection where the disk is free again.
    monkeypatch.setenv("GRADSKETCH_AVAILABLE_DISK", str(10**12))
    assert _traker(tmp_path / "auto").projection == (16, 16)


@pytest.mark.parametrize(
    ("kwargs", "free", "rows"),
    [
        ({"projection": None}, PROJECTED_ONLY, "recompute"),
        ({"rows": "recompute"}, PROJECTED_ONLY, "recompute"),
        ({"rows": "stored"}, PROJECTED_ONLY, "stored"),
        ({}, NOTHING, "recompute"),
    ],
    ids=["projection_none", "rows_recompute", "rows_stored", "nothing_fits"],
)
def test_exact_rows_when_asked_or_when_nothing_fits(tmp_path, monkeypatch, kwargs, free, rows):
    monkeypatch.setenv("GRADSKETCH_AVAILABLE_DISK", str(free))
    traker = _traker(tmp_path / "s", **kwargs)
    assert traker.projection is None and traker.rows == rows


def test_explicit_projection_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADSKETCH_AVAILABLE_DISK", str(PROJECTED_ONLY))
    assert _traker(tmp_path / "s", projection=(4, 2)).projection == (4, 2)


@pytest.mark.parametrize("projection", [None, "auto"])
def test_trak_takes_the_harmless_values(tmp_path, projection):
    traker = _traker(tmp_path / "t", method="trak", proj_dim=8, dtype=None, projection=projection)
    assert traker.projection is None


def test_bad_projection_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"`projection` must be \(k_in, k_out\) positive ints"):
        _traker(tmp_path / "e", projection="exact")
