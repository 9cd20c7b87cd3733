"""The language-modeling task on tiny Hugging Face causal LMs, against float64 references."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch import nn

from gradsketch._settings import SettingsMismatchError
from gradsketch.attribution import (
    BatchFormatError,
    FunctionalGradientComputer,
    HookGradientComputer,
    LanguageModelingModelOutput,
    TRAKer,
)
from gradsketch.sketch import FactorizedProjector, NoOpProjector

transformers = pytest.importorskip("transformers")

F64 = torch.float64
VOCAB, SEQ = 48, 6
TASK = LanguageModelingModelOutput()


def tiny_llama(dtype=F64):
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(dtype).eval()


def tiny_neox(dtype=F64):
    cfg = transformers.GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
    )
    torch.manual_seed(0)
    return transformers.GPTNeoXForCausalLM(cfg).to(dtype).eval()


FAMILIES = {"llama": tiny_llama, "gpt-neox": tiny_neox}


def padded_batch(n=5, seq=SEQ, seed=1, pad_id=0):
    """``n`` sequences of lengths ``seq, seq - 1, ...`` (at least 2), right-padded."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, seq), generator=gen)
    lengths = [max(2, seq - i) for i in range(n)]
    mask = torch.zeros(n, seq, dtype=torch.long)
    for i, length in enumerate(lengths):
        mask[i, :length] = 1
    return ids.masked_fill(mask == 0, pad_id), mask, lengths


def reference_log_odds(model, ids, labels):
    """``Σ_t log p_t - log(1 - p_t)`` over labelled tokens, from log-softmax (own formula)."""
    logits = model(input_ids=ids, use_cache=False).logits
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    target = labels[:, 1:]
    valid = target != -100
    lp = logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    odds = lp - torch.log1p(-lp.exp())
    return (odds * valid).sum()


def loop_grads(model, ids, mask, labels, names):
    """Per-example gradients from one unpadded example at a time (float64 backward)."""
    params = dict(model.named_parameters())
    out = []
    for b in range(ids.shape[0]):
        length = int(mask[b].sum())
        f = reference_log_odds(model, ids[b : b + 1, :length], labels[b : b + 1, :length])
        grads = torch.autograd.grad(f, [params[n] for n in names], allow_unused=True)
        out.append(
            {
                n: torch.zeros_like(params[n]) if g is None else g
                for n, g in zip(names, grads, strict=True)
            }
        )
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_per_example_gradients_equal_float64_loop_and_padding_contributes_nothing(family):
    """Hooks on a right-padded batch == single-example backward passes on the unpadded rows."""
    model = FAMILIES[family]()
    ids, mask, _ = padded_batch()
    batch = TASK.as_batch({"input_ids": ids, "attention_mask": mask})
    gc = HookGradientComputer(model, TASK)
    got = gc.compute_per_sample_grad(batch)
    names = list(got)
    assert names == [n for n, _ in model.named_parameters()]
    for b, ref in enumerate(loop_grads(model, *batch, names)):
        for n in names:
            torch.testing.assert_close(got[n][b], ref[n], rtol=1e-9, atol=1e-12, msg=n)
    # Other pad ids (and labels there) change nothing: the mask and -100 rule.
    other = ids.masked_fill(mask == 0, VOCAB - 1)
    again = gc.compute_per_sample_grad(TASK.as_batch((other, mask)))
    for n in names:
        torch.testing.assert_close(again[n], got[n], rtol=0, atol=1e-13)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_out_to_loss_is_the_token_mean_of_one_minus_p(family):
    model = FAMILIES[family]()
    ids, mask, lengths = padded_batch()
    batch = TASK.as_batch((ids, mask))
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=ids, use_cache=False).logits, -1)
    expected = []
    for b, length in enumerate(lengths):
        p = probs[b, : length - 1].gather(-1, ids[b, 1:length, None]).squeeze(-1)
        expected.append((1 - p).mean())
    gc = HookGradientComputer(model, TASK)
    direct = gc.compute_loss_grad(batch)  # a forward of its own
    gc.compute_per_sample_grad(batch)
    reused = gc.compute_loss_grad(batch)  # the hooked forward's logits
    torch.testing.assert_close(direct.reshape(-1), torch.stack(expected), rtol=1e-12, atol=0)
    torch.testing.assert_close(reused, direct, rtol=0, atol=0)


class ToyCausalLM(nn.Module):
    """Embedding, a causal running mean and a head: vmap-traceable, unlike HF models."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, input_ids, attention_mask=None):
        h = self.emb(input_ids)
        steps = torch.arange(1, h.shape[1] + 1, dtype=h.dtype).reshape(1, -1, 1)
        return self.head(torch.tanh(self.mix(h.cumsum(1) / steps)))


def test_vmap_and_hooks_agree_on_a_traceable_causal_lm():
    torch.manual_seed(0)
    model = ToyCausalLM().double().eval()
    ids, mask, _ = padded_batch()
    batch = TASK.as_batch((ids, mask))
    hooks = HookGradientComputer(model, TASK).compute_per_sample_grad(batch)
    vmapped = FunctionalGradientComputer(model, TASK).compute_per_sample_grad(batch)
    for n in hooks:
        torch.testing.assert_close(hooks[n], vmapped[n], rtol=1e-10, atol=1e-12, msg=n)


def test_batch_forms():
    ids, mask, _ = padded_batch(n=2)
    labels = ids.masked_fill(mask == 0, -100)
    for form in ({"input_ids": ids, "attention_mask": mask}, (ids, mask), (ids, mask, labels)):
        got = TASK.as_batch(form)
        for a, b in zip(got, (ids, mask, labels), strict=True):
            assert torch.equal(a, b)
    plain = TASK.as_batch((ids,))
    assert torch.equal(plain[1], torch.ones_like(ids)) and torch.equal(plain[2], ids)
    custom = labels.clone()
    custom[:, :3] = -100
    assert torch.equal(TASK.as_batch({"input_ids": ids, "labels": custom})[2], custom)


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        pytest.param({"ids": torch.ones(2, 3)}, "without 'input_ids'", id="no-input-ids"),
        pytest.param((torch.ones(2, 3),) * 4, "has 4 entries", id="tuple-length"),
        pytest.param((torch.ones(3, dtype=torch.long),), r"\[batch, seq_len\]", id="1-d"),
        pytest.param(
            (torch.ones(2, 3, dtype=torch.long), torch.ones(2, 4)), "`attention_mask` has shape"
        ),
    ],
)
def test_batch_errors(batch, match):
    with pytest.raises(BatchFormatError, match=match):
        TASK.as_batch(batch)


# -- TRAKer end to end, without projection -------------------------------------------
#: Two small weights, so the float64 reference inverts a 512 x 512 Gram matrix.
WEIGHTS = "*.layers.1.self_attn.q_proj.weight|*.layers.1.mlp.down_proj.weight"
LAMBDA = 1e-3


def reference_scores(model, train, queries, names, per_token=False):
    """TRAK scores in float64 from loop gradients: X (XᵀX + λI)⁻¹ Tᵀ ⊙ Q, no projection."""

    def rows(batch, per_token):
        out = []
        for g in loop_grads(model, *batch, names):
            out.append(torch.cat([g[n].reshape(-1) for n in names]))
        return torch.stack(out)

    x = rows(train, False)
    d = x.shape[1]
    x = x / d**0.5
    q = TASK.get_out_to_loss_grad(
        model, dict(model.named_parameters()), dict(model.named_buffers()), train
    ).reshape(-1, 1)
    if per_token:
        queries = TASK.per_token_batch(queries)
    t = rows(queries, per_token) / d**0.5
    inv = torch.linalg.inv(x.T @ x + LAMBDA * torch.eye(d, dtype=F64))
    return (x @ inv @ t.T) * q


def _traker(model, tmp_path, n, **kw):
    return TRAKer(
        model,
        "language_modeling",
        n,
        save_dir=tmp_path,
        device="cpu",
        gradient_computer=HookGradientComputer,
        projector=NoOpProjector(),
        grad_wrt=WEIGHTS,
        lambda_reg=LAMBDA,
        progress=False,
        logging_level=logging.WARNING,
        **kw,
    )


@pytest.fixture(scope="module")
def lm_case():
    """A float64 tiny Llama, 12 training sequences, 3 queries (right-padded)."""
    model = tiny_llama()
    ids, mask, _ = padded_batch(n=12, seed=3)
    qids, qmask, _ = padded_batch(n=3, seed=4)
    return model, TASK.as_batch((ids, mask)), TASK.as_batch((qids, qmask))


def test_scores_and_per_token_scores_equal_float64_reference(tmp_path, lm_case):
    model, train, queries = lm_case
    traker = _traker(model, tmp_path, 12)
    names = traker.grad_wrt
    assert names == [
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
    ]
    traker.load_checkpoint(model.state_dict(), model_id=0)
    traker.featurize(tuple(t[:7] for t in train), num_samples=7)
    traker.featurize({"input_ids": train[0][7:], "attention_mask": train[1][7:]}, num_samples=5)
    traker.finalize_features()
    traker.start_scoring_checkpoint("q", model.state_dict(), 0, num_targets=3, per_token=True)
    traker.score(queries, num_samples=3)
    scores = traker.finalize_scores("q")
    tokens = traker.finalize_scores("q", per_token=True)
    assert scores.shape == (12, 3) and tokens.shape == (12, 3, SEQ)

    ref = reference_scores(model, train, queries, names).numpy()
    ref_tokens = reference_scores(model, train, queries, names, per_token=True).numpy()
    scale = np.abs(ref).max()
    np.testing.assert_allclose(scores, ref, rtol=0, atol=2e-4 * scale)
    np.testing.assert_allclose(tokens.reshape(12, -1), ref_tokens, rtol=0, atol=2e-4 * scale)
    # Token scores add up to the query's; the first token and padding score 0.
    np.testing.assert_allclose(tokens.sum(-1), scores, rtol=0, atol=1e-5 * scale)
    assert np.all(tokens[:, :, 0] == 0)
    qmask = queries[1].numpy().astype(bool)
    assert np.all(tokens[:, ~qmask] == 0)


def test_per_token_errors(tmp_path, lm_case):
    model, train, queries = lm_case
    traker = _traker(model, tmp_path, 12)
    traker.load_checkpoint(model.state_dict(), model_id=0)
    traker.featurize(train, num_samples=12)
    traker.finalize_features()
    traker.start_scoring_checkpoint("plain", model.state_dict(), 0, num_targets=3)
    traker.score(queries, num_samples=3)
    with pytest.raises(ValueError, match="not started with per_token=True"):
        traker.finalize_scores("plain", per_token=True)
    with pytest.raises(SettingsMismatchError, match="per_token=False, requested True"):
        traker.start_scoring_checkpoint("plain", model.state_dict(), 0, 3, per_token=True)
    traker.start_scoring_checkpoint("tok", model.state_dict(), 0, num_targets=3, per_token=True)
    traker.score(tuple(t[:1] for t in queries), num_samples=1)
    with pytest.raises(ValueError, match="pad every target to the same length"):
        traker.score(tuple(t[1:, :4] for t in queries), num_samples=2)
    image = TRAKer(
        nn.Linear(3, 2),
        "image_classification",
        4,
        save_dir=tmp_path / "img",
        device="cpu",
        proj_dim=4,
        progress=False,
        logging_level=logging.WARNING,
    )
    with pytest.raises(ValueError, match="needs a task with per-token outputs"):
        image.start_scoring_checkpoint("x", image.model.state_dict(), 0, 1, per_token=True)


def test_restriction_recorded_and_resume_with_another_refused(tmp_path, lm_case):
    model, _, _ = lm_case
    traker = _traker(model, tmp_path, 12)
    stored = traker.settings.grad_wrt
    assert stored == traker.grad_wrt and len(stored) == 2
    with pytest.raises(SettingsMismatchError, match="grad_wrt"):
        TRAKer(
            model,
            "language_modeling",
            12,
            save_dir=tmp_path,
            device="cpu",
            gradient_computer=HookGradientComputer,
            projector=NoOpProjector(),
            grad_wrt="*.layers.0.self_attn.q_proj.weight",
            progress=False,
            logging_level=logging.WARNING,
        )


def test_featurize_loader_reads_dicts_and_datasets_like_tuples(tmp_path, lm_case):
    datasets = pytest.importorskip("datasets")
    model, train, _ = lm_case
    ids, mask, _ = train
    rows = [ids[i, : int(mask[i].sum())].tolist() for i in range(12)]
    texts = [f"row {i}" for i in range(12)]
    sources = {
        "tuples": [tuple(t[i : i + 4] for t in train) for i in range(0, 12, 4)],
        "dicts": [{"input_ids": ids[i : i + 5], "attention_mask": mask[i : i + 5]} for i in (0, 5)]
        + [{"input_ids": ids[10:], "attention_mask": mask[10:]}],
        # Ragged token lists (padded per batch) next to a text column the task ignores.
        "dataset": datasets.Dataset.from_dict({"text": texts, "input_ids": rows}),
    }
    features = {}
    for name, source in sources.items():
        traker = _traker(model, tmp_path / name, 12)
        traker.load_checkpoint(model.state_dict(), model_id=0)
        traker.featurize_loader(source, batch_size=3)
        traker.finalize_features()
        features[name] = np.asarray(traker.store.array("checkpoints/0/grads")[:])
        q = np.asarray(traker.store.array("checkpoints/0/out_to_loss")[:])
        features[name + "/q"] = q
        # score_loader reads the same inputs (the training rows as targets here).
        traker.start_scoring_checkpoint("t", model.state_dict(), 0, num_targets=12)
        traker.score_loader(source, batch_size=5)
        traker.store.flush()
        features[name + "/t"] = np.asarray(traker.store.array("experiments/t/0/grads")[:])
    for name in ("dicts", "dataset"):
        for part in ("", "/q", "/t"):
            np.testing.assert_allclose(
                features[name + part], features["tuples" + part], rtol=1e-6, atol=1e-9
            )
    np.testing.assert_allclose(features["tuples/t"], features["tuples"], rtol=1e-6, atol=1e-9)


def test_dataset_without_the_task_columns_is_refused(tmp_path, lm_case):
    datasets = pytest.importorskip("datasets")
    model, _, _ = lm_case
    traker = _traker(model, tmp_path, 2)
    traker.load_checkpoint(model.state_dict(), model_id=0)
    with pytest.raises(BatchFormatError, match="needs 'input_ids'"):
        traker.featurize_loader(datasets.Dataset.from_dict({"text": ["a", "b"]}))


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_model_featurized_in_its_dtype_with_float32_features(tmp_path, half):
    """Half weights stay half; features (float32) match the float32 model's to half accuracy.

    bf16 keeps 8 bits of mantissa (relative rounding 2^-9 ≈ 2e-3 per operation,
    fp16 2^-12); through two layers and the per-token sums the features agree
    to a few 1e-2 of their largest entry.
    """
    ids, mask, _ = padded_batch(n=8, seed=5)
    out = {}
    for dtype in (torch.float32, half):
        model = tiny_llama(dtype)
        traker = TRAKer(
            model,
            "language_modeling",
            8,
            save_dir=tmp_path / str(dtype),
            device="cpu",
            gradient_computer=HookGradientComputer,
            projector=FactorizedProjector.from_budget(model, 64, seed=0),
            progress=False,
            logging_level=logging.WARNING,
        )
        traker.load_checkpoint(model.state_dict(), model_id=0)
        traker.featurize({"input_ids": ids, "attention_mask": mask}, num_samples=8)
        traker.finalize_features()
        assert all(p.dtype == dtype for p in model.parameters())
        grads = traker.store.array("checkpoints/0/grads")
        assert grads.dtype == np.float32
        out[dtype] = np.asarray(grads[:]), np.asarray(traker.store.array("checkpoints/0/xtx")[:])
    (f32, xtx32), (bf16, xtx16) = out[torch.float32], out[half]
    assert np.isfinite(bf16).all() and np.isfinite(xtx16).all()
    np.testing.assert_allclose(bf16, f32, rtol=0, atol=3e-2 * np.abs(f32).max())
    np.testing.assert_allclose(xtx16, xtx32, rtol=0, atol=6e-2 * np.abs(xtx32).max())


def _masked_log_odds(z, labels):
    """``z_y - logsumexp_{j≠y} z_j`` from a masked copy (the obvious formula), float64."""
    target = labels[:, 1:]
    valid = target != -100
    safe = target.clamp(min=0).unsqueeze(-1)
    is_label = torch.arange(z.shape[-1]) == safe
    zz = z[:, :-1]
    odds = zz.gather(-1, safe).squeeze(-1) - zz.masked_fill(is_label, float("-inf")).logsumexp(-1)
    odds = odds.masked_fill(~valid, 0.0)
    return torch.cat([torch.zeros_like(odds[:, :1]), odds], dim=1)


def test_token_log_odds_float32_within_rounding_of_float64_and_confident_tokens_exact():
    """The fused log-odds in float32 against the masked float64 formula, values and gradients.

    Rounding: ``f = z_y - max z - log Σ_{j≠y} exp(z_j - max z)``; each of the
    ``V`` terms is rounded once (relative ``u = 2⁻²⁴``), their sum adds at
    most ``u log₂ V`` relative (pairwise), the log turns a relative error
    into an absolute one, and the subtractions of numbers up to ``M = max
    |z|`` add ``2 u M``: ``|Δf| ≤ u (2 M + log₂ V + 2)``; the gradient
    ``onehot - softmax_{j≠y}`` has entries ≤ 1 with the same error through
    ``exp(z - (z_y - f))``, times ``1 + M``. Tolerances use 4× these. Three
    tokens are confident (``1 - p`` near 1e-4, 1e-6 and 1e-9): a formula
    through ``log(1 - p)`` with ``p`` rounded to float32 would be off there
    by up to ``u / (1 - p)``, 0.06 at 1e-6, far outside the tolerance.
    """
    from gradsketch.attribution._lm import token_log_odds

    gen = torch.Generator().manual_seed(0)
    b, t, v = 3, 7, 301
    z64 = 3 * torch.randn(b, t, v, generator=gen, dtype=F64)
    labels = torch.randint(0, v, (b, t), generator=gen)
    labels[0, 4] = -100
    for (row, pos), margin in zip([(1, 2), (2, 4), (0, 5)], [16.0, 21.0, 28.0], strict=True):
        z64[row, pos, labels[row, pos + 1]] = z64[row, pos].max() + margin
    m = float(z64.abs().max())
    u = 2.0**-24
    tol = 4 * u * (2 * m + np.log2(v) + 2)
    ref = z64.clone().requires_grad_()
    f_ref = _masked_log_odds(ref, labels)
    weights = torch.randn(b, t, generator=gen, dtype=F64)
    (f_ref * weights).sum().backward()
    z = z64.float().requires_grad_()
    f = token_log_odds(z, labels)
    (f * weights.float()).sum().backward()
    assert f.dtype == torch.float32 and (f[0, 4] == 0).item() and (f[:, 0] == 0).all()
    assert f_ref[1, 3].item() > 9 and f_ref[0, 6].item() > 20  # the confident tokens
    torch.testing.assert_close(f.double(), f_ref.detach(), rtol=0, atol=tol)
    scale = float(weights.abs().max())
    torch.testing.assert_close(z.grad.double(), ref.grad, rtol=0, atol=tol * (1 + m) * scale)
    # float64: the same numbers as the masked formula, and exact higher derivatives.
    exact = token_log_odds(z64, labels)
    torch.testing.assert_close(exact, f_ref.detach(), rtol=1e-13, atol=1e-12)
    small = z64[:2, :3, :11].clone().requires_grad_()
    lab = labels[:2, :3] % 11
    assert torch.autograd.gradcheck(lambda x: token_log_odds(x, lab), (small,))
    assert torch.autograd.gradgradcheck(lambda x: token_log_odds(x, lab), (small,))


def test_token_log_odds_stays_finite_past_float32_exp_range():
    """A label 300 nats above every other logit: ``exp`` of the others relative to it
    underflows in float32, but the others are summed relative to their own largest,
    so ``f`` and its gradient are finite and match float64 (the bound of the test
    above, with ``M = 300``)."""
    from gradsketch.attribution._lm import token_log_odds

    gen = torch.Generator().manual_seed(5)
    z64 = torch.randn(2, 4, 50, generator=gen, dtype=F64)
    labels = torch.randint(0, 50, (2, 4), generator=gen)
    z64[1, 1, labels[1, 2]] = 300.0
    ref = z64.clone().requires_grad_()
    f_ref = _masked_log_odds(ref, labels)
    f_ref.sum().backward()
    z = z64.float().requires_grad_()
    f = token_log_odds(z, labels)
    f.sum().backward()
    assert torch.isfinite(f).all() and torch.isfinite(z.grad).all()
    assert f_ref[1, 2].item() > 290
    tol = 4 * 2.0**-24 * (2 * 300 + np.log2(50) + 2)
    torch.testing.assert_close(f.double(), f_ref.detach(), rtol=0, atol=tol)
    torch.testing.assert_close(z.grad.double(), ref.grad, rtol=0, atol=tol * 301)


def test_token_log_odds_per_example_gradients_under_vmap_equal_a_loop():
    """``torch.func.vmap(grad(...))`` over the fused log-odds == one example at a time (float64)."""
    from gradsketch.attribution._lm import token_log_odds

    gen = torch.Generator().manual_seed(3)
    z = torch.randn(4, 5, 17, generator=gen, dtype=F64)
    labels = torch.randint(0, 17, (4, 5), generator=gen)
    labels[1, 2] = -100

    def out(zb, lb):
        return token_log_odds(zb[None], lb[None]).sum()

    batched = torch.func.vmap(torch.func.grad(out))(z, labels)
    for i in range(4):
        zi = z[i].clone().requires_grad_()
        _masked_log_odds(zi[None], labels[i][None]).sum().backward()
        torch.testing.assert_close(batched[i], zi.grad, rtol=1e-12, atol=1e-14)
