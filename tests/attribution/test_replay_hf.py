"""ReplayCallback: a Hugging Face Trainer's run, recorded, replays to the same weights."""

from __future__ import annotations

import pytest
import torch

from gradsketch.attribution import ReplayAttributor, ReplayCallback
from helpers.attribution import replay_trainer

transformers = pytest.importorskip("transformers")

N, LENGTH, VOCAB = 12, 6, 16


def _gpt2(dtype: torch.dtype, dropout: float = 0.0) -> torch.nn.Module:
    config = transformers.GPT2Config(
        n_layer=1,
        n_head=2,
        n_embd=8,
        vocab_size=VOCAB,
        n_positions=LENGTH,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=0,
        eos_token_id=0,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).to(dtype)


def _rows() -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (N, LENGTH), generator=torch.Generator().manual_seed(2))
    return [{"input_ids": r, "attention_mask": torch.ones_like(r), "labels": r} for r in ids]


def _train(tmp_path, model: torch.nn.Module, **overrides) -> tuple[object, ReplayCallback]:
    """Five Trainer steps (``helpers.attribution.replay_trainer``) on the causal-LM rows."""
    return replay_trainer(tmp_path, model, _rows(), **overrides)


def test_trainer_run_replays_to_the_trainers_final_weights(tmp_path):
    """The replayed float32 run ends where the Trainer's did, to float32 rounding.

    Tolerance: the two runs take the same steps with the same rows, rates and
    hyper-parameters, and differ only in the order of float operations (the
    Trainer's fused AdamW and token-sum loss against the replay's
    single-tensor AdamW and example means): gradient entries differ by
    ``δg ≲ 4 ε₃₂ max|g| ≈ 1e-7`` (ε₃₂ = 1.2e-7, gradients ≤ 0.21). Adam's
    update ``m̂ / (√v̂ + ε)`` moves by at most ``δg / ε`` per unit rate, so
    the weights by ``Σ_t lr_t δg / ε ≈ 0.033 · 1e-7 / 1e-3 ≈ 3e-9``; each
    step also rounds weights of size ≤ 1 (the layer norms) by ε₃₂, 6e-7 over
    five steps. atol 1e-6 covers both; the updates are ~1e-2 (checked), so a
    wrong rate, row or decay fails by four orders of magnitude. The run uses
    ε = 1e-3: at Adam's default 1e-8 an entry whose gradient is ~1e-8 turns
    float32 rounding into update differences of order lr (Adam's own
    conditioning, which no replay in another operation order can avoid).
    """
    trainer, callback = _train(tmp_path, _gpt2(torch.float32))
    assert callback.settings is not None
    s = callback.settings
    assert (s.optimizer, s.num_steps, s.weight_decay) == ("adamw", 5, 0.1)
    assert "transformer.ln_f.weight" in s.no_decay and "transformer.h.0.attn.c_attn.bias" in (
        s.no_decay
    )
    assert s.lr[0] == 0.0 and s.lr[2] == pytest.approx(1e-2)  # linear warmup over 2 steps
    assert [len(b) for b in callback.order] == [4] * 5
    assert len(set(callback.order[0] + callback.order[1] + callback.order[2])) == N
    replay = ReplayAttributor.from_trainer(trainer, callback, progress=False)
    replay.train()
    moved = 0.0
    for name, p in trainer.model.named_parameters():
        torch.testing.assert_close(replay.final[name], p.detach(), rtol=0, atol=1e-6)
        moved = max(moved, float((p.detach() - callback.initial_state[name]).abs().max()))
    assert moved > 1e-2
    # The Trainer's model keeps its trained weights; the replay's copy started at the initial ones.
    assert replay.model is not trainer.model
    for name, p in replay.model.named_parameters():
        assert torch.equal(p, callback.initial_state[name])


@pytest.mark.slow
def test_trainer_run_metagradient_equals_central_difference_float64(tmp_path):
    """A float64 Trainer run: replayed weights to float64 rounding, and ∂f/∂w_i equal to a
    central difference through the replayed run.

    Tolerances: the weights as in the float32 test (transformers computes the
    causal-LM loss in float32 even for a float64 model, so the Trainer's run
    is float32-rounded); the difference, taken inside the float64 replay, errs by ``h² |f'''| / 6 +
    T ε |f| / h`` ≈ 1e-10 + 1e-10 at ``h = 1e-5`` (the MLP tests' derivation),
    so 1e-8 against metagradients of ~1e-2.
    """
    trainer, callback = _train(tmp_path, _gpt2(torch.float64))
    replay = ReplayAttributor.from_trainer(trainer, callback, progress=False)
    replay.train()
    for name, p in trainer.model.named_parameters():
        torch.testing.assert_close(replay.final[name], p.detach(), rtol=0, atol=1e-6)
    rows = _rows()[:2]
    queries = {k: torch.stack([r[k] for r in rows]) for k in ("input_ids", "attention_mask")}
    scores = replay.metagradients(queries)
    h, i = 1e-5, 3
    plus, minus = torch.ones(N, dtype=torch.float64), torch.ones(N, dtype=torch.float64)
    plus[i] += h
    minus[i] -= h
    fd = (
        replay.outputs(queries, replay.retrain(plus))
        - replay.outputs(queries, replay.retrain(minus))
    ) / (2 * h)
    torch.testing.assert_close(scores[i], fd, rtol=0, atol=1e-8)
    assert fd.abs().max() > 1e-3


def test_clipping_that_engages_is_refused_when_replayed(tmp_path):
    trainer, callback = _train(tmp_path, _gpt2(torch.float32), max_grad_norm=1e-3, max_steps=2)
    replay = ReplayAttributor.from_trainer(trainer, callback, progress=False)
    with pytest.raises(ValueError, match=r"step 0 of the run clips its gradient .*max_grad_norm"):
        replay.train()


REFUSED = [
    pytest.param({}, 0.1, "the model has dropout", id="dropout"),
    pytest.param({"optim": "adafactor"}, 0.0, "optimizer is Adafactor", id="adafactor"),
    pytest.param(
        # The optimizer given to the Trainer: not every transformers passes `optim_args` to SGD.
        {"optimizer": lambda m: torch.optim.SGD(m.parameters(), 1e-2, momentum=0.9, nesterov=True)},
        0.0,
        "nesterov",
        id="nesterov",
    ),
]


@pytest.mark.parametrize(("overrides", "dropout", "match"), REFUSED)
def test_what_cannot_be_replayed_is_refused_before_training(tmp_path, overrides, dropout, match):
    model = _gpt2(torch.float32, dropout)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=match):
        _train(tmp_path, model, **overrides)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name])  # refused before any step


def test_attributor_before_training_and_wrong_callback_are_refused(tmp_path):
    with pytest.raises(ValueError, match="recorded no finished run"):
        ReplayCallback().attributor(object())
    with pytest.raises(TypeError, match="`callback` must be the ReplayCallback"):
        ReplayAttributor.from_trainer(object(), object())


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(
            {"optim": "sgd", "optim_args": "momentum=0.9", "lr_scheduler_type": "cosine"},
            id="sgd-momentum-cosine",
        ),
        pytest.param(
            {"optim": "adamw_torch", "lr_scheduler_type": "constant_with_warmup"},
            id="adamw-constant-warmup",
        ),
    ],
)
def test_other_optimizers_and_schedules_replay_to_the_trainers_weights(tmp_path, overrides):
    """SGD with momentum (cosine) and single-tensor AdamW (constant after warmup): the same
    check and tolerance as the fused-AdamW run (SGD's updates are linear in the gradient,
    so its bound is the smaller one, lr · δg per step)."""
    trainer, callback = _train(tmp_path, _gpt2(torch.float32), **overrides)
    s = callback.settings
    assert s.optimizer == ("sgd" if overrides["optim"] == "sgd" else "adamw")
    if overrides["optim"] == "sgd":
        assert s.momentum == 0.9
    # The recorded rates are the schedule's: warmup to the peak, then its own shape.
    assert s.lr[:3] == pytest.approx([0.0, 5e-3, 1e-2])
    if overrides["lr_scheduler_type"] == "constant_with_warmup":
        assert s.lr[2:] == [s.lr[2]] * 3
    replay = ReplayAttributor.from_trainer(trainer, callback, progress=False)
    replay.train()
    for name, p in trainer.model.named_parameters():
        torch.testing.assert_close(replay.final[name], p.detach(), rtol=0, atol=1e-6)
