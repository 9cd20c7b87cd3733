"""trak_scores and score computers against float64 references."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
import zarr

from gradsketch.attribution import (
    BasicScoreComputer,
    BasicSingleBlockScoreComputer,
    MemoryBudgetError,
    trak_scores,
)
from gradsketch.attribution import _linalg as linalg
from gradsketch.attribution._io import block_plan, iter_row_blocks
from gradsketch.attribution._linalg import (
    bf16x3_error_bound,
    damped_inverse,
    matmul_nt,
    resolve_lambda,
    xtx_blocked,
)
from gradsketch.attribution._scores import CheckpointGrads, score_checkpoints


def _data(n=60, k=6, m=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g, dtype=torch.float64)
    t = torch.randn(m, k, generator=g, dtype=torch.float64)
    q = torch.rand(n, generator=g, dtype=torch.float64)
    return x, t, q


def _reference(x, t, q, lam=0.0):
    """The formula, in float64: X (XᵀX + λI)⁻¹ Tᵀ ⊙ Q."""
    a = x.T @ x + lam * torch.eye(x.shape[1], dtype=torch.float64)
    return (x @ torch.linalg.solve(a, t.T)) * q[:, None]


@pytest.mark.parametrize("order", ["auto", "targets", "train"])
@pytest.mark.parametrize("lam", [0.0, 0.5])
def test_trak_scores_matches_float64_formula(order, lam):
    x, t, q = _data()
    got = trak_scores(x.float(), t.float(), q.float(), lambda_reg=lam, apply_inverse_to=order)
    ref = _reference(x, t, q, lam).numpy()
    # float32 inputs (rel. 6e-8) through a well-conditioned solve (cond(XᵀX) < 10 here).
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


def test_inverse_on_targets_equals_inverse_on_train():
    x, t, q = _data(n=200, k=16, m=30, seed=1)
    a = trak_scores(x.float(), t.float(), q.float(), apply_inverse_to="targets")
    b = trak_scores(x.float(), t.float(), q.float(), apply_inverse_to="train")
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * np.abs(a).max())


def test_inputs_numpy_memmap_zarr_agree(tmp_path):
    x, t, q = _data()
    xs, ts, qs = x.float().numpy(), t.float().numpy(), q.float().numpy()
    mm = np.lib.format.open_memmap(tmp_path / "x.npy", mode="w+", dtype=np.float32, shape=xs.shape)
    mm[:] = xs
    z = zarr.create_array(str(tmp_path / "x.zarr"), shape=xs.shape, dtype="float32", chunks=(7, 6))
    z[:] = xs
    base = trak_scores(torch.from_numpy(xs), torch.from_numpy(ts), torch.from_numpy(qs))
    for train in (xs, mm, z):
        # Exact: the same float32 rows in the same blocks, whatever holds them.
        np.testing.assert_array_equal(trak_scores(train, ts, qs[:, None]), base)


def test_memory_budget_streams_to_disk(tmp_path):
    x, t, q = _data(n=300, k=8, m=40, seed=2)
    full = trak_scores(x.float(), t.float(), q.float())
    matrix_bytes = 4 * 300 * 40
    budget = 24 * 8 * 8 + 2_000  # far below the 48,000-byte score matrix
    assert budget < matrix_bytes / 10
    n_block, m_block = block_plan(300, 40, 8, 1, budget)
    assert n_block < 300 and m_block < 40  # really tiled in both directions
    out = trak_scores(x.float(), t.float(), q.float(), memory_budget=budget, out=tmp_path / "s")
    assert isinstance(out, zarr.Array)
    np.testing.assert_allclose(out[:], full, rtol=1e-5, atol=1e-6 * np.abs(full).max())


def test_memory_budget_without_destination_is_refused():
    x, t, q = _data(n=300, k=8, m=40)
    with pytest.raises(MemoryBudgetError, match=r"needs 48000 bytes.*`memory_budget`=3536.*out="):
        trak_scores(x.float(), t.float(), q.float(), memory_budget=24 * 64 + 2000)


def test_memory_budget_too_small_for_proj_dim():
    x, t, q = _data()
    with pytest.raises(ValueError, match="`memory_budget`=10 bytes is too small"):
        trak_scores(x.float(), t.float(), q.float(), memory_budget=10, out=np.zeros((60, 5)))


def test_lambda_auto_is_tenth_of_mean_eigenvalue():
    x, t, q = _data()
    xtx = (x.T @ x).float()
    lam = resolve_lambda("auto", xtx)
    assert lam == pytest.approx(0.1 * torch.linalg.eigvalsh(x.T @ x).mean().item(), rel=1e-5)
    got = trak_scores(x.float(), t.float(), q.float(), lambda_reg="auto")
    np.testing.assert_allclose(got, _reference(x, t, q, lam).numpy(), rtol=1e-4, atol=1e-6)


def test_rank_deficient_falls_back_to_pseudo_inverse(caplog):
    x, t, q = _data(n=4, k=6)  # fewer rows than columns: XᵀX is singular
    got = trak_scores(x.float(), t.float(), q.float())
    ref = (x @ torch.linalg.pinv(x.T @ x) @ t.T * q[:, None]).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-3, atol=1e-4 * np.abs(ref).max())
    assert "pseudo-inverse" in caplog.text


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param(
            {"lambda_reg": -1.0}, "`lambda_reg` must be a finite number >= 0", id="neg-lambda"
        ),
        pytest.param({"lambda_reg": "big"}, "`lambda_reg` must be", id="str-lambda"),
        pytest.param({"apply_inverse_to": "both"}, "`apply_inverse_to` must be one of", id="order"),
        pytest.param({"precision": "fp8"}, "`precision` must be one of", id="precision"),
        pytest.param({"memory_budget": 0}, "`memory_budget` must be a positive", id="budget"),
    ],
)
def test_trak_scores_argument_errors(kwargs, match):
    x, t, q = _data()
    with pytest.raises(ValueError, match=match):
        trak_scores(x.float(), t.float(), q.float(), **kwargs)


@pytest.mark.parametrize(
    ("shapes", "match"),
    [
        pytest.param(((60, 6), (5, 7), (60,)), "`target_grads` has shape", id="target-k"),
        pytest.param(((60, 6), (5, 6), (59,)), "`out_to_loss` has shape", id="q-len"),
    ],
)
def test_trak_scores_shape_errors(shapes, match):
    x, t, q = (torch.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        trak_scores(x, t, q)


def test_out_with_wrong_shape():
    x, t, q = _data()
    with pytest.raises(ValueError, match="`out` has shape"):
        trak_scores(x.float(), t.float(), q.float(), out=np.zeros((3, 3)))


@pytest.mark.parametrize("path", ["blas_syrk", "torch_tiles"])
def test_xtx_blocked_symmetric_tiles_match_float64(path, monkeypatch):
    """Both CPU paths (SciPy's BLAS syrk, torch's upper tiles) against float64.

    float32: each of the 37 products and partial sums rounds by at most 2^-24
    relative, so ``|err| <= 37 · 2^-23 · max|XᵀX|`` is a safe entrywise bound
    whatever order BLAS sums in. The mirrored result is exactly symmetric.
    """
    if path == "torch_tiles":
        monkeypatch.setattr(linalg, "_blas_syrk", lambda out: None)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 50, generator=g, dtype=torch.float64)
    got = xtx_blocked(x.float(), block_rows=10, device=torch.device("cpu"), tile=8)
    ref = x.T @ x
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=37 * 2**-23 * ref.abs().max().item())
    assert torch.equal(got, got.T)
    got64 = xtx_blocked(x, block_rows=10, device=torch.device("cpu"), dtype=torch.float64, tile=8)
    torch.testing.assert_close(got64, ref, rtol=0, atol=37 * 2**-52 * ref.abs().max().item())


def test_bf16x3_within_derived_bound():
    """bf16x3 error bound (see matmul_nt): |err| <= (3·2^-16 + 2k·2^-24) (|A||B|ᵀ).

    Each operand is split a = hi + lo + r with |r| <= 2^-16 |a| (two bfloat16
    pieces hold 16 of 24 significand bits); the dropped products lo·lo, r·b and
    a·r are each below 2^-16 |a||b|; float32 accumulation of k products adds at
    most k·2^-24 |a||b| (twice, for the three-fold inner dimension, rounded
    up). The bound is deterministic, so the test checks every entry.
    """
    g = torch.Generator().manual_seed(4)
    a = torch.randn(64, 96, generator=g)
    b = torch.randn(48, 96, generator=g)
    got = matmul_nt(a, b, "bf16x3").double()
    ref = a.double() @ b.double().T
    assert torch.all((got - ref).abs() <= bf16x3_error_bound(a, b))


def test_bf16x3_scores_close_to_float32():
    x, t, q = _data(n=400, k=32, m=20, seed=5)
    a = trak_scores(x.float(), t.float(), q.float(), precision="bf16x3")
    b = trak_scores(x.float(), t.float(), q.float(), precision="float32")
    for j in range(20):
        assert np.corrcoef(a[:, j], b[:, j])[0, 1] > 0.99999


@pytest.mark.parametrize("computer", [BasicScoreComputer, BasicSingleBlockScoreComputer])
@pytest.mark.parametrize("lam", [0.0, 0.3])
def test_score_computers_match_float64(computer, lam):
    x, t, _ = _data()
    kwargs = {"CUDA_MAX_DIM_SIZE": 7} if computer is BasicScoreComputer else {}
    sc = computer(torch.float32, "cpu", lambda_reg=lam, **kwargs)
    xtx = sc.get_xtx(x.float())
    torch.testing.assert_close(xtx.double(), x.T @ x, rtol=1e-5, atol=1e-4)
    feats = sc.get_x_xtx_inv(x.float(), xtx)
    a = x.T @ x + lam * torch.eye(6, dtype=torch.float64)
    torch.testing.assert_close(feats.double(), x @ torch.linalg.inv(a), rtol=1e-4, atol=1e-5)
    acc = torch.zeros(60, 5)
    sc.get_scores(feats, t.float(), accumulator=acc)
    sc.get_scores(feats, t.float(), accumulator=acc)  # accumulates
    torch.testing.assert_close(
        acc.double(),
        2 * _reference(x, t, torch.ones(60, dtype=torch.float64), lam),
        rtol=1e-4,
        atol=1e-4,
    )


def test_basic_score_computer_errors():
    with pytest.raises(ValueError, match="`CUDA_MAX_DIM_SIZE` must be a positive integer"):
        BasicScoreComputer(torch.float32, "cpu", CUDA_MAX_DIM_SIZE=0)
    with pytest.raises(ValueError, match="`lambda_reg` must be"):
        BasicScoreComputer(torch.float32, "cpu", lambda_reg=-2)


def test_zero_columns_are_inverted_on_the_live_block():
    """Empty count-sketch buckets give zero columns; λ=0 then equals the float64 pinv."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(30, 6, generator=gen, dtype=torch.float64)
    x[:, [1, 4]] = 0
    xtx = x.T @ x
    got = damped_inverse(xtx, 0.0)
    assert torch.equal(got[[1, 4]], torch.zeros(2, 6, dtype=torch.float64))
    ref = torch.linalg.pinv(xtx, hermitian=True)
    # Both float64 inverses are within k κ u ||A⁻¹|| of the exact one (k=4 live
    # columns, κ < 10 for 30 Gaussian rows, u = 2⁻⁵³): 1e-12 ||A⁻¹|| bounds both.
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12 * float(ref.abs().max()))


def test_zarr_rows_prefetched_and_copied_give_identical_scores(tmp_path):
    """Reading rows from zarr in prefetched blocks and mirroring tiles change no bit."""
    x, t, q = _data(n=300, k=8)
    x, t, q = x.float(), t.float(), q.float()
    arr = zarr.create_array(str(tmp_path / "x"), shape=(300, 8), dtype="float32", chunks=(7, 8))
    arr[:] = x.numpy()
    blocks = list(iter_row_blocks(arr, 64, device=torch.device("cpu"), dtype=torch.float32))
    assert [(a, b) for a, b, _ in blocks] == [(i, min(300, i + 64)) for i in range(0, 300, 64)]
    assert torch.equal(torch.cat([blk for _, _, blk in blocks]), x)
    mirror = zarr.create_array(str(tmp_path / "s"), shape=(300, 5), dtype="float32", chunks=(50, 5))
    from_tensor = trak_scores(x, t, q)
    ckpt = [CheckpointGrads(arr, t, q)]
    from_zarr = score_checkpoints(ckpt, progress=False, copy_to=mirror)
    np.testing.assert_array_equal(from_zarr, from_tensor)
    np.testing.assert_array_equal(mirror[:], from_tensor)
    with pytest.raises(ValueError, match=r"`copy_to` has shape \(3, 5\); the scores need"):
        score_checkpoints(ckpt, progress=False, copy_to=np.zeros((3, 5), dtype=np.float32))


def test_auto_precision_is_float32_and_bad_values_are_named():
    """Precision "auto" keeps float32 (bf16x3 measured slower on an AMX CPU)."""
    from gradsketch.attribution._linalg import resolve_precision

    assert resolve_precision("auto", torch.device("cpu")) == "float32"
    assert resolve_precision("bf16x3", torch.device("cpu")) == "bf16x3"
    with pytest.raises(ValueError, match=r"`precision` must be one of .* got 'fp8'"):
        resolve_precision("fp8", torch.device("cpu"))


def _spectrum(k: int, lowest: float, seed: int = 0) -> torch.Tensor:
    """A float64 symmetric ``[k, k]`` with eigenvalues ``lowest, ..., 1`` in a random basis."""
    g = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(k, k, generator=g, dtype=torch.float64))
    evals = torch.logspace(0, float(np.log10(lowest)), k, dtype=torch.float64)
    return (basis * evals) @ basis.T


@pytest.mark.parametrize("k", [8, 96])
def test_rounding_gate_certifies_the_eigh_cutoff(k):
    """The Cholesky gate passes exactly where it can prove no eigenvalue is noise.

    eigh's cutoff is ``λ_max k eps`` (float32 eps, λ_max = 1 here). Below it
    by 2x the gate must refuse (a shifted Cholesky of an indefinite matrix,
    whose negative eigenvalue -k eps / 2 dwarfs float64 rounding, cannot
    complete). Above the gate's own shift, ``ub k eps (1 + O(k u64))`` with
    ``ub <= ‖A‖_F <= sqrt(k)``, by 2x it must pass.
    """
    eps = torch.finfo(torch.float32).eps
    assert not linalg._clear_of_rounding(_spectrum(k, 0.5 * k * eps), eps)
    assert linalg._clear_of_rounding(_spectrum(k, 2 * k**1.5 * eps * 1.01), eps)


@pytest.mark.parametrize("scipy_lapack", [True, False], ids=["dpotri", "torch-triangular"])
def test_cholesky_inverse_path_matches_float64(scipy_lapack, monkeypatch):
    """Well-conditioned XᵀX takes the Cholesky path (eigh is not called) on both backends.

    A = XᵀX + 0.5 I from 400 Gaussian rows of 96 columns: κ(A) < 4 (its
    eigenvalues lie near (√400 ± √96)²). A float64 Cholesky inverse is within
    ``c k κ u ‖A⁻¹‖`` of the exact one (k=96, u=2⁻⁵³: below 1e-12 ‖A⁻¹‖ with
    room); rounding the result to float32 adds 2⁻²⁴ relative per entry.
    """
    if not scipy_lapack:
        monkeypatch.setitem(sys.modules, "scipy.linalg", None)

    def no_eigh(*args, **kwargs):
        raise AssertionError("well-conditioned input went to eigh")

    monkeypatch.setattr(torch.linalg, "eigh", no_eigh)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(400, 96, generator=g, dtype=torch.float64)
    xtx = (x.T @ x).float()
    got = damped_inverse(xtx, 0.5)
    ref = torch.linalg.inv(xtx.double() + 0.5 * torch.eye(96, dtype=torch.float64))
    assert got.dtype == torch.float32 and torch.equal(got, got.T)
    torch.testing.assert_close(got.double(), ref, rtol=2**-24, atol=1e-12 * float(ref.abs().max()))


@pytest.mark.parametrize("m", [5, 9], ids=["weights-on-scores", "weights-on-rows"])
@pytest.mark.parametrize("checkpoints", [1, 2])
def test_out_to_loss_weighting_either_side_matches_float64(m, checkpoints):
    """Q/C scales the score tile when ``m <= C k``, else each checkpoint's rows (k=6).

    Both orders are float32 products of the same factors, so the tolerance of
    :func:`test_trak_scores_matches_float64_formula` applies.
    """
    ckpts, ref = [], 0.0
    for c in range(checkpoints):
        x, t, q = _data(m=m, seed=10 + c)
        ckpts.append(CheckpointGrads(x.float(), t.float(), q.float()))
        ref = ref + x @ torch.linalg.solve(x.T @ x, t.T)
    q_mean = sum(ck.out_to_loss.double() for ck in ckpts) / checkpoints
    ref = (ref / checkpoints * q_mean[:, None]).numpy()
    got = score_checkpoints(ckpts, progress=False)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize(
    ("threads", "cores", "expected"),
    [(1, 2, 1), (2, 2, 1), (2, 16, 2), (16, 16, 15), (4, 2, 3)],
)
def test_blas_threads_leave_a_core_to_torch_when_it_takes_them_all(
    threads, cores, expected, monkeypatch
):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    monkeypatch.setattr(linalg.os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert linalg.blas_thread_count() == expected


def test_targets_are_blocked_by_bytes_without_a_budget():
    """No budget: every target of a projected store in one block, a few dense ones at a time.

    A model's dense per-layer gradients (GPT-2 small: 85M numbers, 341 MB per target)
    would otherwise all be held at once, with their solved copies.
    """
    from gradsketch.attribution._io import DEFAULT_TARGET_BYTES

    assert block_plan(10, 1_000, 2_048, 3, None) == (10, 1_000)
    n_block, m_block = block_plan(10, 16, 85_000_000, 1, None)
    assert n_block == 10
    assert m_block == DEFAULT_TARGET_BYTES // (4 * 85_000_000) == 3


def test_a_solve_needs_no_budget_for_a_gram_matrix(tmp_path):
    """With a preconditioner's solve no XᵀX is formed: a budget far below 24 k² bytes
    tiles the scores, which equal the float64 formula X P⁻¹ Tᵀ ⊙ Q.

    Tolerance: float32 dot products of k = 4,096 unit-scale terms err by about
    k u ≈ 2.4e-4 (u = 2⁻²⁴, random-sign accumulation); atol is 1e-5 of the largest
    score (about 2e-3 here, whose scores reach ~200)."""
    n, k, m = 50, 4_096, 6
    x, t, q = _data(n=n, k=k, m=m, seed=3)
    scale = torch.linspace(0.5, 2.0, k, dtype=torch.float64)
    expected = (x @ (t * scale).T) * q[:, None]
    budget = 4 * (k * 3 + k + 2) * 2 + 4_096  # ~0.1 MB against 24 k² = 403 MB
    with pytest.raises(ValueError, match="too small"):
        block_plan(n, m, k, 1, budget)  # as TRAK's Gram matrix would need
    n_block, m_block = block_plan(n, m, k, 1, budget, gram=False)
    assert n_block < n and m_block < m
    ck = CheckpointGrads(x.float(), t.float(), q.float(), solve=lambda r: r * scale.float())
    out = score_checkpoints([ck], memory_budget=budget, out=tmp_path / "s", progress=False)
    np.testing.assert_allclose(
        out[:], expected.numpy(), rtol=1e-4, atol=1e-5 * expected.abs().max()
    )
