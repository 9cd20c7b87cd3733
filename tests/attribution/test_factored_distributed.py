"""Per-layer rows under torch.distributed are factored as in one process; the plan per rank.

One ``torchrun --nproc_per_node 2`` launch (module fixture) runs the float64
pipeline of ``_factored_dist_worker.py`` and its plans; the same pipeline runs
here in one process with one thread.

Tolerance of the scores (every run float64 until the scores are rounded to
float32 at the end). The two runs store the same rows in the same form
(each layer's ``[a, g]``, rank-one or per position: checked below, bit for
bit where the ranks featurize the batches one process does) and differ only
in the order of float64 sums split at a chunk boundary across ranks: the
Kronecker factors, EK-FAC's corrections, the damping's mean eigenvalue. Each
such sum of at most n = 64 terms moves by at most 2 γ_64 ≈ 1.4e-14 of the sum
of its terms' magnitudes (Higham, Accuracy and Stability, eq. 4.4); the
eigendecomposition and the damped solve amplify that by at most the damped
factors' conditioning (λ = 'auto', 0.1 of the mean eigenvalue: below ~10 d =
120 here), so the float64 scores differ by well under δ = 1e-9 max|S|. Each
run then rounds to float32 (half an ulp, 2⁻²⁴ |s|, each), so the runs differ
by at most δ + 2⁻²³ |s|. A training row counted twice or missed changes a
factor by ~1/n = 1.6e-2, seven orders of magnitude above δ.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import zarr
from _factored_dist_worker import (
    CHUNK,
    LAYER_METHODS,
    M_LM,
    N_LM,
    ROWS,
    T_LM,
    M,
    N,
    pipeline,
    plan_traker,
)

from gradsketch.attribution import chunk_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.launch import one_thread, torchrun

WORLD = 2
#: Relative float64 difference allowed before the float32 rounding (module docstring).
DELTA = 1e-9


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    dist_root = tmp_path_factory.mktemp("dist")
    single_root = tmp_path_factory.mktemp("single")
    with one_thread():
        single = pipeline(single_root)
    worker = Path(__file__).with_name("_factored_dist_worker.py")
    torchrun(worker, str(dist_root), nproc=WORLD, timeout=900)
    ranks = [dict(np.load(dist_root / f"rank{r}.npz")) for r in range(WORLD)]
    return {"dist": dist_root, "single": single_root, "ranks": ranks, "ref": single}


def _close(got: np.ndarray, want: np.ndarray) -> None:
    """Within δ max|S| + 2⁻²³ |s| (module docstring), and the bound is far below the scores."""
    got, want = got.astype(np.float64), want.astype(np.float64)
    tol = DELTA * np.abs(want).max() + 2.0**-23 * np.abs(want)
    assert np.all(np.abs(got - want) <= tol), np.abs(got - want).max()
    assert tol.max() < 1e-6 * np.abs(want).max()


def _arrays(root: Path) -> set[str]:
    return {p.name for p in (root / "checkpoints" / "0").iterdir() if (p / "zarr.json").exists()}


def _stored(root: Path, name: str) -> np.ndarray:
    return np.asarray(zarr.open_array(str(root / "checkpoints" / "0" / name), mode="r")[:])


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("method", LAYER_METHODS)
def test_layer_method_scores_equal_one_process(runs, method, rows):
    key = f"scores_{method}_{rows}"
    for rank in runs["ranks"]:
        assert np.array_equal(rank[key], runs["ranks"][0][key])  # columns copied, not recomputed
    assert runs["ref"][key].shape == (N, M)
    _close(runs["ranks"][0][key], runs["ref"][key])


@pytest.mark.parametrize("method", LAYER_METHODS)
def test_ranks_store_rank_one_rows_as_one_process(runs, method):
    """Every layer of the MLP sees one position: both runs keep [a, g] per layer, never the
    dense vec(g aᵀ) (the ranks' store per row is one process's), bit for bit (the ranks
    featurize the very batches one process does: BATCH divides CHUNK)."""
    dist, single = runs["dist"] / f"{method}_stored", runs["single"] / f"{method}_stored"
    assert "rank_one" in _arrays(dist) and "grads" not in _arrays(dist)
    assert _arrays(dist) == _arrays(single)
    a, b = _stored(dist, "rank_one"), _stored(single, "rank_one")
    assert a.shape == b.shape == (N, (6 + 1 + 12) + (12 + 1 + 4))  # inputs with the bias
    assert np.array_equal(a, b)


def test_per_token_scores_equal_one_process(runs):
    """GPT-2 rows kept per position ([a, g] of each of the T tokens, narrower than dense)
    on both sides; each rank scores its column shard of the targets' tokens."""
    got, want = runs["ranks"][0]["scores_lm_tokens"], runs["ref"]["scores_lm_tokens"]
    assert got.shape == want.shape == (N_LM, M_LM, T_LM)
    _close(got, want)
    dist, single = runs["dist"] / "lm", runs["single"] / "lm"
    assert "token_factors" in _arrays(dist) and "grads" not in _arrays(dist)
    assert np.array_equal(_stored(dist, "token_factors"), _stored(single, "token_factors"))


def test_rows_grown_on_one_rank_are_settled_on_the_other(runs):
    """Rank 0's rows see one position (kept rank-one while it featurizes), rank 1's three:
    rank 1 creates the per-position rows, and finalize_features rewrites rank 0's into
    them; the store is then one process's, which grew the same way, bit for bit."""
    dist, single = runs["dist"] / "grow", runs["single"] / "grow"
    assert "token_factors" in _arrays(dist) and "grads" not in _arrays(dist)
    assert np.array_equal(_stored(dist, "token_factors"), _stored(single, "token_factors"))
    assert np.array_equal(runs["ranks"][0]["features_grow"], runs["ref"]["features_grow"])
    _close(runs["ranks"][0]["scores_grow"], runs["ref"]["scores_grow"])


def test_rows_overflowing_the_recorded_positions_give_the_same_scores(runs):
    """Two positions then three: one process turns dense at the second batch; the ranks run
    at once, so the form depends on which rank records it first (three positions: both fit;
    two: rank 1 turns the rows dense and rank 0's are rewritten at finalize). Either way the
    rows are the same vec(G), padded positions adding zeros, and so are the scores."""
    dist = runs["dist"] / "overflow"
    assert "grads" in _arrays(dist) or "token_factors" in _arrays(dist)
    feats = runs["ranks"][0]["features_overflow"]
    np.testing.assert_allclose(feats, runs["ref"]["features_overflow"], rtol=1e-15, atol=0)
    _close(runs["ranks"][0]["scores_overflow"], runs["ref"]["scores_overflow"])


# -- the plan, per rank --------------------------------------------------------------


def test_each_rank_is_planned_on_its_share(runs):
    """The ranks on one machine share its memory: each is held to half of it, and to its
    own rows (the time left is that of its chunk shard); each logs that in its plan."""
    for rank, result in enumerate(runs["ranks"]):
        assert int(result["plan_available"]) == 64 * 2**30 // WORLD
        assert int(result["plan_rows_left"]) == len(chunk_shard(N, CHUNK, rank=rank, world_size=2))
        text = str(result["plan_text"])
        assert f"(rank {rank} of 2: 1/2 of this machine's memory of 68.72 GB)" in text


def test_a_rank_that_does_not_fit_stops_every_rank(runs):
    """Rank 1's machine reports 1 kB: both ranks refuse at construction, naming rank 1 only
    (not rank 0, which fits) and the fixes, instead of rank 0 waiting for a dead rank 1."""
    messages = [str(result["refused_one"]) for result in runs["ranks"]]
    assert messages[0] == messages[1]
    assert "does not fit on rank 1 (peak memory ~" in messages[0]
    assert "rank 0 (" not in messages[0]
    assert "Fixes: `projection=(k_in, k_out)`" in messages[0]
    assert "fewer ranks per machine (`--nproc_per_node`)" in messages[0]


def test_what_fits_one_process_is_refused_to_two_ranks_on_its_machine(runs, tmp_path, monkeypatch):
    """1.5x one process's estimate fits one process; two ranks on the machine get 0.75x each."""
    need = int(runs["ranks"][0]["plan_need"])
    message = str(runs["ranks"][0]["refused_shared"])
    assert "does not fit on rank 0 (peak memory ~" in message and ", rank 1 (" in message
    monkeypatch.setenv("GRADSKETCH_AVAILABLE_MEMORY", str(int(1.5 * need)))
    assert plan_traker(tmp_path, "one").plan.stage_bytes() == need  # one process: no refusal


def test_plans_in_one_process_are_unchanged(tmp_path, monkeypatch):
    """Without a process group the plan is the machine's, with no rank in it."""
    monkeypatch.setenv("GRADSKETCH_AVAILABLE_MEMORY", str(2**33))
    plan = plan_traker(tmp_path, "plain").plan
    assert plan.available_memory == 2**33 and "rank" not in str(plan)


def test_damage_found_by_one_rank_stops_every_rank(runs):
    """Each rank checks only its own rows' chunks (once per phase, as one process reads
    each chunk once); the chunk of rows 48-63 (rank 1's) is lost, and both ranks refuse
    finalize_features with rank 1's findings instead of rank 0 going on alone."""
    messages = [str(result["damaged"]) for result in runs["ranks"]]
    assert messages[0] == messages[1]
    assert "out_to_loss" in messages[0] and "48" in messages[0], messages[0]
    assert "featurize again" in messages[0]


def test_split_jobs_run_once_on_their_owner_and_reach_every_rank(runs):
    """Each job of ``split_over_ranks`` runs on exactly one rank (the one balanced_owners
    names), and every rank ends with the owner's tensors, bit for bit, in every shape
    and dtype (as in one process, where each job runs here)."""
    ranks = runs["ranks"]
    owner = list(ranks[0]["split_owner"])
    assert sorted(owner) != [owner[0]] * len(owner)  # both ranks got jobs
    done = [set(r["split_done"].tolist()) for r in ranks]
    assert done[0] | done[1] == set(range(6)) and not done[0] & done[1]
    assert all(owner[i] == r for r in range(WORLD) for i in done[r])
    for i in range(6):
        want = np.full((i, i + 1), float(i)), np.arange(2 * (i + 1)).reshape(2, -1)
        for rank in ranks:
            for j in range(2):
                got = rank[f"split_{i}_{j}"]
                assert got.dtype == want[j].dtype and np.array_equal(got, want[j])


def test_a_split_job_that_fails_stops_every_rank_with_its_error(runs):
    """Job 4 fails on its owner; both ranks raise one message naming that rank and the error."""
    owner = int(runs["ranks"][0]["split_owner"][4])
    messages = [str(r["split_failed"]) for r in runs["ranks"]]
    assert messages[0] == messages[1]
    assert f"rank {owner}: ValueError: job four cannot be done" in messages[0]


def test_balanced_owners_gives_the_costliest_first_to_the_least_loaded():
    from gradsketch.attribution._distributed import balanced_owners

    assert balanced_owners([], 2) == []
    assert balanced_owners([5.0, 5.0, 5.0], 1) == [0, 0, 0]
    # 64 to rank 0; 27, 27, 8, 8 to rank 1 while it stays below 64 (54, 62, 70); 1 to rank 0.
    assert balanced_owners([64.0, 27.0, 27.0, 8.0, 8.0, 1.0], 2) == [0, 1, 1, 1, 1, 0]
    assert balanced_owners([1.0, 1.0, 1.0, 1.0], 3) == [0, 1, 2, 0]  # ties: lower job, lower rank
