"""benchmarks/bench_demo_attribution.py, smoke-sized: one line per method and the ratio."""

from __future__ import annotations

import json

import pytest

from helpers.benchmarks import load_benchmark

bench = load_benchmark("bench_demo_attribution")


@pytest.mark.slow
def test_quick_run_times_both_methods_and_their_ratio(capsys) -> None:
    """The ratio line is the ratio of the two methods' times. Every printed float is
    rounded to 4 significant digits (relative error <= 5e-4 each), so the printed ratio
    and the ratio of the printed times differ by at most about 3 * 5e-4 relative."""
    bench.main(["--quick", "--threads", "1"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    trak, ekfac, ratio = lines
    assert (trak["method"], ekfac["method"]) == ("trak", "ekfac")
    for line in (trak, ekfac):
        assert line["wall_s"] > 0 and line["cpu_s"] > 0
        assert {"featurize_s", "finalize_features_s", "score_s", "finalize_scores_s"} <= set(line)
    assert ratio["wall_ratio"] == pytest.approx(ekfac["wall_s"] / trak["wall_s"], rel=1.5e-3)
    assert ratio["cpu_ratio"] == pytest.approx(ekfac["cpu_s"] / trak["cpu_s"], rel=1.5e-3)
