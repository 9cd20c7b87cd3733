"""bench_index (index build against bergson) and bench_logra_quality (LoGra's inner products)."""

from __future__ import annotations

import json

import pytest

from helpers.benchmarks import load_benchmark


def _rows(out: str, bench: str) -> list[dict]:
    rows = [json.loads(line) for line in out.strip().splitlines()]
    return [r for r in rows if r.get("bench") == bench]


@pytest.mark.bench
def test_index_build_quick_runs_both_sides_on_one_index(capsys):
    """One layer, 8 documents: both sides build a ``k x k``-per-``Conv1D`` index of one width
    (the benchmark refuses otherwise) and the row holds every side's time and the ratios."""
    pytest.importorskip("bergson")
    bench_index = load_benchmark("bench_index")
    bench_index.main(["--quick", "--layers", "1", "--batch", "4"])
    (row,) = _rows(capsys.readouterr().out, "index_build")
    assert row["row_width"] == 4 * 16 * 16  # c_attn, c_proj, c_fc, c_proj at k = 16
    for side in ("floor", "floor_inputs_only", "bergson", "gradsketch"):
        assert row[f"{side}_tokens_per_s"] == pytest.approx(8 * 128 / row[f"{side}_cpu_s"], 1e-2)
    assert row["ratio_gradsketch_over_bergson"] == pytest.approx(
        row["gradsketch_cpu_s"] / row["bergson_cpu_s"], rel=1e-2
    )


@pytest.mark.bench
def test_logra_quality_quick_measures_what_the_formula_predicts(capsys):
    """k = 16 per side on the 2x128 model: the measured cosine-unit error is within a factor
    of 2 of the variance formula's prediction (one seed over 256 pairs: the RMS of 256
    draws of one map, whose pairs share factors, is a noisy estimate of the formula's RMS,
    so only its order is checked), and the projected inner products still correlate."""
    bench = load_benchmark("bench_logra_quality")
    bench.main(["--quick"])
    out = capsys.readouterr().out
    (row,) = _rows(out, "logra_inner_products")
    (summary,) = _rows(out, "logra_inner_products_summary")
    assert row["k_per_side"] == 16 and row["pairs"] == 32 * 8
    assert 0.5 < row["cos_rmse"] / summary["predicted_cos_rmse"] < 2.0
    assert row["pearson"] > 0.3
