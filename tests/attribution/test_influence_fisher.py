"""The sampled true Fisher (``curvature="sampled"``): expectation, draws, reproducibility, errors.

Statistical test (``test_sampled_factor_matches_its_closed_form_expectation``).
With one label ``ŷ_n ~ p_n`` drawn per example, the fitted output-side factor
is ``S = (1/N) Σ_n X_n`` with ``X_n = g_n(ŷ_n) g_n(ŷ_n)ᵀ`` (``g_n(c)`` the
layer's output gradient of ``CE(logits_n, c)``). The ``X_n`` are independent
and, entry by entry, bounded by ``a_n = min_c X_n(c)``, ``b_n = max_c X_n(c)``;
their mean ``E S = (1/N) Σ_n Σ_c p_nc g_n(c) g_n(c)ᵀ`` is computed in closed
form over every label in float64. Hoeffding's inequality gives, per entry,

    P(|S - E S| >= t) <= 2 exp(-2 N² t² / Σ_n (b_n - a_n)²),

so with ``t = sqrt(Σ_n (b_n - a_n)² log(2D/δ) / 2) / N`` and a union bound
over all ``D`` entries of every layer, a correct sampler fails the test with
probability at most ``δ = 1e-6`` (the hashed uniforms sit on a 2⁻³² grid, a
bias in each ``p_c`` below 2⁻³², far inside ``t``). The seed is fixed, so the
test is deterministic; the same bound is checked to reject the empirical
Fisher (observed labels), so it can fail.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gradsketch._hash import derive_key
from gradsketch._settings import SettingsMismatchError
from gradsketch.attribution import InfluenceComputer, TRAKer
from gradsketch.attribution._fisher import draw_labels
from gradsketch.attribution._kronecker_features import SAMPLE_STREAM as _SAMPLE_STREAM
from gradsketch.attribution._modelout import AbstractModelOutput

D_IN, HIDDEN, CLASSES = 3, 4, 3
DELTA = 1e-6


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES)).double()


def _data(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = 2 * torch.randn(n, D_IN, generator=g, dtype=torch.float64)
    return x, torch.randint(0, CLASSES, (n,), generator=g)


def _fit(path, method, curvature, x, y, *, seed=0, batch=50, model_id=0):
    n = x.shape[0]
    model = _model()
    ic = InfluenceComputer(
        model,
        "image_classification",
        n,
        path,
        method=method,
        curvature=curvature,
        sample_seed=seed,
        dtype=torch.float64,
        progress=False,
    )
    ic.load_checkpoint(model.state_dict(), model_id=model_id)
    for start in range(0, n, batch):
        ic.featurize((x[start : start + batch], y[start : start + batch]), num_samples=batch)
    return ic


def _per_label_outgrads(model: nn.Sequential, x: torch.Tensor):
    """``[N, C, d_out]`` output gradients of ``CE(logits, c)`` at each Linear, and ``p [N, C]``."""
    h0 = model[0](x)
    z = model[2](torch.tanh(h0))
    probs = torch.softmax(z, -1).detach()
    per_layer: list[list[torch.Tensor]] = [[], []]
    for c in range(CLASSES):
        g0, g1 = torch.autograd.grad(
            F.cross_entropy(z, torch.full((x.shape[0],), c), reduction="sum"),
            [h0, z],
            retain_graph=True,
        )
        per_layer[0].append(g0)
        per_layer[1].append(g1)
    return [torch.stack(g, 1) for g in per_layer], probs


def test_sampled_factor_matches_its_closed_form_expectation(tmp_path):
    n = 8000
    x, y = _data(n)
    ic = _fit(tmp_path / "s", "kfac", "sampled", x, y, batch=1000)
    grads, probs = _per_label_outgrads(_model(), x)
    outer = [torch.einsum("nci,ncj->ncij", g, g) for g in grads]  # [N, C, d, d]
    entries = sum(o.shape[-1] ** 2 for o in outer)
    empirical = _fit(tmp_path / "e", "kfac", "loss", x, y, batch=1000)
    for f, fe, o in zip(ic._precond.factors, empirical._precond.factors, outer):
        _, s_cov = f.covariances()
        expected = (probs[:, :, None, None] * o).sum((0, 1)) / n
        spread = (o.amax(1) - o.amin(1)).pow(2).sum(0)
        tol = torch.sqrt(spread * math.log(2 * entries / DELTA) / 2) / n
        assert (s_cov - expected).abs().le(tol).all()
        # The observed labels' (empirical) Fisher is outside the same bound: the test can fail.
        _, s_emp = fe.covariances()
        assert (s_emp - expected).abs().gt(tol).any()
        # The input side does not depend on labels.
        torch.testing.assert_close(f.covariances()[0], fe.covariances()[0], rtol=0, atol=0)


def test_draws_follow_the_probabilities_and_not_the_batch():
    """Frequencies within Hoeffding's bound ``sqrt(log(2C/δ) / 2N)`` of ``p`` (union over C)."""
    n = 20000
    p = torch.tensor([0.1, 0.6, 0.3], dtype=torch.float64)
    logits = p.log().expand(n, 3)
    rows = torch.arange(n)
    labels = draw_labels(logits, rows, key=derive_key(3))
    freq = torch.bincount(labels, minlength=3).double() / n
    assert (freq - p).abs().max() <= math.sqrt(math.log(2 * 3 / DELTA) / (2 * n))
    # Row r's draw is the same whatever batch it arrives in.
    split = torch.cat(
        [
            draw_labels(logits[:7], rows[:7], derive_key(3)),
            draw_labels(logits[7:100], rows[7:100], derive_key(3)),
        ]
    )
    assert torch.equal(split, labels[:100])
    # Positions: [B, P, C] logits draw one label per position.
    per_pos = draw_labels(logits[:12].reshape(3, 4, 3), torch.arange(3), derive_key(3))
    assert per_pos.shape == (3, 4)


def test_same_seed_gives_identical_factors_and_curvature(tmp_path):
    x, y = _data(60)
    first = _fit(tmp_path / "a", "ekfac", "sampled", x, y, seed=5, batch=20)
    second = _fit(tmp_path / "b", "ekfac", "sampled", x, y, seed=5, batch=20)
    other = _fit(tmp_path / "c", "ekfac", "sampled", x, y, seed=6, batch=20)
    for f1, f2, f3 in zip(first._precond.factors, second._precond.factors, other._precond.factors):
        assert torch.equal(f1.g_sum, f2.g_sum)
        assert torch.equal(f1.a_sum, f2.a_sum)
        assert not torch.equal(f1.g_sum, f3.g_sum)
    for ic in (first, second):
        ic.finalize_features()
    for c1, c2 in zip(first.preconditioner(0).eigen, second.preconditioner(0).eigen):
        for t1, t2 in zip(c1, c2):
            assert torch.equal(t1, t2)
    # Another checkpoint id draws other labels.
    again = _fit(tmp_path / "d", "ekfac", "sampled", x, y, seed=5, batch=20, model_id=1)
    assert not torch.equal(again._precond.factors[1].g_sum, first._precond.factors[1].g_sum)


def test_sampled_ekfac_corrects_with_sampled_label_gradients(tmp_path):
    """EK-FAC's eigenvalues are the mean squares of the sampled-label gradients in the basis."""
    n = 40
    x, y = _data(n)
    ic = _fit(tmp_path, "ekfac", "sampled", x, y, seed=2, batch=20)
    ic.finalize_features()
    model = _model()
    logits = model(x)
    drawn = draw_labels(logits, torch.arange(n), derive_key(2, 0, _SAMPLE_STREAM))
    rows = []
    for i in range(n):
        model.zero_grad()
        F.cross_entropy(model(x[i : i + 1]), drawn[i : i + 1]).backward()
        rows.append(
            [torch.cat([m.weight.grad, m.bias.grad[:, None]], 1).reshape(-1) for m in model[::2]]
        )
    stored = torch.as_tensor(np.asarray(ic.stored_features(0, "fisher_grads")[:]))
    want = torch.stack([torch.cat(r) for r in rows])
    torch.testing.assert_close(stored, want, rtol=1e-12, atol=1e-14)
    for layer, (q_a, q_s, values) in enumerate(ic.preconditioner(0).eigen):
        g = torch.stack([r[layer] for r in rows])
        rotated = torch.stack(
            [(q_s.T @ gi.reshape(q_s.shape[0], -1) @ q_a).reshape(-1) for gi in g]
        )
        torch.testing.assert_close(values, rotated.pow(2).mean(0), rtol=1e-12, atol=1e-14)


class _NoSampler(AbstractModelOutput):
    """A task with a batched output but no sampled loss."""

    @staticmethod
    def get_output(model, weights, buffers, *example):
        return torch.func.functional_call(model, (weights, buffers), (example[0][None],)).sum()

    def get_out_to_loss_grad(self, model, weights, buffers, batch):
        return torch.ones(batch[0].shape[0], 1)

    @staticmethod
    def get_batch_output(model, x, y):
        return model(x).sum(1)


def test_a_task_that_cannot_sample_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"`curvature`='sampled' draws labels .* _NoSampler"):
        InfluenceComputer(_model(), _NoSampler(), 10, tmp_path, curvature="sampled")
    # The other curvatures still work for it.
    InfluenceComputer(_model(), _NoSampler(), 10, tmp_path / "ok", curvature="output")


def test_settings_refusal_lists_and_records_the_sampled_curvature(tmp_path):
    with pytest.raises(ValueError, match=r"\['loss', 'output', 'sampled'\], got 'fisher'"):
        InfluenceComputer(_model(), "image_classification", 10, tmp_path, curvature="fisher")
    InfluenceComputer(_model(), "image_classification", 10, tmp_path / "s", curvature="sampled")
    with pytest.raises(SettingsMismatchError, match="sampled"):
        InfluenceComputer(_model(), "image_classification", 10, tmp_path / "s", curvature="loss")
    with pytest.raises(SettingsMismatchError, match="sample_seed"):
        InfluenceComputer(
            _model(),
            "image_classification",
            10,
            tmp_path / "s",
            curvature="sampled",
            sample_seed=1,
        )
    with pytest.raises(ValueError, match="`curvature`='sampled' needs a per-layer method"):
        TRAKer(
            _model(),
            "image_classification",
            10,
            save_dir=tmp_path / "t",
            proj_dim=4,
            progress=False,
            curvature="sampled",
        )


class _Registered(_NoSampler):
    """Like _NoSampler, with a sampled loss registered by the user."""


def test_a_registered_sampled_loss_is_used(tmp_path):
    from gradsketch.attribution import SAMPLED_LOSSES, register_sampled_loss

    calls = []

    @register_sampled_loss(_Registered)
    def loss(task, output, batch, draw):
        calls.append(output.shape)
        return F.cross_entropy(output, draw(output), reduction="none")

    try:
        x, y = _data(8)
        ic = InfluenceComputer(
            _model(),
            _Registered(),
            8,
            tmp_path,
            method="kfac",
            curvature="sampled",
            progress=False,
        )
        ic.load_checkpoint(_model().state_dict(), model_id=0)
        ic.featurize((x, y), num_samples=8)
        assert calls == [torch.Size([8, CLASSES])]
    finally:
        SAMPLED_LOSSES.pop(_Registered)
    with pytest.raises(TypeError, match="`task_types` must be AbstractModelOutput"):
        register_sampled_loss(nn.Linear)
