"""The shared benchmark helpers in benchmarks/_common.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.benchmarks import load_benchmark

common = load_benchmark("_common")
cpu_model, emit = common.cpu_model, common.emit
median_time, run_isolated = common.median_time, common.run_isolated


def test_median_time_counts_warmup_and_repeats(monkeypatch):
    calls = []
    ticks = iter([0.0, 1.0, 10.0, 13.0, 20.0, 22.0])  # durations 1, 3, 2
    monkeypatch.setattr(common.time, "perf_counter", lambda: next(ticks))
    assert median_time(lambda: calls.append(1), repeats=3, warmup=2) == 2.0
    assert len(calls) == 5


def test_median_time_rejects_zero_repeats():
    with pytest.raises(ValueError, match=r"`repeats` must be >= 1, got 0"):
        median_time(lambda: None, repeats=0)


def test_emit_prints_one_rounded_json_line(capsys):
    emit({"bench": "x", "t": 1.23456789, "nested": {"v": [0.000123456, 2]}})
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    record = json.loads(out)
    assert record.pop("cpu") == cpu_model()  # every line names its CPU
    assert record == {"bench": "x", "t": 1.235, "nested": {"v": [0.0001235, 2]}}


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads /proc/cpuinfo (Linux)")
def test_cpu_model_names_the_widest_vector_extension():
    name = cpu_model()
    assert name.endswith(")") and name.split(", ")[-1].rstrip(")") in (
        "avx512f",
        "avx2",
        "avx",
        "sse4_2",
        "baseline",
    )


def test_run_isolated_returns_result_and_child_peak_rss(tmp_path, monkeypatch):
    (tmp_path / "alloc_mod.py").write_text(
        "def alloc(mb):\n"
        "    import numpy as np\n"
        "    a = np.ones(int(mb * 2**20 / 8))\n"
        "    return float(a.sum() * 8 / 2**20)\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    big = run_isolated("alloc_mod:alloc", 150)
    assert big["result"] == 150.0
    # The array's pages are all touched, so the child's peak RSS includes
    # them; the interpreter + numpy add well under 150 MB more.
    assert 150 <= big["peak_rss_mb"] < 150 + 150
    small = run_isolated("alloc_mod:alloc", 1)
    # Each call measures its own child only, not the earlier bigger one.
    assert small["peak_rss_mb"] < 150


def test_run_isolated_reports_child_failure(tmp_path, monkeypatch):
    (tmp_path / "bad_mod.py").write_text("def boom():\n    raise KeyError('kaput')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"(?s)isolated run of bad_mod:boom failed .*kaput"):
        run_isolated("bad_mod:boom")
