"""The side-by-side benchmark rows: scoring kernel against traker, dattri's rows."""

from __future__ import annotations

import json
import sys

import pytest

from helpers.benchmarks import load_benchmark


@pytest.mark.bench
def test_scoring_kernel_row_times_the_same_scores_as_traker():
    """One interleaved row at a toy size: both sides give the same scores.

    X is 300 Gaussian rows of 16 columns: κ(XᵀX) < 3 (its eigenvalues lie
    near (√300 ± 4)²), so float32 scores through either inverse agree to
    1e-4 of their largest entry, the tolerance of test_scores.py.
    """
    pytest.importorskip("trak")
    bench_attribution = load_benchmark("bench_attribution")

    row = bench_attribution._scoring_kernel_row(300, 16, 8, 1)
    assert row["traker_scope"] == bench_attribution.TRAKER_SCORING
    assert row["max_rel_diff_vs_traker"] < 1e-4
    assert row["speedup"] == pytest.approx(row["traker_s"] / row["gradsketch_s"])


def test_dattri_rows_without_dattri_say_so(monkeypatch, capsys):
    bench_influence = load_benchmark("bench_influence")

    monkeypatch.setitem(sys.modules, "dattri.algorithm", None)
    bench_influence.dattri_rows([], None, None, None, None, None, None, 0, [])
    line = json.loads(capsys.readouterr().out)
    assert line["method"] == "dattri" and "dattri is missing" in line["skipped"]


def test_dattri_rows_follow_only(capsys):
    bench_influence = load_benchmark("bench_influence")

    bench_influence.dattri_rows([], None, None, None, None, None, None, 0, ["kronfluence"])
    assert capsys.readouterr().out == ""
