"""One engine for every method: input forms, parameter choices, per-token scores, top-k,
and a user-registered preconditioner, on a tiny padded GPT-2 and a small MLP.

Every method (TRAK's Gram matrix, identity, K-FAC, EK-FAC) goes through the same
store flow, so the same rows given as tuples, dicts, a ``datasets.Dataset`` (with
``batch_size``) or through ``featurize_loader`` must give identical scores, and the
ways of naming the same weights (one ``|``-joined glob, a list, a ``ParamMask``) the
same store settings and scores.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch import Tensor

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from gradsketch.attribution import (  # noqa: E402
    CURVATURE_PRECONDITIONERS,
    CurvaturePreconditioner,
    FeatureBatch,
    TrainRows,
    TRAKer,
    register_curvature_preconditioner,
)
from gradsketch.masked import ParamMask  # noqa: E402
from helpers.hf_families import tiny_gpt2  # noqa: E402

METHODS = ["trak", "identity", "kfac", "ekfac"]
N, M, SEQ, VOCAB = 8, 3, 8, 32
WEIGHTS = ["transformer.h.0.attn.c_attn.weight", "transformer.h.0.mlp.c_fc.weight"]


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=SEQ, pad_token_id=0
    )
    return transformers.GPT2LMHeadModel(config).eval()


def _tokens(n: int, seed: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, SEQ), generator=gen)
    mask = torch.ones_like(ids)
    mask[n // 2 :, SEQ // 2 :] = 0  # half of the rows padded on the right
    return ids, mask


def _traker(path, model, method, **kw):
    return TRAKer(
        model,
        "language_modeling",
        N,
        save_dir=path,
        device="cpu",
        proj_dim=64,
        lambda_reg="auto" if method != "trak" else 0.1,
        method=method,
        progress=False,
        logging_level=logging.WARNING,
        chunk_rows=4,
        **kw,
    )


def _scores(path, method, form, *, per_token=False, **kw):
    model = _gpt2()
    state = model.state_dict()
    ids, mask = _tokens(N, 0)
    q_ids, q_mask = _tokens(M, 1)
    traker = _traker(path, model, method, **kw)
    traker.load_checkpoint(state, model_id=0)
    if form == "tuple":
        for s in range(0, N, 4):
            traker.featurize((ids[s : s + 4], mask[s : s + 4]), num_samples=4)
    elif form == "dict":
        for s in range(0, N, 4):
            traker.featurize(
                {"input_ids": ids[s : s + 4], "attention_mask": mask[s : s + 4]}, num_samples=4
            )
    elif form == "dataset":
        rows = [r[m.bool()].tolist() for r, m in zip(ids, mask)]  # ragged: padded by the loader
        traker.featurize_loader(datasets.Dataset.from_dict({"input_ids": rows}), batch_size=4)
    else:  # a loader of dict batches
        loader = [
            {"input_ids": ids[s : s + 4], "attention_mask": mask[s : s + 4]} for s in range(0, N, 4)
        ]
        traker.featurize_loader(loader)
    traker.finalize_features()
    traker.start_scoring_checkpoint("q", state, model_id=0, num_targets=M, per_token=per_token)
    traker.score((q_ids, q_mask), num_samples=M)
    return traker, np.asarray(traker.finalize_scores("q"))


@pytest.mark.parametrize("method", METHODS)
def test_every_input_form_gives_identical_scores(tmp_path, method):
    """Tuples, dicts and a loader of dicts are the same tensors: bit-equal scores.

    The ragged ``datasets.Dataset`` is padded per batch to that batch's longest row
    (here 8 and 4 tokens instead of 8 and 8), so the same sums run over other GEMM
    shapes: equal up to float32 rounding of sums over at most d = 64 terms per
    product and the preconditioner's conditioning, checked at 1e-4 relative; K-FAC's
    factors leave padded positions out, so its curvature is the same too (with them
    in, A's mean changes by a factor 12/16 and the scores by ~15 %).
    """
    ref = None
    for form in ("tuple", "dict", "loader", "dataset"):
        _, scores = _scores(tmp_path / form, method, form)
        assert scores.shape == (N, M) and np.isfinite(scores).all()
        if ref is None:
            ref = scores
        elif form == "dataset":
            np.testing.assert_allclose(scores, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
        else:
            np.testing.assert_array_equal(scores, ref, err_msg=form)


@pytest.mark.parametrize("method", METHODS)
def test_every_way_of_naming_weights_gives_the_same_store(tmp_path, method):
    model = _gpt2()
    mask = ParamMask.from_patterns(model, include=WEIGHTS)
    choices = {
        "glob": "*.attn.c_attn.weight|*.mlp.c_fc.weight",
        "list": WEIGHTS,
        "mask": mask,
    }
    runs = {
        name: _scores(tmp_path / name, method, "tuple", grad_wrt=g) for name, g in choices.items()
    }
    for name, (traker, scores) in runs.items():
        assert traker.grad_wrt == WEIGHTS, name
        np.testing.assert_array_equal(scores, runs["list"][1], err_msg=name)
    if method != "trak":
        assert runs["list"][0].settings.layers == [
            "transformer.h.0.attn.c_attn",
            "transformer.h.0.mlp.c_fc",
        ]


@pytest.mark.parametrize("method", METHODS)
def test_per_token_scores_sum_to_the_whole_targets(tmp_path, method):
    """f = Σ_t f_t, and every method is linear in the target's features."""
    traker, whole = _scores(tmp_path, method, "tuple", per_token=True)
    tokens = traker.finalize_scores("q", per_token=True)
    assert tokens.shape == (N, M, SEQ)
    np.testing.assert_allclose(tokens.sum(-1), whole, rtol=1e-4, atol=1e-4 * np.abs(whole).max())


@pytest.mark.parametrize("method", METHODS)
def test_topk_is_the_top_of_the_scores(tmp_path, method):
    traker, scores = _scores(tmp_path, method, "tuple")
    top = traker.topk("q", 2)
    for j in range(M):
        assert set(top.proponents[:, j].tolist()) == set(np.argsort(-scores[:, j])[:2].tolist())
        assert set(top.opponents[:, j].tolist()) == set(np.argsort(scores[:, j])[:2].tolist())


# -- a user-registered preconditioner ---------------------------------------------------
@pytest.fixture
def diagonal():
    @register_curvature_preconditioner("test-diagonal")
    class Diagonal(CurvaturePreconditioner):
        """``P = diag(mean_i φ_i²) + λ``, fitted in finalize; counts the rows it saw."""

        accumulates = True

        def __init__(self, spec):
            super().__init__(spec)
            self.seen = np.zeros(0, dtype=np.int64)

        def accumulate(self, batch: FeatureBatch) -> None:
            self.seen = np.concatenate([self.seen, batch.rows])

        def finalize(self, train: TrainRows) -> None:
            total = torch.zeros(train.width, dtype=torch.float64)
            for _, _, x, _ in train.blocks():
                total += (x.double() ** 2).sum(0)
            self.second = train.reduce(total) / train.size

        def solve(self, targets: Tensor) -> Tensor:
            return targets / (self.second + 0.5).to(targets)

        def state_dict(self):
            if hasattr(self, "second"):
                return {"second": self.second.numpy()}
            return {"seen": self.seen}

        def load_state_dict(self, state):
            if "second" in state:
                self.second = torch.from_numpy(np.asarray(state["second"]))
            else:
                self.seen = np.asarray(state["seen"])

    yield Diagonal
    del CURVATURE_PRECONDITIONERS["test-diagonal"]


def test_a_registered_preconditioner_runs_the_whole_flow(tmp_path, diagonal):
    """Scores equal the float64 formula from the stored rows; accumulate saw each row once."""
    x = torch.randn(12, 5, generator=torch.Generator().manual_seed(0))
    y = torch.arange(12) % 3
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    traker = TRAKer(
        model,
        "image_classification",
        12,
        save_dir=tmp_path,
        device="cpu",
        proj_dim=16,
        method="test-diagonal",
        progress=False,
        chunk_rows=4,
    )
    state = model.state_dict()
    traker.load_checkpoint(state, model_id=0)
    for s in range(0, 12, 5):
        traker.featurize((x[s : s + 5], y[s : s + 5]), num_samples=len(x[s : s + 5]))
    traker.featurize((x[:5], y[:5]), inds=np.arange(5))  # done rows: neither stored nor seen
    traker.finalize_features()
    traker.start_scoring_checkpoint("q", state, model_id=0, num_targets=2)
    traker.score((x[:2], y[:2]), num_samples=2)
    scores = traker.finalize_scores("q")
    assert sorted(traker._precond.seen.tolist()) == list(range(12))
    train = torch.as_tensor(np.asarray(traker.stored_features(0)[:])).double()
    q = torch.as_tensor(np.asarray(traker.store.array("checkpoints/0/out_to_loss")[:])).double()
    targets = torch.as_tensor(np.asarray(traker.store.array("experiments/q/0/grads")[:])).double()
    second = (train**2).mean(0)
    ref = (train @ (targets / (second + 0.5)).T) * q
    np.testing.assert_allclose(scores, ref.numpy(), rtol=1e-5, atol=1e-6 * float(ref.abs().max()))
    assert traker.settings.method == "test-diagonal"


def test_registering_refuses_bad_classes_and_taken_names(diagonal):
    with pytest.raises(ValueError, match="is registered already"):
        register_curvature_preconditioner("test-diagonal")(type("Other", (diagonal,), {}))
    not_subclass = r"not a subclass of gradsketch\.attribution\.CurvaturePreconditioner"
    with pytest.raises(ValueError, match=not_subclass):
        register_curvature_preconditioner("x")(int)
    bad = type("Bad", (diagonal,), {"features": "pixels"})
    with pytest.raises(ValueError, match=r"Bad.features is 'pixels'; allowed: \['projected'"):
        register_curvature_preconditioner("bad")(bad)
    with pytest.raises(ValueError, match="`name` must be a non-empty string"):
        register_curvature_preconditioner("")


def test_unknown_method_lists_the_registry(tmp_path, diagonal):
    with pytest.raises(ValueError, match=r"`method` must be one of \[.*'test-diagonal'.*\]"):
        TRAKer(torch.nn.Linear(3, 2), "image_classification", 4, save_dir=tmp_path, method="lissa")


def test_entry_masks_are_refused_by_per_layer_methods(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    mask = ParamMask.random(model, 0.5, seed=0)
    with pytest.raises(ValueError, match="`mask` selects single entries"):
        TRAKer(model, "image_classification", 4, save_dir=tmp_path, method="kfac", mask=mask)


def test_projection_is_refused_by_trak(tmp_path):
    with pytest.raises(ValueError, match="`projection`=\\(4, 4\\) projects each layer"):
        TRAKer(
            torch.nn.Linear(3, 2), "image_classification", 4, save_dir=tmp_path, projection=(4, 4)
        )


def test_resuming_accumulated_state_with_another_world_size_is_refused(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    x, y = torch.randn(8, 5), torch.arange(8) % 3
    kw = dict(device="cpu", method="kfac", lambda_reg=0.1, progress=False, chunk_rows=4)
    first = TRAKer(model, "image_classification", 8, save_dir=tmp_path, **kw)
    first.load_checkpoint(model.state_dict(), model_id=0)
    first.featurize((x[:4], y[:4]), num_samples=4)
    first._save_accumulated()
    path = tmp_path / "checkpoints" / "0" / "accumulated.0.npz"
    with np.load(path) as z:
        state = dict(z)
    state["__world__"] = np.array(2)
    np.savez(path, **state)
    second = TRAKer(model, "image_classification", 8, save_dir=tmp_path, **kw)
    with pytest.raises(Exception, match="accumulated by 2 process\\(es\\), but this run has 1"):
        second.load_checkpoint(model.state_dict(), model_id=0)


def _mlp_ekfac(save_dir, curvature, **kw):
    # float64 throughout: the rank-one rows expand g aᵀ in float64, the dense rows are the
    # model's own per-example gradients, equal to 1e-9 only when the model computes in float64
    # too (float32 products differ in their last bits between CPUs' BLAS kernels).
    model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    model = model.double()
    traker = TRAKer(
        model,
        "image_classification",
        20,
        save_dir=save_dir,
        device="cpu",
        method="ekfac",
        lambda_reg="auto",
        curvature=curvature,
        dtype=torch.float64,
        progress=False,
        chunk_rows=8,
        **kw,
    )
    return model, traker


def _ekfac_run(traker, model, x, y, *, dense_after=None):
    """Featurize (dense rows from row ``dense_after`` on, when given), finalize, score."""
    traker.load_checkpoint(model.state_dict(), model_id=0)
    if dense_after is None:
        traker.featurize((x, y), num_samples=20)
    else:
        traker.featurize((x[:dense_after], y[:dense_after]), num_samples=dense_after)
        traker._require_dense(0)  # what a batch whose layers see several positions does
        traker.featurize((x[dense_after:], y[dense_after:]), num_samples=20 - dense_after)
    traker.finalize_features()
    traker.start_scoring_checkpoint("q", model.state_dict(), model_id=0, num_targets=4)
    traker.score((x[:4], y[:4]), num_samples=4)
    return traker.finalize_scores("q")


@pytest.mark.parametrize("curvature", ["loss", "sampled"])
def test_ekfac_rank_one_rows_equal_the_dense_rotation(tmp_path, curvature):
    """An MLP's layers see one position per example: the store keeps each layer's
    [a, g], EK-FAC's eigenvalues are (Q_Sᵀg)² ⊗ (Q_Aᵀa)² and scores expand g aᵀ as
    they read. That equals the dense rows and their rotation (the path taken when a
    layer sees several positions, forced here: dense rows from row 0, then NaN
    rank-one rows), and a store that turns dense half-way (rows 0-8 filled in)."""
    x = torch.randn(20, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    y = torch.arange(20) % 3
    model, compact = _mlp_ekfac(tmp_path / "compact", curvature)
    scores = _ekfac_run(compact, model, x, y)
    assert not compact.store.has("checkpoints/0/grads")
    eig = [v for _, _, v in compact.preconditioner(0).eigen]

    _, dense = _mlp_ekfac(tmp_path / "dense", curvature)
    _ekfac_run(dense, model, x, y, dense_after=0)
    dense.store.array("checkpoints/0/rank_one")[:] = np.nan
    dense._write_ckpt_record(0, {**dense._ckpt_record(0), "finalized": False})
    dense.finalize_features()
    for c, d in zip(eig, [v for _, _, v in dense.preconditioner(0).eigen]):
        torch.testing.assert_close(c, d, rtol=1e-10, atol=1e-14)
    rescored = dense.finalize_scores("q")
    torch.testing.assert_close(
        torch.as_tensor(rescored), torch.as_tensor(scores), rtol=1e-9, atol=0
    )

    _, mixed = _mlp_ekfac(tmp_path / "mixed", curvature)
    half = _ekfac_run(mixed, model, x, y, dense_after=9)
    assert mixed.store.has("checkpoints/0/grads")
    torch.testing.assert_close(torch.as_tensor(half), torch.as_tensor(scores), rtol=1e-9, atol=0)


@pytest.mark.parametrize(
    ("method", "default"), [("trak", 0.0), ("identity", 0.0), ("kfac", "auto"), ("ekfac", "auto")]
)
def test_lambda_reg_default_follows_the_method(tmp_path, method, default):
    """TRAK keeps trak's 0; the curvature methods default to the per-layer "auto" that
    led the five-protocol LDS grid (benchmarks/RESULTS.md), at 0.3 of each layer's mean
    eigenvalue."""
    from gradsketch.attribution import _kfac

    traker = TRAKer(
        torch.nn.Linear(4, 3),
        "image_classification",
        8,
        save_dir=tmp_path,
        device="cpu",
        proj_dim=4,
        method=method,
        progress=False,
    )
    assert traker.lambda_reg == default
    assert _kfac.resolve_damping("auto", torch.tensor([1.0, 3.0])) == pytest.approx(0.6)


def _lm_rows_run(tmp_path, name, batches, *, dense=False):
    """EK-FAC on a tiny float64 GPT-2: featurize ``batches`` (rows in order), score 2."""
    model = tiny_gpt2(11, 8)
    n = sum(int(b[0].shape[0]) for b in batches)
    traker = TRAKer(
        model,
        "language_modeling",
        n,
        save_dir=tmp_path / name,
        device="cpu",
        method="ekfac",
        dtype=torch.float64,
        progress=False,
    )
    traker.load_checkpoint(model.state_dict(), model_id=0)
    if dense:
        traker._require_dense(0)  # what a batch wider than factored rows does
    for b in batches:
        traker.featurize(b, num_samples=int(b[0].shape[0]))
    traker.finalize_features()
    traker.start_scoring_checkpoint("q", model.state_dict(), model_id=0, num_targets=2)
    traker.score(tuple(t[:2] for t in batches[0]), num_samples=2)
    return traker, np.asarray(traker.finalize_scores("q"))


def test_lm_rows_kept_as_token_factors_equal_dense_rows(tmp_path):
    """Layers that see T positions keep each position's [a, g] (``token_factors``) where
    that is narrower than vec(Σ_t g_t a_tᵀ): EK-FAC's correction rotates the factors,
    (g Q_S)ᵀ (a Q_A), and scores expand them as they read. Same scores (float64, up to
    summation order) as dense rows from the start, and as a store that starts factored
    with 3 positions and turns dense at a batch of 5 (its rows rewritten)."""
    g = torch.Generator().manual_seed(1)

    def batch(rows, length):
        ids = torch.randint(0, 11, (rows, length), generator=g)
        return ids, torch.ones_like(ids), ids.clone()

    short = [batch(3, 3), batch(3, 3)]
    factored, scores = _lm_rows_run(tmp_path, "factored", short)
    assert factored.store.has("checkpoints/0/token_factors")
    assert not factored.store.has("checkpoints/0/grads")
    assert factored._ckpt_record(0)["tokens"] == [3] * len(factored.layers)
    _, dense = _lm_rows_run(tmp_path, "dense", short, dense=True)
    np.testing.assert_allclose(scores, dense, rtol=1e-10, atol=1e-12 * np.abs(dense).max())

    longer = [short[0], batch(3, 5)]
    switched, mixed = _lm_rows_run(tmp_path, "switched", longer)
    assert switched.store.has("checkpoints/0/grads")
    _, reference = _lm_rows_run(tmp_path, "reference", longer, dense=True)
    np.testing.assert_allclose(mixed, reference, rtol=1e-10, atol=1e-12 * np.abs(reference).max())


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("Preconditioner", "CurvaturePreconditioner"),
        ("PRECONDITIONERS", "CURVATURE_PRECONDITIONERS"),
        ("register_preconditioner", "register_curvature_preconditioner"),
    ],
    ids=["class", "registry", "decorator"],
)
def test_old_preconditioner_names_are_deprecated_aliases(old, new):
    """The attribution family was renamed (sampling keeps the Preconditioner names)."""
    import gradsketch.attribution as attribution

    with pytest.warns(DeprecationWarning, match=f"gradsketch.attribution.{new}"):
        alias = getattr(attribution, old)
    assert alias is getattr(attribution, new)
    assert old not in attribution.__all__
