"""ReplayCallback on a sequence classifier: a Trainer's BERT run replays to the same weights,
and its metagradients are derivatives of the query margin through that run."""

from __future__ import annotations

import pytest
import torch

from gradsketch.attribution import ReplayAttributor, ReplayCallback
from helpers.attribution import replay_trainer

transformers = pytest.importorskip("transformers")

N, LENGTH, VOCAB, CLASSES = 12, 6, 16, 3


def _bert() -> torch.nn.Module:
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=LENGTH,
        type_vocab_size=2,
        num_labels=CLASSES,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout=0.0,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config).double()


def _gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(
        n_layer=1,
        n_head=2,
        n_embd=8,
        vocab_size=VOCAB,
        n_positions=LENGTH,
        num_labels=CLASSES,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        summary_first_dropout=0.0,
        pad_token_id=0,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.GPT2ForSequenceClassification(config).double()


MODELS = {"bert": _bert, "gpt2": _gpt2}


def _rows() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(1, VOCAB, (N, LENGTH), generator=gen)
    labels = torch.randint(0, CLASSES, (N,), generator=gen)
    return [
        {
            "input_ids": r,
            "token_type_ids": torch.zeros_like(r),
            "attention_mask": torch.ones_like(r),
            "labels": y,
        }
        for r, y in zip(ids, labels)
    ]


def _train(tmp_path, arch: str = "bert", **overrides) -> tuple[object, ReplayCallback]:
    """Five float64 Trainer steps (``helpers.attribution.replay_trainer``: accumulation,
    more steps than one epoch holds, warmup then linear decay, weight decay with the
    Trainer's no-decay group) at a larger rate, so that the weights move."""
    return replay_trainer(tmp_path, MODELS[arch](), _rows(), **{"learning_rate": 5e-2, **overrides})


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        # BERT's classifier returns each micro-batch's mean (CrossEntropyLoss), which the
        # Trainer does not divide by the accumulation steps: the step's loss is twice the mean.
        pytest.param("bert", {}, id="bert-adamw"),
        pytest.param("bert", {"optim": "sgd", "optim_args": "momentum=0.9"}, id="bert-sgd"),
        # GPT-2's divides the step's summed losses by the Trainer's count: the mean itself.
        pytest.param("gpt2", {}, id="gpt2-adamw"),
    ],
)
def test_sequence_classifier_trainer_run_replays_and_metagradient_is_a_derivative(
    tmp_path, arch, overrides
):
    """Final weights to float64 rounding; one metagradient entry equal to a central difference.

    Tolerances: the Trainer and the replay take the same steps with the same
    rows, rates and hyper-parameters in float64 (a sequence classifier's loss
    is the float64 cross-entropy of its logits, which the replay writes as
    ``softplus(-margin)``); they differ in the order of float operations,
    ``δg ≲ 10 ε₆₄ max|g| ≈ 1e-15`` per gradient entry, which Adam turns into
    at most ``Σ_t lr_t δg / ε ≈ 0.2 · 1e-15 / 1e-3 = 2e-13`` of weight (SGD:
    ``Σ_t lr_t δg / (1 - momentum)``, smaller), plus ε₆₄ rounding of weights
    ≤ 1 per step: atol 1e-10 leaves a margin of 500, while the updates are
    ~1e-2 (checked), so a wrong row, rate, accumulation scale or decay fails
    by eight orders of magnitude. The central difference, taken in the
    float64 replay with ``h = 1e-5``, errs by ``h² |f'''| / 6 + T ε |f| / h ≈
    1e-10 + 1e-10``: atol 1e-8 against entries of ~1e-2 (checked).
    """
    trainer, callback = _train(tmp_path, arch, **overrides)
    s = callback.settings
    assert s is not None and s.num_steps == 5 and s.batch_size == 4
    assert s.optimizer == ("sgd" if overrides else "adamw")
    assert (
        "bert.embeddings.LayerNorm.weight" if arch == "bert" else "transformer.ln_f.weight"
    ) in (s.no_decay)
    replay = ReplayAttributor.from_trainer(trainer, callback, "text_classification", progress=False)
    replay.train()
    moved = 0.0
    for name, p in trainer.model.named_parameters():
        torch.testing.assert_close(replay.final[name], p.detach(), rtol=0, atol=1e-10)
        moved = max(moved, float((p.detach() - callback.initial_state[name]).abs().max()))
    assert moved > 1e-2
    rows = _rows()[:2]
    queries = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    scores = replay.metagradients(queries)
    assert scores.shape == (N, 2)
    i = callback.order[0][0]  # a row of the first step, so its weight acts through every step
    h = 1e-5
    plus, minus = torch.ones(N, dtype=torch.float64), torch.ones(N, dtype=torch.float64)
    plus[i] += h
    minus[i] -= h
    fd = (
        replay.outputs(queries, replay.retrain(plus))
        - replay.outputs(queries, replay.retrain(minus))
    ) / (2 * h)
    torch.testing.assert_close(scores[i], fd, rtol=0, atol=1e-8)
    assert fd.abs().max() > 1e-3


def test_losses_the_replay_cannot_read_are_refused(tmp_path):
    trainer, callback = _train(tmp_path, max_steps=1)
    trainer.compute_loss_func = lambda outputs, labels, num_items_in_batch=None: outputs.loss
    with pytest.raises(ValueError, match=r"own `compute_loss_func`.*pass `loss_fn"):
        ReplayAttributor.from_trainer(trainer, callback, "text_classification")
    trainer, callback = _train(tmp_path, max_steps=1, label_smoothing_factor=0.1)
    with pytest.raises(ValueError, match=r"`label_smoothing_factor`=0.1 .*pass `loss_fn`"):
        ReplayAttributor.from_trainer(trainer, callback, "text_classification")
