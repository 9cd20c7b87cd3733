"""Metagradients by replaying training: finite differences, torch's optimizers, blocks, store."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradsketch._settings import SettingsMismatchError
from gradsketch._store import RowStore
from gradsketch.attribution import (
    AbstractModelOutput,
    MemoryBudgetError,
    ReplayAttributor,
    ReplaySettings,
    batch_order,
)
from gradsketch.attribution._replay import JVP_MIN_BLOCK
from helpers.attribution import (
    REPLAY_BATCH,
    REPLAY_N,
    REPLAY_OPTIMIZERS,
    REPLAY_STEPS,
    replay_data,
    replay_mlp,
    trained_replay,
)

N, STEPS, BATCH = REPLAY_N, REPLAY_STEPS, REPLAY_BATCH
OPTIMIZERS = REPLAY_OPTIMIZERS
_replay = trained_replay


def _central_difference(r: ReplayAttributor, queries, i: int, h: float = 1e-5) -> torch.Tensor:
    """``(f(w + h e_i) - f(w - h e_i)) / 2h`` by retraining the run twice (float64)."""
    plus = torch.ones(r.n_train, dtype=torch.float64)
    minus = plus.clone()
    plus[i] += h
    minus[i] -= h
    return (r.outputs(queries, r.retrain(plus)) - r.outputs(queries, r.retrain(minus))) / (2 * h)


def _torch_final(r: ReplayAttributor, no_decay: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """:func:`replay_mlp` trained by torch's own optimizer on the run's batches and rates;
    the parameters in ``no_decay`` form a second group without weight decay."""
    model = replay_mlp()
    x, y = replay_data(N)
    s = r.settings
    params = dict(model.named_parameters())
    groups = [{"params": [p for n, p in params.items() if n not in no_decay]}]
    if no_decay:
        groups.append({"params": [params[n] for n in no_decay], "weight_decay": 0.0})
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
    args = {"weight_decay": s.weight_decay}
    if s.optimizer == "sgd":
        args["momentum"] = s.momentum
    else:
        args.update(betas=s.betas, eps=s.eps)
    opt = cls[s.optimizer](groups, lr=s.lr_at(0), **args)
    for t, idx in enumerate(r.order):
        for group in opt.param_groups:
            group["lr"] = s.lr_at(t)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
    return {n: p.detach() for n, p in params.items()}


@pytest.mark.parametrize(("optimizer", "kw"), OPTIMIZERS)
def test_metagradient_equals_central_difference_through_the_run(optimizer, kw):
    """∂f/∂w_i equals (f(w + h e_i) - f(w - h e_i)) / 2h through all T steps, in float64.

    Tolerance: the central difference errs by ``h² |f'''| / 6`` (``|f'''| ≲ 10``
    on this 10-step run: under 2e-10 at ``h = 1e-5``) plus rounding
    ``T ε |f| / h ≈ 10 · 1.1e-16 · 2 / 1e-5 ≈ 2e-10``; 1e-8 leaves a factor
    of 25 and is still 6 orders below the metagradients (~0.1). Both pull-backs
    are checked: reverse-over-reverse (blocks under ``JVP_MIN_BLOCK``) and
    forward-over-reverse (forced for the block of 3).
    """
    r = _replay(optimizer, kw)
    x, y = replay_data(N)
    queries = (x[:3], y[:3])
    scores = r.metagradients(queries)
    assert scores.shape == (N, 3) and scores.dtype == torch.float64
    assert r._vmap_ok is None  # the block of 3 took reverse-over-reverse
    r._jvp_min_block = 1
    by_jvp = r.metagradients(queries)
    assert r._vmap_ok is True
    for i in (0, 11):
        fd = _central_difference(r, queries, i)
        torch.testing.assert_close(scores[i], fd, rtol=0, atol=1e-8)
        torch.testing.assert_close(by_jvp[i], fd, rtol=0, atol=1e-8)
        assert fd.abs().max() > 1e-3  # the check is not vacuous


@pytest.mark.parametrize(("optimizer", "kw"), OPTIMIZERS)
def test_training_matches_torch_optimizers(optimizer, kw):
    """The replay's own optimizer is torch's: same batches, same final weights (float64).

    Only rounding differs (torch fuses some ops): 1e-12 relative over 10 steps.
    """
    r = _replay(optimizer, kw)
    for name, p in _torch_final(r).items():
        torch.testing.assert_close(r.final[name], p, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    ("optimizer", "kw"),
    [
        ("sgd", {"lr": 0.3, "momentum": 0.9, "weight_decay": 0.05}),
        ("adam", {"lr": 0.05, "weight_decay": 0.05, "eps": 1e-6}),
        ("adamw", {"lr": 0.05, "weight_decay": 0.1}),
    ],
    ids=["sgd-momentum", "adam-l2", "adamw"],
)
def test_parameters_without_weight_decay_train_and_reverse_exactly(optimizer, kw):
    """``no_decay`` splits the flat buffers into two decay groups; both are exact.

    Training equals torch's optimizer with two parameter groups (rounding
    only: 1e-12 relative, as above), and the metagradients of both pull-backs
    equal the central difference within the first test's 1e-8.
    """
    no_decay = ("0.bias", "2.bias")
    r = _replay(optimizer, kw, no_decay=list(no_decay))
    assert [g[2] for g in r._layout.groups] == [kw["weight_decay"], 0.0]
    for name, p in _torch_final(r, no_decay).items():
        torch.testing.assert_close(r.final[name], p, rtol=1e-12, atol=1e-14)
    x, y = replay_data(N)
    queries = (x[:3], y[:3])
    by_autograd = r.metagradients(queries)
    r._jvp_min_block = 1
    by_jvp = r.metagradients(queries)
    i = 7
    fd = _central_difference(r, queries, i)
    assert fd.abs().max() > 1e-3
    torch.testing.assert_close(by_autograd[i], fd, rtol=0, atol=1e-8)
    torch.testing.assert_close(by_jvp[i], fd, rtol=0, atol=1e-8)


def test_a_model_of_two_dtypes_is_refused():
    x, y = replay_data(N)
    model = replay_mlp()
    model[2].float()
    with pytest.raises(ValueError, match=r"2 dtypes or devices.*model\.to\(torch\.float64\)"):
        ReplayAttributor(model, "image_classification", (x, y), num_steps=2, progress=False)


@pytest.mark.parametrize(
    "jvp_min_block", [1, JVP_MIN_BLOCK], ids=["forward-over-reverse", "autograd"]
)
@pytest.mark.parametrize(("optimizer", "kw"), OPTIMIZERS[::2])
def test_a_block_of_queries_equals_one_query_at_a_time(optimizer, kw, jvp_min_block):
    """Carrying m cotangents through one pass equals m passes, within a derived bound.

    Both compute the same sums; the batched VJP only sums in another order. Each
    step's contractions run over at most D = 5 terms (width and batch), and a
    reordered sum of D terms differs by at most D ε Σ|terms|; over T = 10 steps
    that is ``T D ε max|s| ≈ 10 · 5 · 1.1e-16 · 2 ≈ 1.1e-14``.
    """
    r = _replay(optimizer, kw)
    r._jvp_min_block = jvp_min_block
    x, y = replay_data(N)
    block = r.metagradients((x[:3], y[:3]))
    single = torch.cat([r.metagradients((x[j : j + 1], y[j : j + 1])) for j in range(3)], dim=1)
    bound = STEPS * 5 * torch.finfo(torch.float64).eps * float(block.abs().max())
    assert float((block - single).abs().max()) <= bound
    # Blocks of two through the same path, and checkpoints at every step: same numbers.
    torch.testing.assert_close(
        r.metagradients((x[:3], y[:3]), query_block=2), block, rtol=0, atol=bound
    )
    dense = _replay(optimizer, kw, checkpoint_every=1)
    dense._jvp_min_block = jvp_min_block
    assert torch.equal(dense.metagradients((x[:3], y[:3])), block)


def test_checkpoints_every_sqrt_t_steps():
    r = _replay("sgd", {"lr": 0.1})
    assert r.every == 4 and sorted(r.checkpoints) == [0, 4, 8]


def test_memory_estimate_follows_the_formula_and_the_budget_sizes_blocks():
    r = _replay("adam", {"lr": 0.05})
    params = sum(p.numel() for p in r.params0.values())
    s = params * 8 * 3  # θ, exp_avg, exp_avg_sq in float64
    est = r.memory_estimate(4)
    assert r.state_bytes() == s
    # The segment also keeps each step's gradient for Adam's reverse rules.
    assert (est.checkpoints, est.segment, est.adjoints, est.scores) == (
        3 * s,
        4 * (s + params * 8),
        4 * s,
        4 * N * 8,
    )
    assert est.activations > 0 and est.total == sum(
        (est.checkpoints, est.segment, est.adjoints, est.scores, est.activations, est.graphs)
    )
    # Blocks under JVP_MIN_BLOCK keep the segment's k = 4 step graphs; larger ones keep none.
    plain, kept = r._measure_activations()
    assert kept > plain > 0
    assert est.graphs == 4 * kept
    assert r.memory_estimate(JVP_MIN_BLOCK).graphs == 0
    x, y = replay_data(N)
    budget = r.memory_estimate(2).total
    fitted = ReplayAttributor(
        replay_mlp(),
        "image_classification",
        (x, y),
        optimizer="adam",
        lr=0.05,
        num_steps=STEPS,
        batch_size=BATCH,
        progress=False,
        memory_budget=budget,
    )
    assert fitted._block_size(6, None) == 1 or fitted._block_size(6, None) == 2
    fitted.train()
    torch.testing.assert_close(
        fitted.metagradients((x[:6], y[:6])), r.metagradients((x[:6], y[:6])), rtol=0, atol=1e-13
    )


def test_a_run_that_does_not_fit_the_budget_is_refused():
    x, y = replay_data(N)
    r = ReplayAttributor(
        replay_mlp(),
        "image_classification",
        (x, y),
        num_steps=STEPS,
        batch_size=BATCH,
        progress=False,
        memory_budget=1000,
    )
    r.train()
    with pytest.raises(MemoryBudgetError, match=r"`memory_budget`=1000 bytes is too small"):
        r.metagradients((x[:2], y[:2]))


def test_scores_are_stored_resumed_and_other_settings_refused(tmp_path):
    x, y = replay_data(N)
    queries = (x[:4], y[:4])

    def make(**kw: object) -> ReplayAttributor:
        return ReplayAttributor(
            replay_mlp(),
            "image_classification",
            (x, y),
            num_steps=STEPS,
            batch_size=BATCH,
            progress=False,
            save_dir=tmp_path,
            **{"lr": 0.2, "momentum": 0.5, **kw},
        )

    first = make()
    first.train()
    scores = first.score(queries, exp_name="q")
    torch.testing.assert_close(scores, first.metagradients(queries), rtol=0, atol=1e-14)
    # A fresh session reads them back without training.
    again = make()
    assert torch.equal(again.score(queries, exp_name="q"), scores)
    assert torch.equal(again.finalize_scores("q"), scores)
    # A killed run: two queries never flagged done are recomputed, the rest kept.
    store = RowStore(tmp_path / "q", first._record(queries))
    store.unflag("scores.done", np.array([1, 3]))
    with pytest.raises(RuntimeError, match=r"incomplete \(2 of 4 queries\)"):
        make().finalize_scores("q")
    resumed = make()
    resumed.train()
    torch.testing.assert_close(resumed.score(queries, exp_name="q"), scores, rtol=0, atol=1e-14)
    with pytest.raises(SettingsMismatchError, match=r"lr: stored 0.2, requested 0.3"):
        make(lr=0.3).score(queries, exp_name="q")
    with pytest.raises(SettingsMismatchError, match=r"queries: stored"):
        make().score((x[4:8], y[4:8]), exp_name="q")
    with pytest.raises(KeyError, match=r"`exp_name`='other' has no scores"):
        make().finalize_scores("other")


def test_damaged_stored_scores_are_refused_then_recomputed(tmp_path):
    """Issue 47: a bit-flipped chunk of the stored scores is named (array, chunk, file)
    when they are read back, never returned as NaN; scoring again recomputes it."""
    from gradsketch.errors import StoreIntegrityError

    x, y = replay_data(N)
    queries = (x[:4], y[:4])
    scores = _replay("sgd", {"lr": 0.2}, save_dir=tmp_path).score(queries, exp_name="q")
    chunk = tmp_path / "q" / "scores" / "c" / "0" / "0"
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    chunk.write_bytes(bytes(raw))
    match = r"`scores`: rows \[0, 1, 2, 3\].*chunk \(0, 0\) \(checksum mismatch\).*score\(queries"
    with pytest.raises(StoreIntegrityError, match=match):
        _replay("sgd", {"lr": 0.2}, save_dir=tmp_path).finalize_scores("q")
    again = _replay("sgd", {"lr": 0.2}, save_dir=tmp_path).score(queries, exp_name="q")
    torch.testing.assert_close(again, scores, rtol=0, atol=1e-14)


def test_topk_orders_each_querys_scores():
    r = _replay("sgd", {"lr": 0.3, "momentum": 0.9})
    x, y = replay_data(N)
    scores = r.score((x[:3], y[:3]))
    top = r.topk(3)
    for j in range(3):
        order = torch.argsort(scores[:, j].float(), descending=True)
        assert top.proponents[:, j].tolist() == order[:3].tolist()
        assert top.opponents[:, j].tolist() == order.flip(0)[:3].tolist()


def test_explicit_order_and_dict_data():
    x, y = replay_data(N)
    order = [[0, 1, 2], [3, 4], [5, 0, 7, 7]]
    r = ReplayAttributor(
        replay_mlp(),
        "image_classification",
        [(x[:6], y[:6]), (x[6:], y[6:])],
        order=order,
        lr=0.3,
        progress=False,
    )
    r.train()
    assert r.settings.num_steps == 3 and r.n_train == N
    s = r.metagradients((x[:2], y[:2]))
    # Never-seen rows have zero metagradient; row 7, used twice in one batch, is not zero.
    unseen = [6, 8, 9, 10, 11]
    assert torch.equal(s[unseen], torch.zeros(len(unseen), 2, dtype=s.dtype))
    assert s[7].abs().min() > 0


def test_batch_order_is_epochs_of_permutations():
    order = batch_order(10, 4, 6, seed=3)
    assert [len(b) for b in order] == [4, 4, 2, 4, 4, 2]
    assert sorted(torch.cat(order[:3]).tolist()) == list(range(10))
    assert all(torch.equal(a, b) for a, b in zip(order, batch_order(10, 4, 6, seed=3)))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"optimizer": "rmsprop"}, ValueError, r"`optimizer`='rmsprop' cannot be replayed; choose"),
        ({"lr": -1.0}, ValueError, r"`lr`"),
        ({"lr": []}, ValueError, r"`lr` is an empty list"),
        ({"momentum": 1.0}, ValueError, r"`momentum` must be in \[0, 1\)"),
        ({"betas": (0.9, 1.0)}, ValueError, r"`betas` must be two numbers"),
        ({"num_steps": 0}, ValueError, r"`num_steps`"),
        ({"checkpoint_every": 0}, ValueError, r"`checkpoint_every`"),
    ],
    ids=["optimizer", "lr", "lr-empty", "momentum", "betas", "num-steps", "checkpoint-every"],
)
def test_invalid_settings_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        ReplaySettings(**kwargs)


def test_invalid_use_is_refused():
    x, y = replay_data(N)
    model = replay_mlp()
    make = ReplayAttributor
    with pytest.raises(ValueError, match=r"`order` holds indices in \[0, 12\]"):
        make(model, "image_classification", (x, y), order=[[0, 12]], progress=False)
    with pytest.raises(ValueError, match=r"`lr` lists 2 rates for 3 steps"):
        make(model, "image_classification", (x, y), num_steps=3, lr=[0.1, 0.1], progress=False)
    with pytest.raises(TypeError, match=r"pass either `settings` or settings keywords"):
        make(model, "image_classification", (x, y), ReplaySettings(), lr=0.1)
    r = make(model, "image_classification", (x, y), num_steps=2, progress=False)
    with pytest.raises(RuntimeError, match=r"call `train\(\)` before scoring"):
        r.metagradients((x[:1], y[:1]))
    with pytest.raises(ValueError, match=r"`weights` has 3 entries but the training set has 12"):
        r.retrain(torch.ones(3))
    with pytest.raises(ValueError, match=r"`per_token=True` needs a task with per-token"):
        r.score((x[:1], y[:1]), per_token=True)
    with pytest.raises(ValueError, match=r"has no registered training loss"):
        make(model, _NoLossTask(), (x, y), progress=False)


class _NoLossTask(AbstractModelOutput):
    """A task with an output but no registered training loss."""

    @staticmethod
    def get_output(model, weights, buffers, *example):
        return torch.zeros(())

    def get_out_to_loss_grad(self, model, weights, buffers, batch):
        return torch.zeros(1, 1)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_linearized_leave_one_out_matches_retraining_to_first_order(optimizer):
    """Down-weighting example i by δ moves f by -δ s_i + O(δ²).

    The error of the linear prediction must shrink about fourfold when δ halves
    (second order), and for full removal (δ = 1) the predicted changes rank the
    actual ones (Spearman over every training example).
    """
    from scipy.stats import spearmanr

    kw = {"lr": 0.2, "momentum": 0.9} if optimizer == "sgd" else {"lr": 0.02}
    r = _replay(optimizer, kw)
    x, y = replay_data(N)
    q = (x[:1], y[:1])
    s = r.metagradients(q)[:, 0]
    base = r.outputs(q)[0]
    i = int(s.abs().argmax())
    errors = []
    for delta in (0.2, 0.1, 0.05):
        w = torch.ones(N, dtype=torch.float64)
        w[i] -= delta
        actual = r.outputs(q, r.retrain(w))[0] - base
        errors.append(float((actual + delta * s[i]).abs()))
    assert 3.0 < errors[0] / errors[1] < 5.0 and 3.0 < errors[1] / errors[2] < 5.0
    actual_loo, predicted = [], []
    for j in range(N):
        w = torch.ones(N, dtype=torch.float64)
        w[j] = 0.0
        actual_loo.append(float(r.outputs(q, r.retrain(w))[0] - base))
        predicted.append(float(-s[j]))
    assert spearmanr(actual_loo, predicted).statistic > 0.9


def _tiny_gpt2(attention: str) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1,
        n_embd=8,
        n_head=2,
        vocab_size=16,
        n_positions=8,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    config._attn_implementation = attention
    return transformers.GPT2LMHeadModel(config).double().eval()


@pytest.mark.slow
def test_language_model_metagradient_equals_central_difference():
    """GPT-2 (eager attention), Adam, dict batches: same check and tolerance as the MLP's."""
    ids = torch.randint(0, 16, (6, 6), generator=torch.Generator().manual_seed(2))
    r = ReplayAttributor(
        _tiny_gpt2("eager"),
        "language_modeling",
        {"input_ids": ids},
        optimizer="adam",
        lr=0.01,
        num_steps=4,
        batch_size=3,
        progress=False,
    )
    r.train()
    queries = {"input_ids": ids[:2]}
    scores = r.metagradients(queries)
    i = 1
    fd = _central_difference(r, queries, i)
    torch.testing.assert_close(scores[i], fd, rtol=0, atol=1e-8)
    assert fd.abs().max() > 1e-3
    # Per-token queries: the output is a sum over tokens, so the scores sum to the whole's.
    per_token = r.score(queries, per_token=True, exp_name="tokens")
    assert per_token.shape == (6, 2, 6)
    torch.testing.assert_close(per_token.sum(-1), scores, rtol=0, atol=1e-12)
    assert torch.equal(r.finalize_scores("tokens"), per_token)


@pytest.mark.slow
def test_a_model_without_second_derivatives_is_refused_with_the_fix():
    """transformers' sdpa attention on CPU has no double backward: the message says eager."""
    ids = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(2))
    r = ReplayAttributor(
        _tiny_gpt2("sdpa"),
        "language_modeling",
        {"input_ids": ids},
        num_steps=2,
        batch_size=2,
        progress=False,
    )
    r.train()
    with pytest.raises(RuntimeError, match=r"no second derivative.*eager attention"):
        r.metagradients({"input_ids": ids[:1]})


def test_reverse_over_reverse_fallback_equals_forward_over_reverse():
    """Models vmap cannot trace take the autograd path: the same metagradients.

    Both compute H d̄ and ∇ℓ_i·d̄ exactly; only the order of the sums differs,
    so the bound of the block test applies (``T D ε max|s|``, D = 5).
    """
    r = _replay("adamw", {"lr": 0.05, "weight_decay": 0.1})
    r._jvp_min_block = 1
    x, y = replay_data(N)
    fast = r.metagradients((x[:3], y[:3]))
    assert r._vmap_ok is True
    r._vmap_ok = False
    slow = r.metagradients((x[:3], y[:3]))
    bound = STEPS * 5 * torch.finfo(torch.float64).eps * float(fast.abs().max())
    assert float((fast - slow).abs().max()) <= bound


@pytest.mark.parametrize(
    ("optimizer", "lr", "noted"),
    [
        ("adamw", 1e-2, True),
        ("adam", [1e-2] * STEPS, True),
        ("adamw", [0.0] + [1e-2] * (STEPS - 1), False),  # warmed up from 0
        ("sgd", 0.1, False),
    ],
)
def test_an_unwarmed_adam_run_is_noted_once(monkeypatch, caplog, optimizer, lr, noted):
    """An Adam run whose first step has a nonzero rate logs one warning per process that
    names the cause (the sign step) and the fix (a warmup from 0); other runs log none."""
    import gradsketch.attribution._replay as replay_module

    monkeypatch.setattr(replay_module, "_ADAM_NOTED", False)
    x, y = replay_data(N)
    with caplog.at_level("WARNING", logger="gradsketch.attribution._replay"):
        for _ in range(2):
            ReplayAttributor(
                replay_mlp(), "image_classification", (x, y), optimizer=optimizer, lr=lr,
                num_steps=STEPS, batch_size=BATCH, progress=False,
            )  # fmt: skip
    notes = [r.getMessage() for r in caplog.records if "sign of the gradient" in r.getMessage()]
    assert len(notes) == (1 if noted else 0)
    if noted:
        assert f"replaying {optimizer} whose first step has lr=0.01" in notes[0]
        assert "warmup from 0" in notes[0]
        assert "linearize_at=0.0001 makes Adam's ε act as 0.0001" in notes[0]


def test_an_unwarmed_adam_run_linearized_low_is_not_noted(monkeypatch, caplog):
    """``linearize_at=α`` with ``eps / α`` ≥ 1e-4 smooths the sign step under
    ``subset_loss="full_batch"`` (the loss, and so the gradients, scaled by α): no warning."""
    import gradsketch.attribution._replay as replay_module

    monkeypatch.setattr(replay_module, "_ADAM_NOTED", False)
    x, y = replay_data(N)
    with caplog.at_level("WARNING", logger="gradsketch.attribution._replay"):
        for at, eps in ((1e-4, 1e-8), (1e-2, 1e-6)):
            ReplayAttributor(
                replay_mlp(), "image_classification", (x, y), optimizer="adam", lr=0.01,
                num_steps=STEPS, batch_size=BATCH, linearize_at=at, eps=eps, progress=False,
                subset_loss="full_batch",
            )  # fmt: skip
    assert not [r for r in caplog.records if "sign of the gradient" in r.getMessage()]


@pytest.mark.parametrize(
    ("kw", "advice", "not_advised"),
    [
        # kept_mean keeps the run at any linearize_at: only full_batch can smooth it.
        (
            {"optimizer": "adam", "linearize_at": 1e-4},
            "linearize it low with subset_loss='full_batch'",
            None,
        ),
        # L2 decay is not scaled with the loss: a low linearize_at trains another model.
        (
            {
                "optimizer": "adam",
                "weight_decay": 1e-4,
                "linearize_at": 1e-4,
                "subset_loss": "full_batch",
            },
            "Linearizing low does not help this run: its L2 weight_decay",
            "makes Adam's ε act as",
        ),
        (
            {"optimizer": "adam", "weight_decay": 1e-4},
            "Linearizing low does not help this run",
            "makes Adam's ε act as",
        ),
        # Decoupled decay does not see the loss's scale: low is advised under full_batch.
        (
            {"optimizer": "adamw", "weight_decay": 0.1, "subset_loss": "full_batch"},
            "linearize_at=0.0001 makes Adam's ε act as 0.0001",
            "subset_loss='full_batch'",
        ),
    ],
    ids=["kept-mean-low", "adam-l2-full-batch-low", "adam-l2", "adamw-full-batch"],
)
def test_the_unwarmed_adam_advice_fits_the_run(monkeypatch, caplog, kw, advice, not_advised):
    """The note's second advice is right for the run it is given: linearizing low only
    where that smooths the sign step and keeps the model (full_batch, no L2 decay)."""
    import gradsketch.attribution._replay as replay_module

    monkeypatch.setattr(replay_module, "_ADAM_NOTED", False)
    x, y = replay_data(N)
    with caplog.at_level("WARNING", logger="gradsketch.attribution._replay"):
        ReplayAttributor(
            replay_mlp(), "image_classification", (x, y), lr=0.01, num_steps=STEPS,
            batch_size=BATCH, progress=False, **kw,
        )  # fmt: skip
    notes = [r.getMessage() for r in caplog.records if "sign of the gradient" in r.getMessage()]
    assert len(notes) == 1
    assert "warmup from 0" in notes[0]
    assert advice in notes[0]
    if not_advised is not None:
        assert not_advised not in notes[0]


@pytest.mark.parametrize(
    ("kw", "warned"),
    [
        ({"optimizer": "adam", "weight_decay": 1e-4, "batch_size": N}, True),
        ({"optimizer": "adam", "weight_decay": 1e-4, "batch_size": BATCH}, False),  # minibatch
        ({"optimizer": "adam", "batch_size": N}, False),  # no L2
        ({"optimizer": "adamw", "weight_decay": 1e-4, "batch_size": N}, False),  # decoupled
        (
            {"optimizer": "adam", "weight_decay": 1e-4, "batch_size": N,
             "lr": [0.0] + [1e-2] * (STEPS - 1)},
            False,
        ),  # warmed up from 0
    ],
    ids=["adam-l2-full-batch", "minibatch", "no-l2", "adamw", "warmed-up"],
)  # fmt: skip
def test_the_runs_the_suite_cannot_predict_are_warned_with_the_measured_lds(caplog, kw, warned):
    """Full-batch unwarmed Adam with L2 (where the protocol suite measured the replay
    below K-FAC at every setting) warns with the measured LDS and no setting to try;
    the runs the suite did not show failing do not."""
    x, y = replay_data(N)
    kw = {"lr": 0.01, **kw}
    with caplog.at_level("WARNING", logger="gradsketch.attribution._replay"):
        ReplayAttributor(
            replay_mlp(), "image_classification", (x, y), num_steps=STEPS, progress=False, **kw
        )
    notes = [r.getMessage() for r in caplog.records if "protocol suite" in r.getMessage()]
    assert len(notes) == (1 if warned else 0)
    if warned:
        assert "0.29-0.31 against fresh-seed retrains" in notes[0]
        assert "TRAKer(method='kfac')" in notes[0]
