"""Every attribution method under torch.distributed: 2 gloo ranks against one process.

One ``torchrun --nproc_per_node 2`` launch (module fixture) runs the pipeline
of ``_trak_dist_worker.py`` (TRAK, identity, K-FAC, EK-FAC, the replay); the
same pipeline runs here in one process with one thread. Where the arithmetic
is the same (features, target features, the reduction of per-rank partial
products, per-column scoring, the replay's run and query blocks) the results
must be bit-identical; where the summation order legitimately differs (XᵀX
summed as X₀ᵀX₀ + X₁ᵀX₁ rather than in one product; the per-layer factors
summed over each rank's rows) the tolerance is derived below. Per-layer rows
are kept factored by the ranks as by one process (float64 runs of every
per-layer method: ``test_factored_distributed.py``). Each rank's memory is
its share: the rows it writes to the store and the queries it carries
through a reverse pass are checked against its shard.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import zarr
from _trak_dist_worker import (
    BATCH,
    CHUNK_ROWS,
    LAYER_METHODS,
    M_REPLAY,
    N_TARGETS,
    N_TRAIN,
    PROJ_DIM,
    QUIET,
    SMALL_BUDGET,
    has_recompute,
    pipeline,
    problem,
)
from torch.utils.data import DataLoader, TensorDataset

from gradsketch import _distributed as common
from gradsketch.attribution import (
    BasicScoreComputer,
    ChunkShardSampler,
    DistributedMismatchError,
    TRAKer,
    chunk_shard,
    column_shard,
)
from gradsketch.attribution import _distributed as D
from gradsketch.attribution._linalg import damped_inverse, xtx_blocked
from gradsketch.attribution._scores import (
    CheckpointGrads,
    score_checkpoints,
    scores_with_computer,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.launch import one_thread, torchrun
from helpers.numerics import gamma, trak_score_tolerance

WORLD = 2
LAMBDA = 0.05


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    dist_root = tmp_path_factory.mktemp("dist")
    single_root = tmp_path_factory.mktemp("single")
    model, ckpts, x, y, _, _ = problem()
    with one_thread():
        # One process featurizes the first chunk of checkpoint 0 (in the pipeline's
        # batches: a row's features may differ in the last bit with the batch it is in,
        # e.g. on AVX2 code paths); the ranks resume.
        first = TRAKer(
            model,
            "image_classification",
            N_TRAIN,
            save_dir=dist_root / "store",
            proj_dim=PROJ_DIM,
            chunk_rows=CHUNK_ROWS,
            lambda_reg=LAMBDA,
            **QUIET,
        )
        first.load_checkpoint(ckpts[0], model_id=0)
        for s in range(0, CHUNK_ROWS, BATCH):
            first.featurize((x[s : s + BATCH], y[s : s + BATCH]), num_samples=BATCH)
        single = pipeline(single_root)
    worker = Path(__file__).with_name("_trak_dist_worker.py")
    torchrun(worker, str(dist_root), nproc=WORLD, timeout=600)
    ranks = [dict(np.load(dist_root / f"rank{r}.npz")) for r in range(WORLD)]
    return {"dist": dist_root, "single": single_root, "ranks": ranks, "ref": single}


def _array(root: Path, name: str) -> np.ndarray:
    return np.asarray(zarr.open_array(str(root / name), mode="r")[:])


def test_every_rank_returns_the_same_scores(runs):
    rank0, rank1 = runs["ranks"]
    for key in (
        "scores",
        "scores_disk",
        "scores_pre",
        "scores_sc",
        "scores_ekfac",
        "scores_lm_tokens",
        *(f"scores_{method}" for method in LAYER_METHODS),
        "scores_replay",
        "scores_replay_one",
    ):
        # Exact: each rank's columns are copied to the others, never recomputed.
        assert np.array_equal(rank0[key], rank1[key]), key
    assert bool(rank0["on_disk"]), "the small budget must send the scores to disk"


def test_per_token_scores_across_ranks_equal_one_process(runs):
    """Each rank scores its column shard of the targets' tokens and the [n, m, T] blocks
    are gathered. Both runs keep the per-layer rows in the same form; the factors are
    float32-rounded sums split across ranks (the tolerance of the EK-FAC test below,
    whose reasoning holds here too)."""
    got, want = runs["ranks"][0]["scores_lm_tokens"], runs["ref"]["scores_lm_tokens"]
    assert got.shape == want.shape == (16, 5, 6)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_ekfac_across_ranks_equals_one_process(runs):
    """The factors and EK-FAC's correction are float64 sums over rows, split at a chunk
    boundary and added once across ranks instead of in one pass: the sums agree to
    ~n 2^-52 relative, far inside float32's 2^-24 rounding of the stored rows and of the
    scores. The eigendecomposition can amplify that by the conditioning of the factors
    (damped by λ = 'auto', 0.3 of the mean eigenvalue: at most ~4x), so a 1e-5
    relative tolerance on the scores is loose for the rounding and tight for any row
    counted twice or missed (a change of 1/n = 1e-2 in a factor)."""
    got, want = runs["ranks"][0]["scores_ekfac"], runs["ref"]["scores_ekfac"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    for rank in runs["ranks"]:
        # Top-k across ranks: each rank's columns, gathered; the rows of the scores.
        for j in range(N_TARGETS):
            want_top = np.sort(np.argsort(-want[:, j], kind="stable")[:3])
            assert np.array_equal(np.sort(rank["top_ekfac"][:, j]), want_top), j
            want_bottom = np.sort(np.argsort(want[:, j], kind="stable")[:3])
            assert np.array_equal(np.sort(rank["bottom_ekfac"][:, j]), want_bottom), j
        np.testing.assert_allclose(
            rank["top_ekfac_scores"], -np.sort(-want, axis=0)[:3], rtol=1e-5, atol=1e-6
        )
    ekfac = runs["dist"] / "ekfac" / "checkpoints" / "0"
    assert sorted(p.name for p in ekfac.glob("accumulated.*.npz")) == [
        "accumulated.0.npz",
        "accumulated.1.npz",
    ]


@pytest.mark.parametrize("method", LAYER_METHODS)
def test_layer_method_within_float32_bound_of_one_process(runs, method):
    """Tolerance: each run within float32 rounding of the same exact scores.

    With one checkpoint, score_ij = q_i x_i·s_j, where x_i is the training row
    (vec(g aᵀ) per layer, width K), s_j = P⁻¹ t_j the preconditioned target row
    (identity: t_j) and q_i the out-to-loss term. The ranks keep each layer's a
    and g, as one process does (checked below), and form the K products as
    (a·a')(g·g') or gᵀ S a; the bound allows any grouping of the same K terms,
    each computed with at most a few roundings (the entry of vec(g aᵀ); s_j's
    entries, P⁻¹ being applied in float64 and rounded once to float32; the
    product; the factor q): by Higham's bound (Accuracy and Stability, eq. 3.5) each run is within
    γ_{K+7} |q_i| (|X| |S|ᵀ)_ij of the exact value, so the two runs differ by at
    most twice that. K-FAC's factors are float64 sums over the rows
    split across ranks: their order changes them by ~n 2⁻⁵³ relative, which the
    eigendecomposition (damped by λ = 'auto') keeps far below float32's 2⁻²⁴,
    and one more γ (γ_{K+8}) covers it. S is read from the ranks' store in
    float64 (``preconditioner(0).solve``), X and T are its stored rows (X expanded
    from the stored [a, g]).
    """
    root = runs["dist"] / method
    single = runs["single"] / method
    assert not (root / "checkpoints/0/grads").exists()  # the rows stay factored, as in one
    assert np.array_equal(
        _array(root, "checkpoints/0/rank_one"), _array(single, "checkpoints/0/rank_one")
    )
    t = _array(root, "experiments/exp/0/grads").astype(np.float64)
    q = _array(root, "checkpoints/0/out_to_loss").astype(np.float64)
    model, *_ = problem()
    reader = TRAKer(model, "image_classification", N_TRAIN, save_dir=root, method=method, **QUIET)
    x = np.asarray(reader.stored_features(0)[0:N_TRAIN], dtype=np.float64)
    s = reader.preconditioner(0).solve(torch.from_numpy(t)).double().numpy()
    tol = 2 * gamma(x.shape[1] + 8) * np.abs(q) * (np.abs(x) @ np.abs(s).T)
    got, want = runs["ranks"][0][f"scores_{method}"], runs["ref"][f"scores_{method}"]
    assert got.shape == want.shape == (N_TRAIN, N_TARGETS)
    assert np.all(np.abs(got.astype(np.float64) - want) <= tol)
    # The exact scores are those: each run is within half the bound of q ⊙ X Sᵀ.
    assert np.all(np.abs(got - q * (x @ s.T)) <= tol / 2)
    # The bound is informative, not vacuous: far below the scores themselves.
    assert tol.max() < 1e-3 * np.abs(want).max()


def test_replay_across_ranks_bit_equal_to_one_process(runs):
    """Exact: every rank trains the same seeded run with one thread (as one process
    does), each reverses the very query block one process reverses (REPLAY_BLOCK
    queries, whole chunks of its share), and the float64 score columns are copied,
    never summed. A second experiment of one query leaves one rank with nothing."""
    for key, m in (("scores_replay", M_REPLAY), ("scores_replay_one", 1)):
        got, want = runs["ranks"][0][key], runs["ref"][key]
        assert got.dtype == want.dtype == np.float64, key
        assert got.shape == (want.shape[0], m)
        assert np.array_equal(got, want), key


@pytest.mark.parametrize("method", ["trak", "ekfac", *LAYER_METHODS, "replay"])
def test_each_rank_writes_only_its_share(runs, method):
    """Memory and work per rank: a rank featurizes and stores only the training rows
    of its chunk shard and the target rows of its share of the targets' chunks (the
    replay stores no training rows: every rank keeps the run's rows in memory)."""
    n_targets, target_chunk = (M_REPLAY, 1) if method == "replay" else (N_TARGETS, CHUNK_ROWS)
    for rank, result in enumerate(runs["ranks"]):
        train = result[f"written_train_{method}"]
        if method == "replay":
            assert train.size == 0
        else:
            rows = chunk_shard(N_TRAIN, CHUNK_ROWS, rank=rank, world_size=WORLD)
            assert train.tolist() == list(rows), rank
        share = chunk_shard(n_targets, target_chunk, rank=rank, world_size=WORLD)
        assert result[f"written_targets_{method}"].tolist() == list(share), rank


def test_replay_ranks_reverse_only_their_queries(runs):
    """Each rank carries its ceil(m / W) queries through one reverse pass (one process
    carries the same blocks one after the other), so a rank's reverse-pass memory
    (adjoints, scores and activations grow with the block) is that of its share."""
    blocks = [result["replay_blocks"].tolist() for result in runs["ranks"]]
    shares = [len(chunk_shard(M_REPLAY, 1, rank=r, world_size=WORLD)) for r in range(WORLD)]
    assert blocks == [[share] for share in shares]
    assert runs["ref"]["replay_blocks"].tolist() == shares
    for result in runs["ranks"]:
        assert int(result["replay_bytes_share"]) < int(result["replay_bytes_all"])


needs_recompute = pytest.mark.skipif(
    not has_recompute(),
    reason="TODO(issue 49): TRAKer(rows='recompute') is not in this tree yet; the worker "
    "runs it under torchrun once it is",
)


@needs_recompute
def test_recompute_trak_across_ranks_within_derived_tolerance(runs):
    """TRAK with rows='recompute': each rank sums XᵀX of its rows in float64 and the
    ranks' sums are added once; the scores then differ from one process's only through
    the float32 XᵀX each run keeps (at most an ulp apart per entry), bounded as the
    stored runs' scores are (``trak_score_tolerance``: that difference's exact effect
    plus each run's float32 rounding). The recomputed rows are those the stored run of
    the same checkpoint wrote (same projector, weights and batches; bit-equal across
    runs, tested above), read from there."""
    root = runs["dist"]
    single = runs["single"]
    x = _array(root, "store/checkpoints/0/grads")
    t = _array(root, "recompute_trak/experiments/exp/0/grads")
    assert np.array_equal(t, _array(single, "recompute_trak/experiments/exp/0/grads"))
    q = _array(root, "recompute_trak/checkpoints/0/out_to_loss")
    xtx = [_array(r, "recompute_trak/checkpoints/0/xtx") for r in (root, single)]
    tol = trak_score_tolerance([x], [t], [q], [xtx[1]], [xtx[0]], LAMBDA)
    got, want = runs["ranks"][0]["scores_recompute_trak"], runs["ref"]["scores_recompute_trak"]
    assert np.all(np.abs(got.astype(np.float64) - want) <= tol)
    assert tol.max() < 1e-3 * np.abs(want).max()


@needs_recompute
def test_recompute_ekfac_across_ranks_equals_one_process(runs):
    """EK-FAC with rows='recompute': the tolerance and its reasoning are the stored
    EK-FAC test's (float64 sums split across ranks, float32 rows)."""
    got, want = runs["ranks"][0]["scores_recompute_ekfac"], runs["ref"]["scores_recompute_ekfac"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@needs_recompute
@pytest.mark.parametrize("method", ["trak", "ekfac"])
def test_recompute_ranks_write_only_their_rows(runs, method):
    """rows='recompute' stores Q and the done flags of a rank's own rows, nothing else."""
    for rank, result in enumerate(runs["ranks"]):
        rows = chunk_shard(N_TRAIN, CHUNK_ROWS, rank=rank, world_size=WORLD)
        assert result[f"written_train_recompute_{method}"].tolist() == list(rows), rank
        assert not (runs["dist"] / f"recompute_{method}/checkpoints/0/grads").exists()


def test_replay_store_keeps_one_query_per_chunk(runs):
    """Under torchrun the replay's query rows are chunked one per row: the unit of the split."""
    chunks = zarr.open_array(str(runs["dist"] / "replay/experiments/q/0/grads"), mode="r").chunks
    assert chunks == (1, runs["ref"]["scores_replay"].shape[0])


def test_ranks_loading_different_weights_are_refused(runs):
    for rank, result in enumerate(runs["ranks"]):
        message = str(result["mismatch"])
        assert message.startswith("(model_id, checkpoint fingerprint) differs across ranks")
        assert "rank 0: (7, '" in message and "rank 1: (7, '" in message, rank


@pytest.mark.parametrize("model_id", [0, 1])
def test_features_bit_equal_to_one_process(runs, model_id):
    """Exact on any CPU: BATCH divides CHUNK_ROWS, so every rank featurizes the
    very batches one process does, with one thread, and rows are independent."""
    for name in ("grads", "out_to_loss", "done"):
        a = _array(runs["dist"], f"store/checkpoints/{model_id}/{name}")
        b = _array(runs["single"], f"store/checkpoints/{model_id}/{name}")
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert _array(runs["dist"], f"store/checkpoints/{model_id}/done").all()
    for name in ("grads", "done"):
        a = _array(runs["dist"], f"store/experiments/exp/{model_id}/{name}")
        b = _array(runs["single"], f"store/experiments/exp/{model_id}/{name}")
        assert np.array_equal(a, b), name


@pytest.mark.parametrize("model_id", [0, 1])
def test_xtx_is_the_all_reduce_of_rank_partials(runs, model_id):
    """Same arithmetic: each rank's one-GEMM X_rᵀX_r, then one float32 addition."""
    x = _array(runs["dist"], f"store/checkpoints/{model_id}/grads")
    stored = _array(runs["dist"], f"store/checkpoints/{model_id}/xtx")
    with one_thread():
        parts = []
        for rank in range(WORLD):
            rows = chunk_shard(N_TRAIN, CHUNK_ROWS, rank=rank, world_size=WORLD)
            parts.append(xtx_blocked(x[rows.start : rows.stop], block_rows=N_TRAIN, device="cpu"))
    assert np.array_equal(stored, (parts[0] + parts[1]).numpy())


@pytest.mark.parametrize("model_id", [0, 1])
def test_xtx_within_the_summation_bound_of_one_process(runs, model_id):
    """Tolerance: both runs sum the same n products in different orders.

    Any order of a float32 sum of n terms p_l has |fl(Σ p) - Σ p| <= γ_n Σ|p|
    (Higham, Accuracy and Stability, eq. 4.4; products of float32 numbers
    are exact in the float32 -> float32 GEMM's fused or rounded multiply, and
    a rounded multiply adds one u, covered by using γ_{n+1}). Each run is
    within that of the exact XᵀX, so they differ by at most
    2 γ_{n+1} (|X|ᵀ|X|)_ij (the final add of the two partials is one of the n
    additions, already counted).
    """
    x = _array(runs["dist"], f"store/checkpoints/{model_id}/grads").astype(np.float64)
    a = _array(runs["dist"], f"store/checkpoints/{model_id}/xtx").astype(np.float64)
    b = _array(runs["single"], f"store/checkpoints/{model_id}/xtx").astype(np.float64)
    bound = 2 * gamma(N_TRAIN + 1) * (np.abs(x).T @ np.abs(x))
    assert np.all(np.abs(a - b) <= bound)


def _checkpoints(root: Path, *, preconditioned: bool = False) -> list[CheckpointGrads]:
    base = "pre" if preconditioned else "store"
    ids = [0] if preconditioned else [0, 1]
    train = "features" if preconditioned else "grads"
    return [
        CheckpointGrads(
            train=_array(root, f"{base}/checkpoints/{m}/{train}"),
            targets=_array(root, f"{base}/experiments/exp/{m}/grads"),
            out_to_loss=_array(root, f"{base}/checkpoints/{m}/out_to_loss"),
            xtx=torch.from_numpy(_array(root, f"{base}/checkpoints/{m}/xtx")),
            preconditioned=preconditioned,
        )
        for m in ids
    ]


def _column_sharded(ckpts: list[CheckpointGrads], budget: int | None) -> np.ndarray:
    """One process scoring each rank's columns exactly as that rank does."""
    blocks = []
    with one_thread():
        for rank in range(WORLD):
            cols = column_shard(N_TARGETS, rank=rank, world_size=WORLD)
            mine = D.shard_checkpoint_targets(ckpts, cols)
            out = np.empty((N_TRAIN, len(cols)), dtype=np.float32) if budget else None
            blocks.append(score_checkpoints(mine, LAMBDA, budget, out=out, progress=False))
    return np.concatenate(blocks, axis=1)


@pytest.mark.parametrize(
    ("key", "budget", "preconditioned"),
    [("scores", None, False), ("scores_disk", SMALL_BUDGET, False), ("scores_pre", None, True)],
    ids=["in-memory", "on-disk-tiles", "del-grads"],
)
def test_scores_bit_equal_to_column_sharded_reference(runs, key, budget, preconditioned):
    ckpts = _checkpoints(runs["dist"], preconditioned=preconditioned)
    assert np.array_equal(runs["ranks"][0][key], _column_sharded(ckpts, budget))


def test_score_computer_path_bit_equal_to_column_sharded_reference(runs):
    """With TRAK's BasicScoreComputer: XᵀX reduced for the store, scores split by column."""
    root = runs["dist"] / "sc"
    model, *_ = problem()
    kw = {"proj_dim": PROJ_DIM, "chunk_rows": CHUNK_ROWS, "lambda_reg": LAMBDA, **QUIET}
    reader = TRAKer(
        model,
        "image_classification",
        N_TRAIN,
        save_dir=root,
        score_computer=BasicScoreComputer,
        **kw,
    )
    ckpts = [
        CheckpointGrads(
            train=_array(root, "checkpoints/0/grads"),
            targets=_array(root, "experiments/exp/0/grads"),
            out_to_loss=_array(root, "checkpoints/0/out_to_loss"),
        )
    ]
    with one_thread():
        blocks = [
            scores_with_computer(
                reader.score_computer,
                D.shard_checkpoint_targets(
                    ckpts, column_shard(N_TARGETS, rank=r, world_size=WORLD)
                ),
                device=reader.device,
            )
            for r in range(WORLD)
        ]
    assert np.array_equal(runs["ranks"][0]["scores_sc"], np.concatenate(blocks, axis=1))
    x = ckpts[0].train
    with one_thread():
        parts = [
            torch.from_numpy(x[s.start : s.stop]).T @ torch.from_numpy(x[s.start : s.stop])
            for s in (chunk_shard(N_TRAIN, CHUNK_ROWS, rank=r, world_size=WORLD) for r in range(2))
        ]
    assert np.array_equal(_array(root, "checkpoints/0/xtx"), (parts[0] + parts[1]).numpy())


def test_del_grads_features_bit_equal_to_row_sharded_reference(runs):
    """Each rank writes X_r (XᵀX + λI)⁻¹ for its own rows; same arithmetic here."""
    root = runs["dist"]
    assert not (root / "pre/checkpoints/0/grads").exists()
    feats = _array(root, "pre/checkpoints/0/features")
    grads = _array(runs["single"], "store/checkpoints/0/grads")  # bit-equal to the ranks'
    xtx = torch.from_numpy(_array(root, "pre/checkpoints/0/xtx"))
    inv = damped_inverse(xtx, LAMBDA)
    with one_thread():
        for rank in range(WORLD):
            rows = chunk_shard(N_TRAIN, CHUNK_ROWS, rank=rank, world_size=WORLD)
            ref = torch.from_numpy(grads[rows.start : rows.stop]) @ inv
            assert np.array_equal(feats[rows.start : rows.stop], ref.numpy())


def _score_tolerance(
    ckpts: list[CheckpointGrads], xtx_dist: list[np.ndarray], xtx_single: list[np.ndarray]
) -> np.ndarray:
    """Entrywise bound on |scores_2-rank - scores_1-process| (see trak_score_tolerance)."""
    return trak_score_tolerance(
        [ck.train for ck in ckpts],
        [ck.targets for ck in ckpts],
        [ck.out_to_loss for ck in ckpts],
        xtx_single,
        xtx_dist,
        LAMBDA,
    )


@pytest.mark.parametrize("key", ["scores", "scores_disk"], ids=["in-memory", "on-disk-tiles"])
def test_scores_within_derived_tolerance_of_one_process(runs, key):
    """Tolerance: the exact effect of the only differing input, plus float32 rounding.

    The two runs read bit-identical X, T, Q (tested above); their stored XᵀX
    differ (within the summation bound tested above). The bound, derived in
    ``tests/helpers/numerics.py::trak_score_tolerance``, is that difference's exact
    effect on the scores plus each run's float32 rounding.
    """
    ckpts = _checkpoints(runs["dist"])
    xtx_dist = [_array(runs["dist"], f"store/checkpoints/{m}/xtx") for m in (0, 1)]
    xtx_single = [_array(runs["single"], f"store/checkpoints/{m}/xtx") for m in (0, 1)]
    tol = _score_tolerance(ckpts, xtx_dist, xtx_single)
    diff = np.abs(runs["ranks"][0][key].astype(np.float64) - runs["ref"][key])
    assert np.all(diff <= tol)
    # The bound is informative, not vacuous: far below the scores themselves.
    assert tol.max() < 1e-3 * np.abs(runs["ref"][key]).max()


def test_on_disk_scores_are_the_stored_zarr_array(runs):
    arr = _array(runs["dist"], "store/scores/exp")
    assert np.array_equal(arr, runs["ranks"][0]["scores_disk"])
    assert zarr.open_array(str(runs["dist"] / "store/scores/exp")).chunks[1] == len(
        column_shard(N_TARGETS, rank=0, world_size=WORLD)
    )


# -- helpers, in one process ---------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "chunk", "world"), [(100, 16, 2), (7, 2, 3), (5, 10, 2), (0, 4, 2), (33, 1, 4)]
)
def test_chunk_shards_partition_rows_on_chunk_boundaries(n, chunk, world):
    shards = [chunk_shard(n, chunk, rank=r, world_size=world) for r in range(world)]
    assert [i for s in shards for i in s] == list(range(n))
    for s in shards:
        assert s.start % chunk == 0 and (s.stop % chunk == 0 or s.stop == n)
    sizes = [-(-len(s) // chunk) for s in shards]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize(("m", "world"), [(24, 2), (5, 3), (1, 4), (0, 2)])
def test_column_shards_partition_columns(m, world):
    shards = [column_shard(m, rank=r, world_size=world) for r in range(world)]
    assert [j for s in shards for j in s] == list(range(m))


def test_chunk_shard_sampler_yields_this_ranks_rows():
    sampler = ChunkShardSampler(10, 3, rank=1, world_size=2)
    assert list(sampler) == [6, 7, 8, 9] and len(sampler) == 4
    assert list(ChunkShardSampler(10, 3)) == list(range(10))  # no process group: everything


BAD_SHARDS = [
    ({"n_rows": -1, "chunk_rows": 2}, "`n_rows` must be a non-negative integer, got -1"),
    ({"n_rows": 4, "chunk_rows": 0}, "`chunk_rows` must be a positive integer, got 0"),
    ({"n_rows": 4, "chunk_rows": 2, "rank": 2, "world_size": 2}, r"`rank` must lie in \[0, 2\)"),
    ({"n_rows": 4, "chunk_rows": 2, "rank": 0}, "pass both `rank` and `world_size`"),
    ({"n_rows": 4, "chunk_rows": 2, "rank": 0, "world_size": 0}, "`world_size` must be a positive"),
    ({"n_rows": 4.0, "chunk_rows": 2}, "`n_rows` must be a non-negative integer, got 4.0"),
]


@pytest.mark.parametrize(("kwargs", "match"), BAD_SHARDS, ids=lambda v: str(v)[:40])
def test_chunk_shard_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        chunk_shard(**kwargs)


def test_column_shard_errors():
    with pytest.raises(ValueError, match="`n_columns` must be a non-negative int"):
        column_shard(-3)


def test_traker_chunk_rows_error(tmp_path):
    model, *_ = problem()
    with pytest.raises(ValueError, match=r"`chunk_rows` must be a positive integer or None.*got 0"):
        TRAKer(model, "image_classification", 10, save_dir=tmp_path, chunk_rows=0, **QUIET)


def test_row_window_refuses_strided_slices():
    window = D.RowWindow(np.arange(10), 2, 8)
    assert window.shape == (6,) and window[1:3].tolist() == [3, 4]
    with pytest.raises(TypeError, match="step-1 slices only"):
        window[::2]


def test_mismatch_across_ranks_names_every_rank(monkeypatch):
    monkeypatch.setattr(common, "all_gather_object", lambda value: [value, "other"])
    D.require_same_across_ranks("fingerprint", "other")  # equal: no error
    with pytest.raises(
        DistributedMismatchError, match=r"fingerprint differs across ranks \(rank 0: 'a', rank 1"
    ):
        D.require_same_across_ranks("fingerprint", "a")


def test_shard_loader_only_for_in_order_map_style_loaders():
    data = TensorDataset(torch.arange(10.0), torch.arange(10))
    loader = D.shard_loader(DataLoader(data, batch_size=3), np.array([4, 5, 6, 7]))
    assert loader is not None
    assert [b[1].tolist() for b in loader] == [[4, 5, 6], [7]]
    assert D.shard_loader(DataLoader(data, batch_size=3, shuffle=True), np.arange(3)) is None
    assert D.shard_loader(DataLoader(data, batch_size=3, drop_last=True), np.arange(3)) is None
    assert D.shard_loader([(torch.zeros(2),)], np.arange(2)) is None


def test_one_rank_group_equals_no_group(tmp_path, one_rank_group):
    """With a process group of one rank the distributed code path is the plain one."""
    assert D.is_distributed() and D.rank_and_world() == (0, 1)
    model, ckpts, x, y, xt, yt = problem()
    kw = {"proj_dim": PROJ_DIM, "chunk_rows": CHUNK_ROWS, "lambda_reg": LAMBDA, **QUIET}
    out = []
    for name in ("group", "plain"):
        if name == "plain":
            dist.destroy_process_group()
        traker = TRAKer(model, "image_classification", N_TRAIN, save_dir=tmp_path / name, **kw)
        traker.load_checkpoint(ckpts[0], model_id=0)
        traker.featurize_loader(DataLoader(TensorDataset(x, y), batch_size=BATCH))
        traker.finalize_features()
        traker.start_scoring_checkpoint("e", ckpts[0], model_id=0, num_targets=N_TARGETS)
        traker.score((xt, yt), num_samples=N_TARGETS)
        out.append(traker.finalize_scores("e"))
        if name == "plain":
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert np.array_equal(out[0], out[1])
    t = torch.arange(6.0).reshape(2, 3)
    assert D.all_reduce_sum_(t.clone()).equal(t)
    assert D.all_gather_columns(t, 3).equal(t)


def test_no_group_helpers_are_identities():
    assert not D.is_distributed()
    assert D.rank_and_world() == (0, 1)
    D.barrier()
    with D.rank_zero_first() as first:
        assert first
    t = torch.ones(2, 2)
    assert D.all_reduce_sum_(t) is t
    D.require_same_across_ranks("anything", object())


@pytest.mark.slow
def test_example_runs_under_torchrun(tmp_path):
    """``torchrun --nproc_per_node 2 examples/distributed_trak.py`` as the README shows it."""
    example = Path(__file__).resolve().parents[2] / "examples" / "distributed_trak.py"
    out = torchrun(example, "--save-dir", str(tmp_path / "trak"), nproc=WORLD, timeout=300)
    assert "2 rank(s): scores (1438, 128)" in out
    scores = zarr.open_array(str(tmp_path / "trak" / "scores" / "test"), mode="r")
    assert scores.shape == (1438, 128) and np.isfinite(scores[:]).all()
