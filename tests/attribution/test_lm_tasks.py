"""text_classification without token types, LoRA adapters, and choosing the weights."""

from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from gradsketch._settings import SettingsMismatchError
from gradsketch.attribution import (
    BatchFormatError,
    HookGradientComputer,
    LanguageModelingModelOutput,
    SequenceClassificationModelOutput,
    TRAKer,
    select_parameters,
)
from gradsketch.attribution._lm_data import collate_rows
from gradsketch.masked import ParamMask
from gradsketch.sketch import FactorizedProjector

transformers = pytest.importorskip("transformers")

F64 = torch.float64
VOCAB, SEQ = 40, 6
CLS = SequenceClassificationModelOutput()
LM = LanguageModelingModelOutput()


def llama_config(**kw):
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        **kw,
    )


def classification_batch(n=5, seed=0):
    """Right-padded ids (pad id 0 never occurs inside a sequence) and 3-class labels."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, SEQ), generator=gen)
    mask = torch.ones_like(ids)
    for i in range(n):
        mask[i, SEQ - i % 3 :] = 0
    return ids.masked_fill(mask == 0, 0), mask, torch.arange(n) % 3


def reference_margin(logits, label):
    logp = torch.log_softmax(logits, -1)[0, label]
    return logp - torch.log1p(-logp.exp())


# -- text classification ---------------------------------------------------------
def test_text_classification_on_llama_without_token_types_equals_float64_loop():
    torch.manual_seed(0)
    model = transformers.LlamaForSequenceClassification(llama_config(num_labels=3, pad_token_id=0))
    model = model.double().eval()
    ids, mask, labels = classification_batch()
    gc = HookGradientComputer(model, CLS)
    # The dict and the token-type-free tuple are the same batch.
    batch = CLS.as_batch({"input_ids": ids, "attention_mask": mask, "label": labels})
    assert len(batch) == 3
    got = gc.compute_per_sample_grad(batch)
    again = gc.compute_per_sample_grad((ids, mask, labels))
    params = dict(model.named_parameters())
    for b in range(ids.shape[0]):
        length = int(mask[b].sum())
        logits = model(input_ids=ids[b : b + 1, :length]).logits
        grads = torch.autograd.grad(
            reference_margin(logits, labels[b]), list(params.values()), allow_unused=True
        )
        for (name, p), g in zip(params.items(), grads, strict=True):
            ref = torch.zeros_like(p) if g is None else g
            torch.testing.assert_close(got[name][b], ref, rtol=1e-9, atol=1e-12, msg=name)
            torch.testing.assert_close(again[name][b], got[name][b], rtol=0, atol=0)
    q = gc.compute_loss_grad(batch)
    with torch.no_grad():
        p = torch.softmax(model(input_ids=ids, attention_mask=mask).logits, -1)
    torch.testing.assert_close(q.reshape(-1), 1 - p[torch.arange(5), labels], rtol=1e-12, atol=0)


class TypedClassifier(nn.Module):
    """A forward that takes token types (as BERT's does)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, 8)
        self.typ = nn.Embedding(2, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, input_ids, token_type_ids=None, attention_mask=None):
        h = self.tok(input_ids) + self.typ(token_type_ids)
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1))


class UntypedClassifier(TypedClassifier):
    def forward(self, input_ids, attention_mask=None):
        return super().forward(input_ids, torch.zeros_like(input_ids), attention_mask)


class KwargsClassifier(TypedClassifier):
    """A forward reading ``**kwargs`` (not a Hugging Face model): it gets every input."""

    def forward(self, **kwargs):
        return super().forward(
            kwargs["input_ids"], kwargs["token_type_ids"], kwargs["attention_mask"]
        )


def test_token_types_reach_models_that_take_them_only():
    ids, mask, labels = classification_batch()
    types = (torch.arange(SEQ) >= 3).long().expand_as(ids)
    torch.manual_seed(0)
    typed = TypedClassifier().double().eval()
    untyped = UntypedClassifier().double().eval()
    untyped.load_state_dict(typed.state_dict())
    trak_tuple = (ids, types, mask, labels)
    out_typed = CLS.get_batch_output(typed, *trak_tuple)
    out_untyped = CLS.get_batch_output(untyped, *trak_tuple)
    # Types shift the typed model's output; the untyped model ignores them.
    assert not torch.allclose(out_typed, CLS.get_batch_output(typed, ids, 0 * types, mask, labels))
    torch.testing.assert_close(out_untyped, CLS.get_batch_output(untyped, ids, mask, labels))
    kw_model = KwargsClassifier().double().eval()
    kw_model.load_state_dict(typed.state_dict())
    torch.testing.assert_close(CLS.get_batch_output(kw_model, *trak_tuple), out_typed)
    weights = {n: p.detach() for n, p in typed.named_parameters()}
    single = CLS.get_output(typed, weights, {}, ids[0], types[0], mask[0], labels[0])
    torch.testing.assert_close(single, out_typed[0])
    d = {"input_ids": ids, "token_type_ids": types, "attention_mask": mask, "labels": labels}
    for a, b in zip(CLS.as_batch(d), trak_tuple, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        pytest.param({"input_ids": torch.ones(2, 3)}, "no 'labels'", id="no-labels"),
        pytest.param({"labels": torch.ones(2)}, "without 'input_ids'", id="no-ids"),
        pytest.param((torch.ones(2, 3), torch.ones(2)), "has 2 entries", id="tuple-length"),
    ],
)
def test_text_classification_batch_errors(batch, match):
    with pytest.raises(BatchFormatError, match=match):
        CLS.as_batch(batch)


def test_text_classification_task_name_and_dict_loader_in_traker(tmp_path):
    torch.manual_seed(0)
    model = transformers.LlamaForSequenceClassification(llama_config(num_labels=3, pad_token_id=0))
    model.eval()
    ids, mask, labels = classification_batch(n=6)
    rows = [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(6)]
    loader = torch.utils.data.DataLoader(rows, batch_size=4, collate_fn=collate_rows)
    traker = TRAKer(
        model,
        "text_classification",
        6,
        save_dir=tmp_path,
        device="cpu",
        gradient_computer=HookGradientComputer,
        proj_dim=32,
        progress=False,
        logging_level=logging.WARNING,
    )
    assert type(traker.task) is SequenceClassificationModelOutput
    traker.load_checkpoint(model.state_dict(), model_id=0)
    traker.featurize_loader(loader)
    traker.finalize_features()
    traker.start_scoring_checkpoint("q", model.state_dict(), 0, num_targets=2)
    traker.score({"input_ids": ids[:2], "attention_mask": mask[:2], "labels": labels[:2]}, None, 2)
    scores = traker.finalize_scores("q")
    assert scores.shape == (6, 2) and np.isfinite(scores).all()


# -- LoRA ---------------------------------------------------------------------------
def lora_llama():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(llama_config())
    config = peft.LoraConfig(
        r=2, lora_alpha=4, lora_dropout=0.1, target_modules=["q_proj", "v_proj"]
    )
    with warnings.catch_warnings():
        # peft asks transformers a deprecated question; nothing of ours.
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
        model = peft.get_peft_model(base, config)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero, which makes A's gradient zero
            nn.init.normal_(p, std=0.5)
    return model.double().eval()


def test_lora_adapters_only_with_exact_per_example_gradients(tmp_path):
    model = lora_llama()
    adapters = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(adapters) == 8 and all("lora_" in n for n in adapters)
    traker = TRAKer(
        model,
        "language_modeling",
        4,
        save_dir=tmp_path,
        device="cpu",
        gradient_computer=HookGradientComputer,
        projector=FactorizedProjector.from_budget(model, 64, seed=0, grad_wrt=adapters),
        progress=False,
        logging_level=logging.WARNING,
    )
    # Frozen base weights are skipped: the store records the adapters only.
    assert traker.grad_wrt == adapters and traker.settings.grad_wrt == adapters

    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (4, SEQ), generator=gen)
    mask = torch.ones_like(ids)
    mask[2:, 4:] = 0
    batch = LM.as_batch((ids, mask))
    gc = traker.gradient_computer
    got = gc.compute_per_sample_grad(batch)
    assert list(got) == adapters
    params = dict(model.named_parameters())
    for b in range(4):
        length = int(mask[b].sum())
        logits = model(input_ids=ids[b : b + 1, :length]).logits
        logp = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[b, 1:length, None])
        f = (logp - torch.log1p(-logp.exp())).sum()
        grads = torch.autograd.grad(f, [params[n] for n in adapters])
        for name, g in zip(adapters, grads, strict=True):
            torch.testing.assert_close(got[name][b], g, rtol=1e-9, atol=1e-12, msg=name)
    # The factorized projection of the adapters equals projecting their gradients.
    expected = traker.projector.project(got, 0)
    torch.testing.assert_close(gc.project(batch, traker.projector, 0), expected, rtol=1e-9, atol=0)


def test_lora_on_embeddings_gets_exact_per_example_gradients():
    """peft keeps embedding adapters in ParameterDicts its forward reads directly.

    The containers are never called, so their hooks would never fire; the
    LoRA embedding module owns them instead (``torch.func`` on its inputs).
    Checked against a float64 loop of single-example backward passes.
    """
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(llama_config())
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["embed_tokens", "q_proj"])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
        model = peft.get_peft_model(base, config)
    for name, p in model.named_parameters():
        if "lora_" in name:  # peft starts one factor of each pair at zero
            nn.init.normal_(p, std=0.5)
    model = model.double().eval()
    adapters = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("lora_embedding_A" in n for n in adapters)
    gc = HookGradientComputer(model, LM, grad_wrt=adapters)
    ids = torch.randint(1, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(5))
    got = gc.compute_per_sample_grad(LM.as_batch((ids, torch.ones_like(ids))))
    params = dict(model.named_parameters())
    for b in range(3):
        logits = model(input_ids=ids[b : b + 1]).logits
        logp = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[b, 1:, None])
        f = (logp - torch.log1p(-logp.exp())).sum()
        grads = torch.autograd.grad(f, [params[n] for n in adapters])
        for name, g in zip(adapters, grads, strict=True):
            assert g.abs().sum() > 0, name  # the check can fail: every adapter is used
            torch.testing.assert_close(got[name][b], g, rtol=1e-9, atol=1e-12, msg=name)
    gc.remove_hooks()


# -- choosing the weights ---------------------------------------------------------------
@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(llama_config()).eval()


def test_select_parameters_by_patterns_names_and_masks(llama):
    qv = select_parameters(llama, "*.q_proj.weight|*.v_proj.weight")
    assert qv == [
        n for n, _ in llama.named_parameters() if n.endswith(("q_proj.weight", "v_proj.weight"))
    ]
    assert len(qv) == 4
    listed = select_parameters(llama, ["model.layers.1.mlp.up_proj.weight", "*.q_proj.weight"])
    assert listed[-1] == "model.layers.1.mlp.up_proj.weight" and len(listed) == 3
    whole = ParamMask.from_patterns(llama, include=["*.q_proj.weight", "*.v_proj.weight"])
    assert select_parameters(llama, whole) == qv
    assert select_parameters(llama, None) is None
    # An entry-level mask differentiates only the parameters it touches.
    partial = ParamMask({"model.layers.0.mlp.up_proj.weight": torch.eye(32, 16, dtype=torch.bool)})
    assert select_parameters(llama, None, partial) == ["model.layers.0.mlp.up_proj.weight"]


@pytest.mark.parametrize(
    ("grad_wrt", "match"),
    [
        pytest.param(
            "*.k_proj.bias", r"names \['\*\.k_proj\.bias'\] match no parameter", id="pattern"
        ),
        pytest.param(["model.norm.weight", "nope"], r"names \['nope'\]", id="name"),
        pytest.param("|", "selects no parameter", id="empty"),
        pytest.param(
            ParamMask({"model.norm.weight": torch.arange(16) < 3}),
            "only some entries.*Pass it as `mask=`",
            id="partial-mask",
        ),
        pytest.param(
            ParamMask({"nope": torch.ones(2, dtype=torch.bool)}),
            r"naming \['nope'\]",
            id="foreign-mask",
        ),
    ],
)
def test_select_parameters_errors(llama, grad_wrt, match):
    with pytest.raises(ValueError, match=match):
        select_parameters(llama, grad_wrt)


def test_select_parameters_refuses_non_strings(llama):
    with pytest.raises(TypeError, match="parameter names or patterns"):
        select_parameters(llama, [3])


def test_entry_mask_recorded_and_resume_with_another_refused(tmp_path, llama):
    name = "model.layers.0.mlp.up_proj.weight"
    kwargs = dict(
        save_dir=tmp_path,
        device="cpu",
        gradient_computer=HookGradientComputer,
        proj_dim=16,
        progress=False,
        logging_level=logging.WARNING,
    )
    first = ParamMask({name: torch.eye(32, 16, dtype=torch.bool)})
    traker = TRAKer(llama, "language_modeling", 4, mask=first, **kwargs)
    assert traker.grad_wrt == [name] and traker.grad_dim == 16
    assert traker.settings.projector["mask"] == first.fingerprint
    TRAKer(llama, "language_modeling", 4, mask=first, **kwargs)  # the same: resumes
    other = ParamMask({name: torch.eye(32, 16, dtype=torch.bool).roll(1, 0)})
    with pytest.raises(SettingsMismatchError, match="mask"):
        TRAKer(llama, "language_modeling", 4, mask=other, **kwargs)


# -- models the language-modeling task cannot serve ------------------------------------
@pytest.mark.parametrize(
    "family, what, instead",
    [
        (
            "t5",
            r"T5ForConditionalGeneration \(config.model_type='t5'\).*encoder-decoder",
            "seq2seq_lm",
        ),
        ("bart", r"model_type='bart'.*encoder-decoder", "seq2seq_lm"),
        (
            "bert",
            r"BertForSequenceClassification \(config.model_type='bert'\)",
            "text_classification",
        ),
        ("roberta", r"model_type='roberta'", "text_classification"),
    ],
)
@pytest.mark.parametrize("computer", ["functional", "hooks"])
def test_language_modeling_refuses_non_causal_models_before_a_forward(
    tmp_path, family, what, instead, computer
):
    from gradsketch.errors import UnsupportedModelError
    from helpers.hf_families import BY_NAME

    model = BY_NAME[family].build(dtype=torch.float32)
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    kwargs = {} if computer == "functional" else {"gradient_computer": HookGradientComputer}
    traker = TRAKer(
        model,
        "language_modeling",
        4,
        save_dir=tmp_path,
        device="cpu",
        proj_dim=16,
        progress=False,
        logging_level=logging.WARNING,
        **kwargs,
    )
    traker.load_checkpoint(model.state_dict(), model_id=0)
    ids = torch.randint(3, 30, (4, SEQ))
    with pytest.raises(UnsupportedModelError, match=f'language_modeling.*{what}.*task="{instead}"'):
        traker.featurize({"input_ids": ids}, num_samples=4)
    assert calls == []


def test_language_modeling_check_leaves_causal_lms_and_plain_modules_alone():
    from gradsketch.attribution._task import task_protocol

    check = task_protocol(LM).check_batch
    assert check is not None
    batch = LM.as_batch({"input_ids": torch.randint(0, VOCAB, (2, SEQ))})
    check(transformers.LlamaForCausalLM(llama_config()), batch)
    check(nn.Sequential(nn.Embedding(VOCAB, VOCAB)), batch)
