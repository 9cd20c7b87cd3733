"""K-FAC / EK-FAC / identity influence against explicit float64 references.

The reference builds every per-example gradient by a batch-of-one autograd
loop, the Kronecker factors from the layers' inputs and output gradients by
hand, the dense curvature matrix of each layer (``S ⊗ A`` for K-FAC, ``Q
diag(Λ) Qᵀ`` for EK-FAC) and solves ``(H + λI) x = g_train`` with
``torch.linalg.solve``; everything runs in float64, so the tolerances are a
few hundred float64 ulps of the scores' scale.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from torch import nn

from gradsketch._settings import SettingsMismatchError
from gradsketch.attribution import InfluenceComputer, ModelIDException, TRAKer
from gradsketch.sketch import FactorizedProjector

N, M = 12, 3
INFLUENCE_LOGGER = "gradsketch.attribution.TRAKer"
D_IN, HIDDEN, CLASSES = 4, 5, 3
RTOL, ATOL = 1e-9, 1e-11

#: Per-layer "auto" damping: this fraction of each layer's mean eigenvalue
#: (gradsketch.attribution._kfac.LAYER_AUTO_DAMPING_FRACTION, chosen in RESULTS.md).
AUTO_FRACTION = 0.3


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES)).double()


def _data(seed: int = 0, n: int = N) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D_IN, generator=g, dtype=torch.float64), torch.randint(
        0, CLASSES, (n,), generator=g
    )


def _margin(logits: torch.Tensor, y: int) -> torch.Tensor:
    others = torch.cat([logits[:y], logits[y + 1 :]])
    return logits[y] - torch.logsumexp(others, 0)


def _reference_parts(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor):
    """Per example: each layer's ``[W | b]`` margin gradient, input ``[a, 1]``, output grad; Q."""
    grads, inputs, outgrads, qs = [], [], [], []
    for i in range(x.shape[0]):
        h0 = model[0](x[i])
        h0.retain_grad()
        a1 = torch.tanh(h0)
        z = model[2](a1)
        z.retain_grad()
        model.zero_grad()
        _margin(z, int(y[i])).backward()
        grads.append(
            [
                torch.cat([m.weight.grad, m.bias.grad[:, None]], 1).clone()
                for m in (model[0], model[2])
            ]
        )
        one = torch.ones(1, dtype=torch.float64)
        inputs.append([torch.cat([x[i], one]), torch.cat([a1.detach(), one])])
        outgrads.append([h0.grad.clone(), z.grad.clone()])
        qs.append(1 - torch.softmax(z.detach(), 0)[int(y[i])])
    return grads, inputs, outgrads, torch.stack(qs)


def _reference_scores(model, x, y, xq, yq, method, damping, curvature="loss", proj=None):
    """``Q_i Σ_l vec(G_q^l)ᵀ (H_l + λ_l I)⁻¹ vec(G_i^l)`` with dense float64 matrices."""
    grads, inputs, outgrads, q = _reference_parts(model, x, y)
    qgrads, _, _, _ = _reference_parts(model, xq, yq)
    w = q**2 if curvature == "loss" else torch.ones_like(q)
    scores = torch.zeros(x.shape[0], xq.shape[0], dtype=torch.float64)
    for layer in range(2):
        p_out, p_in = (None, None) if proj is None else proj[layer]

        def project(mat, p_out=p_out, p_in=p_in):
            return mat if p_out is None else p_out @ mat @ p_in.T

        def pa(v, p_in=p_in):
            return v if p_in is None else p_in @ v

        def pg(v, p_out=p_out):
            return v if p_out is None else p_out @ v

        gt = torch.stack([project(gr[layer]).reshape(-1) for gr in grads])
        gq = torch.stack([project(gr[layer]).reshape(-1) for gr in qgrads])
        if method == "identity":
            scores += q[:, None] * (gt @ gq.T)
            continue
        a_cov = sum(torch.outer(pa(v[layer]), pa(v[layer])) for v in inputs) / len(inputs)
        s_cov = sum(wi * torch.outer(pg(v[layer]), pg(v[layer])) for wi, v in zip(w, outgrads))
        s_cov = s_cov / len(inputs)
        if method == "kfac":
            h = torch.kron(s_cov, a_cov)
            lam_values = torch.linalg.eigvalsh(h)
        else:
            _, q_a = torch.linalg.eigh(a_cov)
            _, q_s = torch.linalg.eigh(s_cov)
            basis = torch.kron(q_s, q_a)
            fisher = (gt * w[:, None]).T @ gt / len(inputs)
            lam_values = torch.diagonal(basis.T @ fisher @ basis)
            h = basis @ torch.diag(lam_values) @ basis.T
        lam = damping if damping != "auto" else AUTO_FRACTION * float(lam_values.mean())
        solved = torch.linalg.solve(h + lam * torch.eye(h.shape[0], dtype=h.dtype), gq.T)
        scores += q[:, None] * (gt @ solved)
    return scores


def _run(
    tmp_path,
    method,
    *,
    damping="auto",
    curvature="loss",
    projection=None,
    checkpoints=1,
    name="store",
    batch=5,
):
    model = _model()
    x, y = _data()
    xq, yq = _data(seed=1, n=M)
    ic = InfluenceComputer(
        model,
        "image_classification",
        N,
        tmp_path / name,
        method=method,
        damping=damping,
        curvature=curvature,
        projection=projection,
        dtype=torch.float64,
        progress=False,
        chunk_rows=4,
    )
    states = [_model(seed=s).state_dict() for s in range(checkpoints)]
    for mid, state in enumerate(states):
        ic.load_checkpoint(state, model_id=mid)
        for start in range(0, N, batch):
            ic.featurize(
                (x[start : start + batch], y[start : start + batch]),
                num_samples=min(batch, N - start),
            )
    ic.finalize_features()
    for mid, state in enumerate(states):
        ic.start_scoring_checkpoint("q", state, model_id=mid, num_targets=M)
        ic.score((xq, yq), num_samples=M)
    return ic, ic.finalize_scores("q"), states, (x, y, xq, yq)


@pytest.mark.parametrize("curvature", ["loss", "output"])
@pytest.mark.parametrize("damping", ["auto", 0.05])
@pytest.mark.parametrize("method", ["identity", "kfac", "ekfac"])
def test_scores_equal_dense_float64_inverse(tmp_path, method, damping, curvature):
    _, scores, states, (x, y, xq, yq) = _run(tmp_path, method, damping=damping, curvature=curvature)
    model = _model()
    model.load_state_dict(states[0])
    ref = _reference_scores(model, x, y, xq, yq, method, damping, curvature)
    # Scores are returned in float32: compare at float32 resolution of their scale.
    np.testing.assert_allclose(scores, ref.numpy(), rtol=1e-6, atol=1e-6 * float(ref.abs().max()))


@pytest.mark.parametrize("method", ["identity", "kfac", "ekfac"])
def test_scores_in_float64_before_rounding(tmp_path, method):
    """The accumulator itself, before the float32 result: float64-tight."""
    ic, _, states, (x, y, xq, yq) = _run(tmp_path, method)
    model = _model()
    model.load_state_dict(states[0])
    ref = _reference_scores(model, x, y, xq, yq, method, "auto")
    targets = torch.as_tensor(np.asarray(ic.store.array("experiments/q/0/grads")[:]))
    pre = ic.preconditioner(0).solve(targets)
    train = torch.as_tensor(np.asarray(ic.stored_features(0)[:]))
    q = torch.as_tensor(np.asarray(ic.store.array("checkpoints/0/out_to_loss")[:]))
    torch.testing.assert_close(q * (train @ pre.T), ref, rtol=RTOL, atol=ATOL)


def test_identity_is_plain_gradient_dot_products(tmp_path):
    _, scores, states, (x, y, xq, yq) = _run(tmp_path, "identity")
    model = _model()
    model.load_state_dict(states[0])
    g_train, _, _, q = _reference_parts(model, x, y)
    g_query, _, _, _ = _reference_parts(model, xq, yq)
    flat_t = torch.stack([torch.cat([m.reshape(-1) for m in gr]) for gr in g_train])
    flat_q = torch.stack([torch.cat([m.reshape(-1) for m in gr]) for gr in g_query])
    ref = q[:, None] * (flat_t @ flat_q.T)
    np.testing.assert_allclose(scores, ref.numpy(), rtol=1e-6, atol=1e-6 * float(ref.abs().max()))


@pytest.mark.parametrize("method", ["identity", "kfac", "ekfac"])
def test_projected_space_equals_dense_reference_on_projected_gradients(tmp_path, method):
    projection = (3, 2)
    ic, scores, states, (x, y, xq, yq) = _run(tmp_path, method, projection=projection)
    assert ic.feature_dim == 2 * 3 * 2
    model = _model()
    model.load_state_dict(states[0])
    proj = []
    for name, d_in, d_out in (("0", D_IN + 1, HIDDEN), ("2", HIDDEN + 1, CLASSES)):
        p_out, p_in = ic.projector.factor_matrices(name, torch.float64)
        assert p_in.shape == (3, d_in) and p_out.shape == (2, d_out)
        proj.append((p_out / 2**0.5, p_in / 3**0.5))
    ref = _reference_scores(model, x, y, xq, yq, method, "auto", proj=proj)
    np.testing.assert_allclose(scores, ref.numpy(), rtol=1e-6, atol=1e-6 * float(ref.abs().max()))


def test_checkpoint_ensemble_is_the_mean_of_single_checkpoint_scores(tmp_path):
    _, both, states, (x, y, xq, yq) = _run(tmp_path, "ekfac", checkpoints=2)
    refs = []
    for state in states:
        model = _model()
        model.load_state_dict(state)
        refs.append(_reference_scores(model, x, y, xq, yq, "ekfac", "auto"))
    ref = (refs[0] + refs[1]) / 2
    np.testing.assert_allclose(both, ref.numpy(), rtol=1e-6, atol=1e-6 * float(ref.abs().max()))


def test_factors_are_reused_by_a_second_query_set(tmp_path):
    ic, first, states, (_, _, xq, yq) = _run(tmp_path, "ekfac")
    fitted = tmp_path / "store" / "checkpoints" / "0" / "eigenvalues_0"
    stamp = max(p.stat().st_mtime_ns for p in fitted.rglob("*"))
    ic.finalize_features()  # already final: nothing refitted
    ic.start_scoring_checkpoint("again", states[0], model_id=0, num_targets=M)
    ic.score((xq, yq), num_samples=M)
    np.testing.assert_array_equal(ic.finalize_scores("again"), first)
    assert max(p.stat().st_mtime_ns for p in fitted.rglob("*")) == stamp


def test_resume_after_a_crash_between_rows_and_factors(tmp_path, caplog):
    """Rows flagged done but missing from the saved factors get their factors only, once."""
    _, clean, _, _ = _run(tmp_path, "ekfac", name="clean")
    model = _model()
    x, y = _data()
    xq, yq = _data(seed=1, n=M)
    state = model.state_dict()

    def make():
        return InfluenceComputer(
            model,
            "image_classification",
            N,
            tmp_path / "crash",
            method="ekfac",
            dtype=torch.float64,
            progress=False,
            chunk_rows=4,
        )

    first = make()
    first.load_checkpoint(state, model_id=0)
    first.featurize((x[:6], y[:6]), num_samples=6)
    first._save_accumulated()
    first.featurize((x[6:9], y[6:9]), num_samples=3)  # rows stored, factors not saved
    first.store.flush()
    del first
    second = make()
    with caplog.at_level(logging.INFO, logger=INFLUENCE_LOGGER):
        second.load_checkpoint(state, model_id=0)
    done = second.store.done_rows("checkpoints/0/done")
    assert done[:9].all() and not done[9:].any()
    # Which rows the factors cover shows in the scores below (a row missed or counted
    # twice changes them); the resume log gives the count.
    assert "resuming, 9 of 12 rows already featurized, 6 in the curvature statistics" in caplog.text
    second.featurize((x, y), num_samples=N)
    second.finalize_features()
    second.start_scoring_checkpoint("q", state, model_id=0, num_targets=M)
    second.score((xq, yq), num_samples=M)
    np.testing.assert_allclose(second.finalize_scores("q"), clean, rtol=1e-12, atol=0)


def test_finalize_refuses_missing_rows(tmp_path):
    model = _model()
    x, y = _data()
    ic = InfluenceComputer(
        model, "image_classification", N, tmp_path, method="kfac", progress=False
    )
    ic.load_checkpoint(model.state_dict(), model_id=0)
    ic.featurize((x[:5], y[:5]), num_samples=5)
    with pytest.raises(ModelIDException, match="7 of 12 rows missing"):
        ic.finalize_features()
    with pytest.raises(ValueError, match="del_grads"):
        ic.finalize_features(del_grads=True)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"method": "newton"}, "`method` must be one of"),
        ({"curvature": "hessian"}, "`curvature` must be one of"),
        ({"damping": -1.0}, "`damping` must be a number >= 0"),
        ({"damping": "big"}, "`damping` must be a number >= 0"),
        ({"projection": (0, 2)}, "`projection` must be"),
        ({"dtype": torch.float16}, r"`dtype` must be one of \['torch.float32', 'torch.float64'\]"),
        ({"grad_wrt": ["nope"]}, "`grad_wrt` names"),
    ],
    ids=[
        "method",
        "curvature",
        "negative-damping",
        "damping-word",
        "projection",
        "dtype",
        "grad_wrt",
    ],
)
def test_invalid_arguments(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        InfluenceComputer(_model(), "image_classification", N, tmp_path, **kwargs)


def test_no_factored_layer_is_refused(tmp_path):
    model = nn.Sequential(nn.Embedding(5, 3), nn.Flatten(), nn.LayerNorm(3))
    with pytest.raises(ValueError, match="no differentiated layer of a factored type"):
        InfluenceComputer(model, "image_classification", N, tmp_path)


# -- through TRAKer ------------------------------------------------------------------------
def _traker(path, method, **kwargs):
    return TRAKer(
        _model(),
        "image_classification",
        N,
        save_dir=path,
        device="cpu",
        proj_dim=8,
        progress=False,
        method=method,
        **kwargs,
    )


def test_traker_method_argument_delegates(tmp_path):
    x, y = _data()
    xq, yq = _data(seed=1, n=M)
    state = _model().state_dict()
    traker = _traker(tmp_path / "t", "ekfac", lambda_reg="auto")
    traker.load_checkpoint(state, model_id=0)
    traker.featurize((x, y), num_samples=N)
    traker.finalize_features()
    traker.start_scoring_checkpoint("q", state, model_id=0, num_targets=M)
    traker.score((xq, yq), num_samples=M)
    scores = traker.finalize_scores("q")
    assert traker.model_ids == [0]
    model = _model()
    ref = _reference_scores(model, x, y, xq, yq, "ekfac", "auto")
    # float32 storage through TRAKer: relative error of float32 products.
    np.testing.assert_allclose(scores, ref.numpy(), rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


def test_traker_with_factorized_projector_projects_per_layer(tmp_path):
    model = _model()
    projector = FactorizedProjector.from_model(model, k_in=3, k_out=2, seed=7)
    traker = _traker(tmp_path, "kfac", projector=projector, lambda_reg=0.1)
    settings = json.loads((traker.save_dir / "settings.json").read_text())
    assert settings["projector"] == {"kind": "per-layer", "projection": [3, 2], "seed": 7}


def test_traker_refuses_an_unknown_method_and_other_projectors(tmp_path):
    allowed = r"`method` must be one of \['ekfac', 'identity', 'kfac', 'trak'"
    with pytest.raises(ValueError, match=allowed):
        _traker(tmp_path / "a", "lissa")
    from gradsketch.sketch import CountSketchProjector

    with pytest.raises(ValueError, match="`projector` must be None or a FactorizedProjector"):
        _traker(tmp_path / "b", "kfac", projector=CountSketchProjector(53, 8, 0, "cpu"))


@pytest.mark.parametrize(
    ("first", "second"), [("trak", "ekfac"), ("ekfac", "trak"), ("kfac", "ekfac")]
)
def test_reopening_a_store_with_another_method_is_refused(tmp_path, first, second):
    _traker(tmp_path, first, lambda_reg=0.1)
    with pytest.raises(SettingsMismatchError, match="stored"):
        _traker(tmp_path, second, lambda_reg=0.1)


def test_traker_resumes_an_influence_store(tmp_path, caplog):
    x, y = _data()
    state = _model().state_dict()
    first = _traker(tmp_path, "kfac", lambda_reg=0.1)
    first.load_checkpoint(state, model_id=0)
    first.featurize((x[:6], y[:6]), num_samples=6)
    first.featurize_loader([])  # saves the factors, flushes the rows
    second = _traker(tmp_path, "kfac", lambda_reg=0.1)
    with caplog.at_level(logging.INFO, logger=INFLUENCE_LOGGER):
        second.load_checkpoint(state, model_id=0)
    assert "resuming, 6 of 12 rows already featurized, 6 in the curvature statistics" in caplog.text


# -- other layer types ------------------------------------------------------------------------
def _autograd_scores(model, x, y, xq, yq):
    """``Q_i <∇θ m_q, ∇θ m_i>`` over every parameter, one example at a time (float64)."""

    def grads(xs, ys):
        rows, qs = [], []
        for i in range(xs.shape[0]):
            model.zero_grad()
            logits = model(xs[i : i + 1])[0]
            _margin(logits, int(ys[i])).backward()
            rows.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
            qs.append(1 - torch.softmax(logits.detach(), 0)[int(ys[i])])
        return torch.stack(rows), torch.stack(qs)

    gt, q = grads(x, y)
    gq, _ = grads(xq, yq)
    return q[:, None] * (gt @ gq.T)


def _scores_of(model, x, y, xq, yq, method, path, grad_wrt=None):
    ic = InfluenceComputer(
        model,
        "image_classification",
        x.shape[0],
        path,
        method=method,
        dtype=torch.float64,
        progress=False,
        grad_wrt=grad_wrt,
    )
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ic.load_checkpoint(state, model_id=0)
    ic.featurize((x, y), num_samples=x.shape[0])
    ic.finalize_features()
    ic.start_scoring_checkpoint("q", state, model_id=0, num_targets=xq.shape[0])
    ic.score((xq, yq), num_samples=xq.shape[0])
    targets = torch.as_tensor(np.asarray(ic.store.array("experiments/q/0/grads")[:]))
    train = torch.as_tensor(np.asarray(ic.stored_features(0)[:]))
    q = torch.as_tensor(np.asarray(ic.store.array("checkpoints/0/out_to_loss")[:]))
    return q * (train @ ic.preconditioner(0).solve(targets).T)


def test_conv2d_identity_is_plain_gradient_dot_products(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 4 * 4, CLASSES)
    ).double()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 2, 4, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (8,), generator=g)
    got = _scores_of(model, x, y, x[:3], y[:3], "identity", tmp_path)
    torch.testing.assert_close(
        got, _autograd_scores(model, x, y, x[:3], y[:3]), rtol=RTOL, atol=ATOL
    )


def test_conv2d_kfac_equals_dense_kronecker_inverse_from_im2col(tmp_path):
    """Factors by hand from ``F.unfold`` patches and output gradients over positions."""
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 2).double()
    model = nn.Sequential(conv, nn.Flatten(), nn.Linear(3 * 2 * 2, CLASSES)).double()
    model[2].weight.requires_grad_(False)
    model[2].bias.requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10, 2, 3, 3, generator=g, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (10,), generator=g)
    grad_wrt = ["0.weight", "0.bias"]
    ic = InfluenceComputer(
        model,
        "image_classification",
        10,
        tmp_path,
        method="kfac",
        dtype=torch.float64,
        progress=False,
        grad_wrt=grad_wrt,
    )
    assert [x.name for x in ic.layers] == ["0"]
    got = _scores_of(model, x, y, x[:3], y[:3], "kfac", tmp_path / "run", grad_wrt)
    # reference
    patches = torch.nn.functional.unfold(x, 2).transpose(1, 2)  # [N, L, 8]
    a = torch.cat([patches, torch.ones(10, patches.shape[1], 1, dtype=torch.float64)], -1)
    rows, gs, qs = [], [], []
    for i in range(10):
        out = conv(x[i : i + 1])
        out.retain_grad()
        logits = model[2](out.flatten(1))[0]
        model.zero_grad()
        _margin(logits, int(y[i])).backward()
        gi = out.grad[0].reshape(3, -1).T  # [L, 3]
        gs.append(gi)
        qs.append(1 - torch.softmax(logits.detach(), 0)[int(y[i])])
        rows.append((gi.T @ a[i]).reshape(-1))
    q = torch.stack(qs)
    a_cov = sum(ai.T @ ai for ai in a) / (10 * a.shape[1])
    s_cov = sum(qi**2 * gi.T @ gi for qi, gi in zip(q, gs)) / 10
    h = torch.kron(s_cov, a_cov)
    lam = AUTO_FRACTION * float(torch.linalg.eigvalsh(h).mean())
    gt = torch.stack(rows)
    solved = torch.linalg.solve(h + lam * torch.eye(h.shape[0], dtype=h.dtype), gt[:3].T)
    torch.testing.assert_close(got, q[:, None] * (gt @ solved), rtol=RTOL, atol=ATOL)


def test_hf_conv1d_scores_equal_the_equivalent_linear_model(tmp_path):
    """GPT-2's ``Conv1D`` (weight ``[d_in, d_out]``) gives a Linear model's scores exactly."""
    from transformers.pytorch_utils import Conv1D

    linear = _model()
    conv = nn.Sequential(Conv1D(HIDDEN, D_IN), nn.Tanh(), Conv1D(CLASSES, HIDDEN)).double()
    with torch.no_grad():
        for c, lin in ((conv[0], linear[0]), (conv[2], linear[2])):
            c.weight.copy_(lin.weight.T)
            c.bias.copy_(lin.bias)
    x, y = _data()
    xq, yq = _data(seed=1, n=M)
    for method in ("identity", "kfac", "ekfac"):
        want = _scores_of(linear, x, y, xq, yq, method, tmp_path / f"lin-{method}")
        got = _scores_of(conv, x, y, xq, yq, method, tmp_path / f"conv-{method}")
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("method", ["identity", "kfac", "ekfac"])
def test_topk_and_memory_budget_serve_every_method(tmp_path, method):
    """The one scoring kernel: top-k and budgeted tiles give the in-memory scores' rows."""
    ic, scores, _, _ = _run(tmp_path, method)
    top = ic.topk("q", 3)
    for j in range(M):
        want = np.argsort(-scores[:, j], kind="stable")[:3]
        np.testing.assert_allclose(scores[top.proponents[:, j], j], scores[want, j], rtol=1e-6)
    ic.memory_budget = 50_000  # near the minimum for k = 43: row blocks of a few rows
    tiled = np.asarray(ic.finalize_scores("q")[:])
    np.testing.assert_allclose(tiled, scores, rtol=1e-6, atol=1e-6 * np.abs(scores).max())


def test_per_token_needs_a_task_with_tokens_whatever_the_method(tmp_path):
    state = _model().state_dict()
    traker = _traker(tmp_path, "kfac", lambda_reg=0.1)
    with pytest.raises(ValueError, match="`per_token`=True needs a task with per-token outputs"):
        traker.start_scoring_checkpoint("q", state, model_id=0, num_targets=M, per_token=True)
