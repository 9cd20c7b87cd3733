"""bench_influence_defaults: its five protocols at toy sizes, the grid's re-scoring."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from gradsketch.demos.protocols import influence as ip
from helpers.benchmarks import load_benchmark

bd = load_benchmark("bench_influence_defaults")

#: Toy sizes: 24 training rows, 4 queries, 3 retrained models, one checkpoint, one epoch.
TINY = ip.Sizes(num_train=24, num_queries=4, lds_models=3, checkpoints=1, epochs=1)
EKFAC = {"method": "ekfac", "curvature": "loss", "sample_seed": None}


@pytest.fixture(scope="module")
def logreg() -> ip.Protocol:
    return ip.build_protocol("digits-logreg", TINY)


@pytest.mark.parametrize("name", ip.PROTOCOLS)
def test_every_protocol_builds_at_toy_size(name: str) -> None:
    p = ip.build_protocol(name, TINY)
    assert p.num_train == 24
    assert sum(int(b[0].shape[0]) for b in p.query_batches) == 4
    assert p.masks.shape == (3, 24) and np.asarray(p.outputs).shape == (3, 4)
    assert np.isfinite(np.asarray(p.outputs)).all()
    assert len(p.checkpoints) == 1
    assert p.hooks == (name in ("gpt2", "bert"))


def test_rescoring_a_store_matches_a_fresh_traker_at_that_damping(logreg, tmp_path) -> None:
    """The grid's shortcut (features once, a re-opened TRAKer per damping) changes nothing."""
    from gradsketch.attribution import _kfac

    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    traker, auto = bd.fit(logreg, a, lambda_reg="auto", **EKFAC)
    _, fresh = bd.fit(logreg, b, lambda_reg=1e-3, **EKFAC)
    np.testing.assert_allclose(bd.rescore(logreg, a, 1e-3, None, **EKFAC), fresh, rtol=1e-6)
    np.testing.assert_allclose(bd.rescore(logreg, a, "auto", 0.3, **EKFAC), auto, rtol=1e-6)
    # One layer: "auto" at fraction f is f x its mean eigenvalue, i.e. 10 f x λ̄.
    pooled = bd.pooled_auto(traker, 1)
    np.testing.assert_allclose(
        bd.rescore(logreg, a, "auto", 0.01, **EKFAC),
        bd.rescore(logreg, a, 0.1 * pooled, None, **EKFAC),
        rtol=1e-6,
    )
    assert not np.allclose(bd.rescore(logreg, a, "auto", 1.0, **EKFAC), auto, rtol=1e-3)
    assert _kfac.LAYER_AUTO_DAMPING_FRACTION == 0.3  # restored


def test_run_protocol_emits_one_line_per_setting_and_tables_read_them(
    logreg, capsys, tmp_path
) -> None:
    rows = bd.run_protocol(logreg, bd.QUICK_GRID, kronfluence=False)
    out = capsys.readouterr().out
    lines = [json.loads(line) for line in out.splitlines()]
    # 2 methods x (loss + 1 sample seed) x 3 dampings, then identity and TRAK.
    assert len(rows) == len(lines) == 2 * 2 * 3 + 2
    assert all(line["cpu"] and np.isfinite(line["lds"]) for line in lines)
    assert {(r["method"], r["curvature"], r["seed"]) for r in rows if "fit_seconds" in r} == {
        ("ekfac", "loss", None),
        ("ekfac", "sampled", 0),
        ("kfac", "loss", None),
        ("kfac", "sampled", 0),
    }
    table = bd.tables(lines)
    assert "**digits-logreg**" in table and "| damping | K-FAC loss |" in table
    assert '`"auto"` at 0.3 (the default)' in table and "- trak" in table
    assert "**ranking over 1 protocols**" in table
    # --summary reads several runs; a setting measured twice appears once.
    (tmp_path / "run.jsonl").write_text(out)
    bd.main(["--summary", str(tmp_path / "run.jsonl"), str(tmp_path / "run.jsonl")])
    assert capsys.readouterr().out.strip() == table.strip()


def test_grid_from_the_command_line() -> None:
    parse = argparse.Namespace
    given = parse(quick=False, seeds="4", absolute="", pooled_multiples=None, fractions="0.3,1")
    assert bd.Grid.from_args(given) == bd.Grid(seeds=(4,), absolute=(), fractions=(0.3, 1.0))
    quick = parse(quick=True, seeds=None, absolute=None, pooled_multiples=None, fractions=None)
    assert bd.Grid.from_args(quick) == bd.QUICK_GRID


@pytest.mark.bench
# Kronfluence 1.0.1 builds torch.cuda.amp.GradScaler, deprecated in this torch.
@pytest.mark.filterwarnings("ignore:`torch.cuda.amp.GradScaler:FutureWarning")
def test_kronfluence_rows_at_its_default_damping_and_its_heuristic(logreg, tmp_path) -> None:
    pytest.importorskip("kronfluence")
    rows = bd.kronfluence_rows(logreg, str(tmp_path))
    assert [r["damping"] for r in rows] == [1e-8, "heuristic"]
    assert all(np.isfinite(r["lds"]) for r in rows)
