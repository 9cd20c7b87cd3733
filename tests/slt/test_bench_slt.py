"""benchmarks/bench_slt.py: ``--store none`` times llc as called without an output path."""

from __future__ import annotations

import json
import sys

import pytest

from helpers.benchmarks import load_benchmark

pytestmark = pytest.mark.bench
pytest.importorskip("devinterp.slt")
pytest.importorskip("datasets")

bench_slt = load_benchmark("bench_slt")


def test_llc_without_a_store_gives_both_libraries_estimates_of_the_stored_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without a store gradsketch skips the observables and devinterp evaluates them into
    its temporary store: each library's estimate is the one it gives keeping a store
    (gradsketch's chains are the same bits; devinterp's do not depend on the path)."""
    lines = {}
    for store in ("kept", "none"):
        args = ["--model", "llama", "--tasks", "llc", "--repeats", "1", "--threads", "1"]
        args += ["--cores", "1", "--chains", "2", "--draws", "3", "--chunks", "128"]
        args += ["--train-epochs", "0", "--store", store]
        monkeypatch.setattr(sys, "argv", ["bench_slt.py", *args])
        bench_slt.main()
        lines[store] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for store, line in lines.items():
        assert line["store"] == store and line["task"] == "llc" and line["draws"] == 3
        assert line["gradsketch_cpu_s"] > 0 and line["devinterp_cpu_s"] > 0
    for lib in ("gradsketch", "devinterp"):
        assert lines["none"][f"estimate_{lib}"] == lines["kept"][f"estimate_{lib}"], lib
