"""benchmarks/bench_projector_quality.py, smoke-sized: its rows and what they must satisfy."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch

from helpers.benchmarks import load_benchmark

transformers = pytest.importorskip("transformers")
# The GPT-2 classes load lazily; loading them here keeps that out of the test's own time.
transformers.GPT2LMHeadModel

bench = load_benchmark("bench_projector_quality")

FIELDS = {
    "model",
    "projector",
    "k",
    "features",
    "pearson_mean",
    "pearson_min",
    "pearson_max",
    "score_pearson_mean",
    "seconds",
    "cpu_seconds",
    "cpu",
}

#: One tiny GPT-2 (1 layer, width 16, sequence 16: 7,664 weights), 20 training
#: steps, 24 training and 4 query chunks, k = 64, two projector seeds.
ARGS = [
    "--quick",
    "--models", "gpt2",
    "--layers", "1",
    "--width", "16",
    "--heads", "2",
    "--seq", "16",
    "--steps", "20",
    "--num-train", "24",
    "--num-queries", "4",
    "--batch", "12",
    "--ks", "64",
    "--seeds", "0", "1",
    "--reference-k", "16384",
    "--repeats", "1",
    "--threads", "1",
]  # fmt: skip


@pytest.fixture
def _keep_threads() -> Iterator[None]:
    """The benchmark pins torch's threads; later tests get the count they started with."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("_keep_threads")
def test_quick_rows_have_the_fields_and_sound_correlations(capsys):
    rows = bench.main(ARGS)
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(printed) == len(rows) == len(bench.PROJECTORS) + 1
    for row, line in zip(rows, printed):
        assert FIELDS <= set(row) and FIELDS <= set(line)
        assert row["model"] == "gpt2" and row["grad_dim"] == 7664
        assert 1 <= row["features"] <= row["k"]
        assert row["seeds"] == 2 and row["seconds"] > 0 and row["cpu_seconds"] >= 0
        for key in ("pearson_mean", "pearson_min", "pearson_max", "score_pearson_mean"):
            assert -1.0 <= row[key] <= 1.0, (row["projector"], key, row[key])
        assert row["pearson_min"] <= row["pearson_mean"] <= row["pearson_max"]
        # The hooks' per-example gradients are exact (float64), and the model learned.
        assert row["autograd_rel_err"] < 1e-10
        assert row["loss_final"] < row["loss_initial"]
    by_key = {(r["projector"], r["k"]): r for r in rows}
    assert [p for p, k in by_key if k == 64] == list(bench.PROJECTORS)
    # CountSketch at k = 16384 > d is nearly exact: the measurement itself is sound.
    reference = by_key[(bench.COUNTSKETCH, 16384)]
    assert reference["pearson_min"] > 0.9 and reference["score_pearson_min"] > 0.9
    # The factorized map through the hooks equals the same map on exact gradients.
    factorized = by_key[(bench.FACTORIZED, 64)]
    assert factorized["hooks_vs_generic_rel_diff"] < 1e-10
    assert by_key[(bench.COUNTSKETCH, 64)]["features"] == 64


def test_scores_of_trak_scores_and_the_gram_identity_agree():
    """Below TRAK_SCORES_MAX_K the scores come from trak_scores, above from the [n, n] Gram
    matrix; both are X (XᵀX + λI)⁻¹ Tᵀ ⊙ Q."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 12, generator=gen, dtype=torch.float64).numpy()
    t = torch.randn(5, 12, generator=gen, dtype=torch.float64).numpy()
    q = torch.rand(40, generator=gen, dtype=torch.float64).numpy()
    via_trak = bench.scores_of(x, t, q)
    via_gram = bench.gram_scores(x, t, q, bench.damping(x))
    assert abs(via_trak - via_gram).max() < 1e-4 * abs(via_gram).max()
