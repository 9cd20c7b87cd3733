"""The model-scale EK-FAC benchmark: gradsketch and Kronfluence give the same scores."""

from __future__ import annotations

import json

import pytest

from helpers.benchmarks import load_benchmark


@pytest.mark.bench
def test_quick_shape_scores_equal_kronfluence(capsys):
    """Same maths, same damping heuristic (a tenth of each layer's mean eigenvalue, set on
    gradsketch's side), the
    empirical Fisher on both sides: the score matrices agree up to float32 rounding, so
    their correlation is 1 to many digits; 0.9999 leaves room for summation order only."""
    pytest.importorskip("kronfluence")
    pytest.importorskip("transformers")
    bench_influence_scale = load_benchmark("bench_influence_scale")

    bench_influence_scale.run("tiny", bench_influence_scale.QUICK["tiny"])
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["bench"] == "influence_scale" and row["projection"] is None
    assert row["pearson"] > 0.9999
    assert row["ratio"] == pytest.approx(row["kronfluence_s"] / row["gradsketch_s"], rel=0.02)


def test_gpt2_runs_differentiate_the_blocks_attention_and_mlp_only():
    """``--layers`` runs: both sides track exactly ``c_attn``, ``attn.c_proj``, ``c_fc`` and
    ``mlp.c_proj`` of every block (not the head, embeddings or norms), in model order."""
    pytest.importorskip("transformers")
    bench_influence_scale = load_benchmark("bench_influence_scale")

    spec = {"layers": 2, "width": 16, "heads": 2, "vocab": 50, "seq": 8, "documents": 3}
    model, train, queries = bench_influence_scale._gpt2({**spec, "queries": 2})
    names = bench_influence_scale.block_modules(model)
    assert names == [
        f"transformer.h.{i}.{m}" for i in range(2) for m in bench_influence_scale.BLOCK_MODULES
    ]
    assert tuple(train.shape) == (3, 8) and tuple(queries.shape) == (2, 8)
    assert int(train.max()) < 50
