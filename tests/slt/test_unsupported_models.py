"""slt refuses models it cannot sample, by class and config, before any work.

``slt`` samples causal language models (its default loss reads next-token
logits). An encoder (BERT, RoBERTa, ViT) or an encoder-decoder (T5, BART)
used to fail deep in a forward pass ("not enough values to unpack", or
transformers' "You must specify exactly one of input_ids or inputs_embeds");
each is now refused with a message naming the model type, what slt samples,
and what to use instead. Tiny configs built in code, no downloads.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("xarray")

from gradsketch import slt
from gradsketch.errors import UnsupportedModelError
from helpers.hf_families import BY_NAME

IDS = torch.randint(0, 32, (8, 6))
#: The smallest run `sample` takes: one chain of one draw on one batch.
ONE_DRAW = dict(
    lr=1e-6,
    n_beta=1.0,
    num_chains=1,
    num_draws=1,
    batch_size=4,
    num_init_loss_batches=1,
    batches_per_draw=1,
)

# family -> (what the message must say it is, the alternative it must name)
CASES = {
    "bert": ("BertForSequenceClassification \\(config.model_type='bert'\\)", "text_classification"),
    "roberta": ("model_type='roberta'", "text_classification"),
    "vit": ("ViTForImageClassification \\(config.model_type='vit'\\)", "image_classification"),
    "t5": ("T5ForConditionalGeneration \\(config.model_type='t5'\\)", "seq2seq_lm"),
    "bart": ("model_type='bart'.*encoder-decoder", "seq2seq_lm"),
}


def _model(name: str) -> torch.nn.Module:
    return BY_NAME[name].build(dtype=torch.float32)


def _forward_spy(model: torch.nn.Module) -> list[int]:
    calls: list[int] = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("entry", ["sample", "llc", "bif", "susceptibilities"])
def test_non_causal_models_are_refused_before_any_forward(name: str, entry: str, tmp_path) -> None:
    model = _model(name)
    calls = _forward_spy(model)
    what, instead = CASES[name]
    kwargs = dict(lr=1e-4, n_beta=10.0, num_chains=1, num_draws=1, batch_size=4)
    args: tuple = (model, IDS, {"probe": IDS})
    if entry == "sample":
        kwargs["output_path"] = tmp_path / "store.zarr"
    if entry == "susceptibilities":
        args += ({"full": None},)
        kwargs.update(sampling_task="probe", include_sampling_task=True)
    with pytest.raises(UnsupportedModelError, match=f"samples causal language models.*{what}"):
        getattr(slt, entry)(*args, **kwargs)
    with pytest.raises(ValueError, match=f"AutoModelForCausalLM.*{instead}"):
        getattr(slt, entry)(*args, **kwargs)
    assert calls == [], "the model ran before it was refused"
    assert not (tmp_path / "store.zarr").exists()


def test_the_refusal_names_the_escape_hatch() -> None:
    with pytest.raises(UnsupportedModelError, match=r"pass `loss_fn=.*bayesian_influence"):
        slt.sample(_model("t5"), IDS, {"probe": IDS}, lr=1e-4, n_beta=10.0, batch_size=4)


def test_a_causal_lm_is_not_refused() -> None:
    model = _model("gpt2")
    ids = torch.randint(0, model.config.vocab_size, (4, 6))
    tree = slt.sample(
        model,
        ids,
        {"probe": ids},
        **ONE_DRAW,
        progress=False,
    )
    assert tree is not None


def test_a_user_loss_fn_lifts_the_refusal() -> None:
    """With its own per-token loss, any model is the user's to sample."""
    model = _model("bert")

    def loss_fn(m: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        logits = m(input_ids=input_ids).logits  # [batch, classes]
        return logits.logsumexp(-1, keepdim=True).expand(-1, input_ids.shape[1] - 1)

    tree = slt.sample(
        model,
        IDS,
        {"probe": IDS},
        **ONE_DRAW,
        loss_fn=loss_fn,
        progress=False,
    )
    assert tree is not None
