"""The scoring cache: the damped factor and rows kept between query sets, counted in the plan.

Tolerances. A cached and an uncached call solve the targets with the same
function on the same inputs, so their right-hand sides ``R`` are equal and
they differ at most in how the GEMM ``(Q ⊙ X) Rᵀ`` blocks its rows (a
budget gives the cached call fewer bytes for its blocks). Each entry is a
length-``k`` dot product; any two summation orders of it in precision
``u`` lie within ``γ_k Σ_i |x_i r_i|`` of the exact sum (Higham, *Accuracy
and Stability of Numerical Algorithms*, eq. 3.5), so the two calls differ
by at most ``2 γ_k (|X| |R|ᵀ) ⊙ |Q|`` with ``γ_k = k u / (1 - k u)``. The
tests compute that bound entry by entry in float64 (:func:`_gemm_bound`).
Float64 stores are compared with the float64 formula (``u = 2⁻⁵³``).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch
import zarr

from gradsketch.attribution import TRAKer
from gradsketch.attribution import _score_cache as score_cache
from gradsketch.attribution._plan import AttributionPlan, cache_refusal
from gradsketch.attribution._score_cache import ScoringCache
from gradsketch.attribution._scores import CheckpointGrads, score_checkpoints

LOGGER = "gradsketch.attribution.TRAKer"


def _data(n=300, k=16, m=20, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g, dtype=torch.float64)
    t = torch.randn(m, k, generator=g, dtype=torch.float64)
    q = torch.rand(n, generator=g, dtype=torch.float64)
    return x.to(dtype), t.to(dtype), q.to(dtype)


def _reference(x, t, q, lam=0.0):
    """The formula, in float64: X (XᵀX + λI)⁻¹ Tᵀ ⊙ Q."""
    x, t, q = x.double(), t.double(), q.double()
    a = x.T @ x + lam * torch.eye(x.shape[1], dtype=torch.float64)
    return ((x @ torch.linalg.solve(a, t.T)) * q[:, None]).numpy()


def _gemm_bound(x, t, q, lam, u):
    """``2 γ_k (|X| |R|ᵀ) ⊙ |Q|`` (module docstring), R the solved targets, in float64."""
    x, t, q = x.double(), t.double(), q.double()
    a = x.T @ x + lam * torch.eye(x.shape[1], dtype=torch.float64)
    r = torch.linalg.solve(a, t.T).T
    k = x.shape[1]
    gamma = k * u / (1 - k * u)
    return (2 * gamma * (x.abs() @ r.abs().T) * q.abs()[:, None]).numpy()


def _zarr(tmp_path, name, a):
    z = zarr.create_array(str(tmp_path / name), shape=a.shape, dtype=str(a.dtype), chunks=(64, 16))
    z[:] = a
    return z


def _admit_all(held, extra):
    return None


def _score(x, t, q, xtx, lam, cache=None, budget=None):
    ck = CheckpointGrads(x, t, q, xtx=xtx, cache=cache)
    return score_checkpoints([ck], lam, budget, progress=False)


@pytest.mark.parametrize("lam", [0.0, 0.3])
def test_cached_float64_scores_equal_the_formula_and_the_uncached_path(tmp_path, lam):
    x, t, q = _data()
    train = _zarr(tmp_path, "x.zarr", x.numpy())
    xtx = x.T @ x
    cache = ScoringCache(_admit_all, logging.getLogger("test"))
    first = _score(train, t, q, xtx, lam, cache.handle(0))
    second = _score(train, t[:7], q, xtx, lam, cache.handle(0))
    assert cache.made == 1 and cache.reused == 1
    assert cache.nbytes == 8 * 16 * 16 + 300 * 16 * 8  # the float64 factor and rows
    for got, targets in ((first, t), (second, t[:7])):
        ref = _reference(x, targets, q, lam)
        # Rows and targets are multiplied in float64, but XᵀX is factorised from its float32
        # rounding (relative 6e-8, times cond(XᵀX + λI) < 10 here) and the scores are float32.
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())
        np.testing.assert_array_equal(got, _score(train, targets, q, xtx, lam))


@pytest.mark.parametrize("budget", [None, 50_000])
def test_cached_float32_scores_within_the_gemm_bound_of_the_uncached(tmp_path, budget):
    x, t, q = _data(dtype=torch.float32)
    train = _zarr(tmp_path, "x.zarr", x.numpy())
    xtx = x.T @ x
    lam = 0.1
    cache = ScoringCache(lambda held, extra: cache_refusal(_plan(), budget, held, extra), _log())
    plain = _score(train, t, q, xtx, lam, budget=budget)
    _score(train, t, q, xtx, lam, cache.handle(0), budget)
    again = _score(train, t, q, xtx, lam, cache.handle(0), budget)
    assert cache.reused == 1
    # With the budget (50 kB: the cache may take 25 kB) the 2 kB factor and the 19 kB rows are
    # kept; the blocks get the other 29 kB (the uncached call 50 kB less XᵀX's 6 kB).
    assert cache.nbytes == 8 * 16 * 16 + 300 * 16 * 4
    bound = _gemm_bound(x, t, q, lam, 2.0**-24)
    assert (np.abs(again.astype(np.float64) - plain) <= bound).all()
    ref = _reference(x, t, q, lam)
    np.testing.assert_allclose(again, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


def _plan(**kw):
    return AttributionPlan(method="trak", train_set_size=300, curvature_at_finalize=True, **kw)


def _log():
    return logging.getLogger("test.score_cache")


@pytest.mark.parametrize(
    ("budget", "available", "held", "extra", "fits"),
    [
        (1000, None, 0, 500, True),
        (1000, None, 400, 101, False),
        (None, None, 0, 10**12, True),
        (None, 10_000, 0, 10_000 - 1_000, True),
        (None, 10_000, 0, 10_000 - 999, False),
        (None, 10_000, 5_000, 4_001, False),
    ],
    ids=["half-budget", "over-half", "unknown-memory", "fits-memory", "over-memory", "held"],
)
def test_cache_refusal_counts_what_is_held(budget, available, held, extra, fits):
    plan = _plan(working_bytes=1_000, available_memory=available)
    reason = cache_refusal(plan, budget, held, extra)
    assert (reason is None) == fits
    if not fits:
        assert ("memory_budget" in reason) == (budget is not None)


def test_key_misses_on_another_lambda_gram_or_checkpoint(tmp_path):
    x, t, q = _data(dtype=torch.float32)
    train = _zarr(tmp_path, "x.zarr", x.numpy())
    xtx = x.T @ x
    cache = ScoringCache(_admit_all, _log())
    _score(train, t, q, xtx, 0.1, cache.handle(0))
    _score(train, t, q, xtx, 0.2, cache.handle(0))  # another λ
    assert (cache.made, cache.reused) == (2, 0)
    other = xtx.clone()
    other[0, 0] += 1.0  # a refinalized checkpoint's XᵀX
    got = _score(train, t, q, other, 0.2, cache.handle(0))
    assert (cache.made, cache.reused) == (3, 0)
    np.testing.assert_array_equal(got, _score(train, t, q, other, 0.2))
    _score(train, t, q, xtx, 0.2, cache.handle(1))  # another checkpoint: its own entry
    assert cache.made == 4 and cache.nbytes == 2 * (8 * 16 * 16 + 300 * 16 * 4)
    cache.forget(1)
    assert cache.nbytes == 8 * 16 * 16 + 300 * 16 * 4
    cache.forget()
    assert cache.nbytes == 0


def test_disabled_cache_keeps_nothing(tmp_path):
    x, t, q = _data(dtype=torch.float32)
    cache = ScoringCache(_admit_all, _log(), enabled=False)
    train = _zarr(tmp_path, "x.zarr", x.numpy())
    for _ in range(2):
        _score(train, t, q, x.T @ x, 0.1, cache.handle(0))
    assert (cache.made, cache.reused, cache.nbytes) == (2, 0, 0)


def test_rows_already_in_torch_are_not_copied():
    x, t, q = _data(dtype=torch.float32)
    cache = ScoringCache(_admit_all, _log())
    _score(x, t, q, x.T @ x, 0.1, cache.handle(0))
    assert cache.nbytes == 8 * 16 * 16  # the factor only


# -- through TRAKer ------------------------------------------------------------------------
N, K, M = 240, 64, 12


def _traker(tmp_path, name="store", **kwargs):
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(K // 2, 4, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.randn(4, K // 2, generator=g))
    x = torch.randn(N, K // 2, generator=g)
    y = torch.randint(0, 4, (N,), generator=g)
    traker = TRAKer(
        model,
        "image_classification",
        N,
        save_dir=tmp_path / name,
        device="cpu",
        proj_dim=K,
        use_half_precision=False,
        progress=False,
        **kwargs,
    )
    return traker, model, x, y


def _featurize(traker, model, x, y, ids=(0,)):
    for model_id in ids:
        traker.load_checkpoint(model.state_dict(), model_id=model_id)
        traker.featurize((x, y), num_samples=N)
    traker.finalize_features()


def _query(traker, model, x, y, name, rows, ids=(0,)):
    for model_id in ids:
        traker.start_scoring_checkpoint(name, model.state_dict(), model_id=model_id, num_targets=M)
        traker.score((x[rows], y[rows]), num_samples=M)
    return np.asarray(traker.finalize_scores(name))


def test_traker_second_query_set_reuses_the_factor_and_rows(tmp_path):
    """Two checkpoints, three query sets: scores equal an uncached TRAKer's, bit for bit.

    Without a budget both read X in the same blocks, so the GEMM bound of the
    module docstring is 0 here (checked exactly).
    """
    ours, model, x, y = _traker(tmp_path, "cached")
    plain, *_ = _traker(tmp_path, "plain")
    plain._method.score_cache.enabled = False
    for t in (ours, plain):
        _featurize(t, model, x, y, ids=(0, 1))
    for name, rows in (("a", slice(0, M)), ("b", slice(M, 2 * M)), ("c", slice(0, M))):
        got = _query(ours, model, x, y, name, rows, ids=(0, 1))
        np.testing.assert_array_equal(got, _query(plain, model, x, y, name, rows, ids=(0, 1)))
    cache = ours._method.score_cache
    assert (cache.made, cache.reused) == (2, 4)
    held = 2 * (8 * K * K + N * K * 4)
    assert cache.nbytes == held
    assert ours.plan.cache_bytes == held
    assert ours.plan.stage_bytes("finalize") - plain.plan.stage_bytes("finalize") == held
    assert "scoring cache" in str(ours.plan)


def test_traker_forgets_a_checkpoint_it_loads_or_finalizes(tmp_path):
    ours, model, x, y = _traker(tmp_path)
    _featurize(ours, model, x, y, ids=(0, 1))
    _query(ours, model, x, y, "a", slice(0, M), ids=(0, 1))
    cache = ours._method.score_cache
    one = 8 * K * K + N * K * 4
    assert cache.nbytes == 2 * one
    ours.load_checkpoint(model.state_dict(), model_id=1)  # its rows may be featurized again
    assert cache.nbytes == one
    ours.finalize_features(model_ids=[0])  # already finalized: nothing changes
    _query(ours, model, x, y, "b", slice(0, M), ids=(0, 1))
    assert cache.nbytes == 2 * one and cache.made == 3


def test_traker_featurized_again_scores_the_new_rows(tmp_path, monkeypatch):
    """Rows featurized again in another order: same XᵀX up to rounding, new X; scores follow.

    Every XᵀX is given the same CRC here, so only the TRAKer's forgetting the
    checkpoint it loads keeps the old rows out.
    """
    monkeypatch.setattr(score_cache, "gram_crc", lambda xtx: 0)
    ours, model, x, y = _traker(tmp_path, "store")
    _featurize(ours, model, x, y)
    _query(ours, model, x, y, "a", slice(0, M))
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(1))
    again, *_ = _traker(tmp_path, "store", load_from_save_dir=False)
    again._method.score_cache = ours._method.score_cache  # the same cache, as one process
    _featurize(again, model, x[perm], y[perm])
    got = _query(again, model, x, y, "b", slice(0, M))
    fresh, *_ = _traker(tmp_path, "fresh")
    fresh._method.score_cache.enabled = False
    _featurize(fresh, model, x[perm], y[perm])
    np.testing.assert_array_equal(got, _query(fresh, model, x, y, "b", slice(0, M)))


def test_traker_caches_only_what_fits_the_budget_and_logs_once(tmp_path, caplog):
    factor = 8 * K * K
    # Half of it holds the factor, not the rows: only the factor is cached.
    budget = 2 * (factor + N * K * 4 // 2)
    ours, model, x, y = _traker(tmp_path, memory_budget=budget)
    _featurize(ours, model, x, y)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        first = _query(ours, model, x, y, "a", slice(0, M))
        second = _query(ours, model, x, y, "b", slice(0, M))
    refusals = [r for r in caplog.records if "not caching" in r.getMessage()]
    assert len(refusals) == 1 and "training rows" in refusals[0].getMessage()
    assert "memory_budget" in refusals[0].getMessage()
    assert ours._method.score_cache.nbytes == factor == ours.plan.cache_bytes
    np.testing.assert_array_equal(first, second)


def test_traker_skips_the_cache_where_available_memory_is_short(tmp_path, caplog):
    ours, model, x, y = _traker(tmp_path)
    _featurize(ours, model, x, y)
    need = ours.plan.stage_bytes("finalize")
    # The first batch's plan saw room for the factor beside the finalize stage, not the rows.
    ours._plan = dataclasses.replace(ours._plan, available_memory=need + 8 * K * K + N * K)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _query(ours, model, x, y, "a", slice(0, M))
        _query(ours, model, x, y, "b", slice(0, M))
    refusals = [r for r in caplog.records if "not caching" in r.getMessage()]
    assert len(refusals) == 1 and "available" in refusals[0].getMessage()
    assert ours.plan.cache_bytes == 8 * K * K


def test_blocks_that_do_not_fit_beside_the_cache_get_the_whole_budget(tmp_path):
    """Checkpoint 0's factor is cached, checkpoint 1's is not (it forms its XᵀX, 6 kB at
    k = 16): 7 kB less the 2 kB factor is too little for the blocks, 7 kB is enough. The
    cache lets go, and the scores are the uncached call's (same budget, same blocks)."""
    x, t, q = _data(dtype=torch.float32)
    trains = [_zarr(tmp_path, f"x{i}.zarr", (x * (i + 1)).numpy()) for i in range(2)]
    xtxs = [(x * (i + 1)).T @ (x * (i + 1)) for i in range(2)]
    cache = ScoringCache(lambda held, extra: None if held == 0 else "full", _log())

    def run(handles):
        cks = [CheckpointGrads(a, t, q, xtx=g, cache=h) for a, g, h in zip(trains, xtxs, handles)]
        out = np.zeros((300, 20), dtype=np.float32)
        return score_checkpoints(cks, 0.1, 7_000, out=out, progress=False)

    got = run([cache.handle(0), cache.handle(1)])
    assert cache.nbytes == 0 and cache.made == 2
    np.testing.assert_array_equal(got, run([None, None]))
