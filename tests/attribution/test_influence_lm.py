"""K-FAC / EK-FAC influence on a tiny Hugging Face GPT-2 against explicit float64 matrices.

The reference runs one sequence at a time: the gradient of its summed
log-likelihood with respect to every ``Conv1D`` and the (tied) ``lm_head``
(through ``functional_call`` with ``tie_weights=False``, so the head's own
part of the tied weight's gradient), each layer's inputs and per-position
output gradients from ``retain_grad``, the Kronecker factors summed by hand,
the dense curvature of each layer (``S ⊗ A`` for K-FAC, ``Q diag(Λ) Qᵀ`` for
EK-FAC) and ``torch.linalg.solve``. Everything is float64, so the tolerances
are a few hundred float64 ulps of the scores' scale.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from gradsketch._hash import derive_key  # noqa: E402
from gradsketch.attribution import InfluenceComputer, TRAKer  # noqa: E402
from gradsketch.attribution._fisher import draw_labels  # noqa: E402
from gradsketch.attribution._kronecker_features import SAMPLE_STREAM as _SAMPLE_STREAM  # noqa: E402
from helpers.hf_families import tiny_gpt2  # noqa: E402

N, M, T, VOCAB = 6, 2, 5, 11
SAMPLE_SEED = 3
RTOL, ATOL = 1e-9, 1e-12

#: Per-layer "auto" damping: this fraction of each layer's mean eigenvalue
#: (gradsketch.attribution._kfac.LAYER_AUTO_DAMPING_FRACTION, chosen in RESULTS.md).
AUTO_FRACTION = 0.3


def _gpt2() -> nn.Module:
    return tiny_gpt2(VOCAB, T)


def _batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, T), generator=g)
    labels = ids.clone()
    labels[0, 2] = -100  # an unpredicted position: left out of the log-likelihood
    return ids, torch.ones_like(ids), labels


def _log_likelihood(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    total = logits.new_zeros(())
    for t in range(1, labels.shape[-1]):
        if int(labels[t]) != -100:
            total = total + torch.log_softmax(logits[t - 1], -1)[int(labels[t])]
    return total


def _keep(name: str, seen: dict):
    """Forward hook storing a layer's input (detached) and its output (kept for ``.grad``)."""

    def fn(module, args, output):
        output.retain_grad()
        seen[name] = (args[0][0].detach(), output)

    return fn


def _sampled_nll(logits: torch.Tensor, labels: torch.Tensor, row: int, key: int) -> torch.Tensor:
    """``Σ_t -log p(ŷ_t)`` over predicted positions, ``ŷ`` drawn as the library draws ``row``."""
    drawn = draw_labels(logits[None, :-1], torch.tensor([row]), key)[0]
    total = logits.new_zeros(())
    for t in range(1, labels.shape[-1]):
        if int(labels[t]) != -100:
            total = total - torch.log_softmax(logits[t - 1], -1)[int(drawn[t - 1])]
    return total


def _reference_parts(model: nn.Module, batch, key: int | None = None):
    """Per sequence and layer: ``[W | b]`` gradient ``[d_out, d_in(+1)]``, inputs, output grads.

    The gradients are the log-likelihood's, or with ``key`` the loss's under
    labels drawn from the model (the sampled Fisher's).
    """
    ids, mask, labels = batch
    conv_names = [n for n, m in model.named_modules() if type(m).__name__ == "Conv1D"]
    params = dict(model.named_parameters(remove_duplicate=False))
    names = [*conv_names, "lm_head"]
    grads, inputs, outgrads = [], [], []
    for i in range(ids.shape[0]):
        seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        handles = [model.get_submodule(n).register_forward_hook(_keep(n, seen)) for n in names]
        local = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
        out = torch.func.functional_call(
            model,
            local,
            args=(),
            kwargs={"input_ids": ids[i : i + 1], "attention_mask": mask[i : i + 1]},
            tie_weights=False,
        )
        for h in handles:
            h.remove()
        if key is None:
            _log_likelihood(out.logits[0], labels[i]).backward()
        else:
            _sampled_nll(out.logits[0], labels[i], i, key).backward()
        row_g, row_a, row_s = [], [], []
        for n in names:
            a, o = seen[n]
            if n == "lm_head":
                row_g.append(local["lm_head.weight"].grad.clone())
                row_a.append(a)
            else:
                w, b = local[f"{n}.weight"].grad, local[f"{n}.bias"].grad
                row_g.append(torch.cat([w.T, b[:, None]], 1))
                row_a.append(torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype)], 1))
            row_s.append(o.grad[0].clone())
        grads.append(row_g)
        inputs.append(row_a)
        outgrads.append(row_s)
    return grads, inputs, outgrads


def _reference_scores(model, train, query, method, damping, curvature="loss"):
    """``Σ_l vec(G_q^l)ᵀ (H_l + λ_l I)⁻¹ vec(G_i^l)`` with dense float64 matrices (Q = 1).

    ``H`` is fitted from the log-likelihood's gradients (``"loss"``: Q = 1, so
    the empirical Fisher) or from the sampled-label loss's (``"sampled"``).
    """
    grads, inputs, outgrads = _reference_parts(model, train)
    qgrads, _, _ = _reference_parts(model, query)
    fisher_grads = grads
    if curvature == "sampled":
        fisher_grads, _, outgrads = _reference_parts(
            model, train, derive_key(SAMPLE_SEED, 0, _SAMPLE_STREAM)
        )
    n = len(grads)
    scores = torch.zeros(n, len(qgrads), dtype=torch.float64)
    for layer in range(len(grads[0])):
        gt = torch.stack([g[layer].reshape(-1) for g in grads])
        gf = torch.stack([g[layer].reshape(-1) for g in fisher_grads])
        gq = torch.stack([g[layer].reshape(-1) for g in qgrads])
        a_all = torch.cat([a[layer] for a in inputs])
        a_cov = a_all.T @ a_all / a_all.shape[0]  # mean over every token
        s_cov = sum(s[layer].T @ s[layer] for s in outgrads) / n  # sum over tokens, mean over rows
        if method == "kfac":
            h = torch.kron(s_cov, a_cov)
            values = torch.linalg.eigvalsh(h)
        else:
            _, q_a = torch.linalg.eigh(a_cov)
            _, q_s = torch.linalg.eigh(s_cov)
            basis = torch.kron(q_s, q_a)
            values = torch.diagonal(basis.T @ (gf.T @ gf / n) @ basis)
            h = basis @ torch.diag(values) @ basis.T
        lam = damping if damping != "auto" else AUTO_FRACTION * float(values.mean())
        solved = torch.linalg.solve(h + lam * torch.eye(h.shape[0], dtype=h.dtype), gq.T)
        scores += gt @ solved
    return scores


def _influence_scores(tmp_path, model, train, query, method, damping, curvature="loss", batch=4):
    ic = InfluenceComputer(
        model,
        "language_modeling",
        N,
        tmp_path,
        method=method,
        damping=damping,
        curvature=curvature,
        sample_seed=SAMPLE_SEED,
        dtype=torch.float64,
        progress=False,
    )
    state = model.state_dict()
    ic.load_checkpoint(state, model_id=0)
    for start in range(0, N, batch):
        ic.featurize(
            tuple(t[start : start + batch] for t in train), num_samples=min(batch, N - start)
        )
    ic.finalize_features()
    ic.start_scoring_checkpoint("q", state, model_id=0, num_targets=M)
    ic.score(query, num_samples=M)
    return ic, ic.finalize_scores("q")


@pytest.mark.parametrize(
    ("method", "damping", "curvature"),
    [
        ("kfac", "auto", "loss"),
        ("kfac", 0.03, "loss"),
        ("ekfac", "auto", "loss"),
        ("ekfac", 0.03, "loss"),
        ("kfac", "auto", "sampled"),
        ("ekfac", "auto", "sampled"),
    ],
)
def test_gpt2_scores_equal_dense_float64_inverse(tmp_path, method, damping, curvature):
    model = _gpt2()
    train, query = _batch(N, 0), _batch(M, 1)
    ic, scores = _influence_scores(tmp_path, model, train, query, method, damping, curvature)
    # Every Conv1D and the tied lm_head are factored (Kronfluence's set after conv1d_to_linear).
    assert ic.settings.layers[-1] == "lm_head"
    assert len(ic.settings.layers) == 5
    ref = _reference_scores(model, train, query, method, damping, curvature)
    np.testing.assert_allclose(
        scores, ref.numpy(), rtol=1e-5, atol=1e-5 * float(ref.abs().max())
    )  # the returned scores are float32
    train_rows = torch.as_tensor(np.asarray(ic.stored_features(0)[:]))
    targets = torch.as_tensor(np.asarray(ic.store.array("experiments/q/0/grads")[:]))
    q = torch.as_tensor(np.asarray(ic.store.array("checkpoints/0/out_to_loss")[:]))
    assert torch.equal(q, torch.ones_like(q))  # the loss is minus the log-likelihood
    got = q * (train_rows @ ic.preconditioner(0).solve(targets).T)
    torch.testing.assert_close(got, ref, rtol=RTOL, atol=ATOL * float(ref.abs().max()))


def test_traker_ekfac_on_gpt2_equals_dense_float64_inverse(tmp_path):
    model = _gpt2()
    train, query = _batch(N, 0), _batch(M, 1)
    traker = TRAKer(
        model,
        "language_modeling",
        N,
        save_dir=tmp_path,
        device="cpu",
        progress=False,
        method="ekfac",
        lambda_reg="auto",
    )
    state = model.state_dict()
    traker.load_checkpoint(state, model_id=0)
    traker.featurize(train, num_samples=N)
    traker.finalize_features()
    traker.start_scoring_checkpoint("q", state, model_id=0, num_targets=M)
    traker.score(query, num_samples=M)
    scores = traker.finalize_scores("q")
    ref = _reference_scores(model, train, query, "ekfac", "auto")
    # float32 storage through TRAKer: relative error of float32 products.
    np.testing.assert_allclose(scores, ref.numpy(), rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


def test_gpt2_projected_store_accepts_the_tied_head(tmp_path):
    """The tied ``lm_head.weight`` is not in ``named_parameters()``; projection still works."""
    from gradsketch.sketch import FactorizedProjector

    model = _gpt2()
    projector = FactorizedProjector.from_model(model, k_in=4, k_out=4, seed=0)
    traker = TRAKer(
        model,
        "language_modeling",
        N,
        save_dir=tmp_path,
        device="cpu",
        progress=False,
        method="kfac",
        lambda_reg="auto",
        projector=projector,
        grad_wrt=None,
    )
    state = model.state_dict()
    traker.load_checkpoint(state, model_id=0)
    traker.featurize(_batch(N, 0), num_samples=N)
    traker.finalize_features()
    traker.start_scoring_checkpoint("q", state, model_id=0, num_targets=M)
    traker.score(_batch(M, 1), num_samples=M)
    scores = traker.finalize_scores("q")
    assert scores.shape == (N, M) and np.isfinite(scores).all()
    assert traker.proj_dim == 5 * 16
