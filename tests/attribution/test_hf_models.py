"""Both gradient computers on Hugging Face models, against a float64 loop of single examples.

Five families with different layouts (GPT-2: ``Conv1D`` and learned
positions broadcast over the batch, tied input/output embeddings; BERT:
learned positions and token types; Llama and Qwen2: RMSNorm, rotary
attention, grouped keys; GPT-NeoX: parallel attention and MLP), each with a
sequence-classification and a causal-LM head, tiny configs built here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor, nn

transformers = pytest.importorskip("transformers")

from gradsketch.attribution import (  # noqa: E402
    AbstractModelOutput,
    FunctionalGradientComputer,
    HookGradientComputer,
    TRAKer,
    _hook_computer,
)
from gradsketch.attribution._gradient_computers import VmapTraceError  # noqa: E402
from gradsketch.sketch import CountSketchProjector, FactorizedProjector  # noqa: E402
from helpers.launch import one_thread  # noqa: E402

F64 = torch.float64
VOCAB, SEQ, BATCH, CLASSES, PAD = 64, 8, 3, 3, 0
COMMON = {"vocab_size": VOCAB, "pad_token_id": PAD, "bos_token_id": 1, "eos_token_id": 1}


@dataclass(frozen=True)
class Family:
    """A model family: its config and its two heads."""

    name: str
    config: Callable[[], Any]
    classifier: str
    causal_lm: str | None

    def build(self, head: str, **overrides: Any) -> nn.Module:
        cfg = self.config()
        for key, value in {"num_labels": CLASSES, **overrides}.items():
            setattr(cfg, key, value)
        cls = getattr(transformers, self.classifier if head == "cls" else self.causal_lm)
        torch.manual_seed(0)
        return cls(cfg).to(F64).eval()


def _gpt2() -> Any:
    return transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, **COMMON)


def _bert() -> Any:
    return transformers.BertConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
        **COMMON,
    )


def _llama() -> Any:
    return transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        max_position_embeddings=16,
        **COMMON,
    )


def _neox() -> Any:
    return transformers.GPTNeoXConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
        **COMMON,
    )


def _qwen2() -> Any:
    return transformers.Qwen2Config(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        max_position_embeddings=16,
        **COMMON,
    )


FAMILIES = [
    Family("gpt2", _gpt2, "GPT2ForSequenceClassification", "GPT2LMHeadModel"),
    Family("bert", _bert, "BertForSequenceClassification", None),
    Family("llama", _llama, "LlamaForSequenceClassification", "LlamaForCausalLM"),
    Family("gpt_neox", _neox, "GPTNeoXForSequenceClassification", "GPTNeoXForCausalLM"),
    Family("qwen2", _qwen2, "Qwen2ForSequenceClassification", "Qwen2ForCausalLM"),
]
CASES = [
    pytest.param(f, head, id=f"{f.name}-{head}")
    for f in FAMILIES
    for head in ("cls", "lm")
    if head == "cls" or f.causal_lm is not None
]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Models this small run fastest on one thread (and do not fight for shared cores)."""
    with one_thread():
        yield


class LabelLogit(AbstractModelOutput):
    """``f = logit_y`` of a sequence classifier on ``(input_ids, attention_mask, label)``."""

    @staticmethod
    def get_output(model: nn.Module, weights: Any, buffers: Any, *example: Any) -> Tensor:
        input_ids, attention_mask, label = example
        out = torch.func.functional_call(
            model,
            (weights, buffers),
            args=(),
            kwargs={"input_ids": input_ids[None], "attention_mask": attention_mask[None]},
        )
        return out.logits[0].gather(0, label.reshape(1)).sum()

    def get_batch_output(
        self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, labels: Tensor
    ) -> Tensor:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        return logits.gather(1, labels[:, None])[:, 0]

    def get_out_to_loss_grad(
        self, model: nn.Module, weights: Any, buffers: Any, batch: Any
    ) -> Tensor:
        return torch.ones(batch[0].shape[0], 1)


class NextTokenLogLikelihood(AbstractModelOutput):
    """``f = sum_t m_t log p(x_t | x_<t)`` of a causal LM on ``(input_ids, attention_mask)``."""

    @staticmethod
    def get_output(model: nn.Module, weights: Any, buffers: Any, *example: Any) -> Tensor:
        input_ids, attention_mask = example
        out = torch.func.functional_call(
            model,
            (weights, buffers),
            args=(),
            kwargs={"input_ids": input_ids[None], "attention_mask": attention_mask[None]},
        )
        return NextTokenLogLikelihood._sum(out.logits, input_ids[None], attention_mask[None])[0]

    @staticmethod
    def _sum(logits: Tensor, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        logp = logits[:, :-1].log_softmax(-1).gather(-1, input_ids[:, 1:, None])[..., 0]
        return (logp * attention_mask[:, 1:]).sum(-1)

    def get_batch_output(
        self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor
    ) -> Tensor:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        return self._sum(logits, input_ids, attention_mask)

    def get_out_to_loss_grad(
        self, model: nn.Module, weights: Any, buffers: Any, batch: Any
    ) -> Tensor:
        return torch.ones(batch[0].shape[0], 1)


def _batch(head: str, lengths: tuple[int, ...] = (SEQ - 3, SEQ, SEQ - 1)) -> tuple[Tensor, ...]:
    """Right-padded token ids with ``attention_mask`` zeros past each example's length."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (len(lengths), SEQ), generator=g)
    mask = (torch.arange(SEQ) < torch.tensor(lengths)[:, None]).long()
    ids = ids.masked_fill(mask == 0, PAD)
    if head == "cls":
        return ids, mask, torch.arange(len(lengths)) % CLASSES
    return ids, mask


def _task(head: str) -> AbstractModelOutput:
    return LabelLogit() if head == "cls" else NextTokenLogLikelihood()


def _loop_reference(model: nn.Module, task: Any, batch: tuple[Tensor, ...]) -> dict[str, Tensor]:
    """Per-example gradients from one backward per example (tied weights: both uses summed)."""
    rows: dict[str, list[Tensor]] = {n: [] for n, _ in model.named_parameters()}
    for i in range(batch[0].shape[0]):
        model.zero_grad()
        task.get_batch_output(model, *(t[i : i + 1] for t in batch)).sum().backward()
        for n, p in model.named_parameters():
            rows[n].append(torch.zeros_like(p) if p.grad is None else p.grad.clone())
    model.zero_grad()
    return {n: torch.stack(r) for n, r in rows.items()}


def _assert_grads_equal(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    assert list(actual) == list(expected)
    for name, ref in expected.items():
        assert ref.abs().sum() > 0 or name.endswith("token_type_embeddings.weight"), name
        torch.testing.assert_close(actual[name], ref, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(("family", "head"), CASES)
def test_hook_per_example_grads_equal_float64_loop(family, head):
    model = family.build(head)
    task, batch = _task(head), _batch(head)
    with HookGradientComputer(model, task) as gc:
        grads = gc.compute_per_sample_grad(batch)
        # Every parameterized module of these families has a closed-form rule.
        assert "fallback=0" in repr(gc)
    _assert_grads_equal(grads, _loop_reference(model, task, batch))


@pytest.mark.parametrize(("family", "head"), CASES)
def test_default_computer_routes_to_hooks_when_vmap_cannot_trace(family, head, caplog):
    model = family.build(head)
    task, batch = _task(head), _batch(head)
    gc = FunctionalGradientComputer(model, task)
    with caplog.at_level(logging.WARNING, logger="gradsketch.attribution._gradient_computers"):
        grads = gc.compute_per_sample_grad(batch)
    assert any("HookGradientComputer" in r.getMessage() for r in caplog.records)
    _assert_grads_equal(grads, _loop_reference(model, task, batch))


@pytest.mark.parametrize(("family", "head"), CASES)
def test_padding_contributes_nothing(family, head):
    """A right-padded example's gradient equals its tokens' gradient with no padding at all."""
    model = family.build(head)
    task, padded = _task(head), _batch(head, lengths=(5, SEQ, 6))
    alone = tuple(t[:1, :5] if t.dim() == 2 else t[:1] for t in padded)
    assert bool((padded[1][0] == 0).any())
    with HookGradientComputer(model, task) as gc:
        grads = gc.compute_per_sample_grad(padded)
        reference = gc.compute_per_sample_grad(alone)
    for name, ref in reference.items():
        torch.testing.assert_close(grads[name][:1], ref, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(
    ("head", "chunk_bytes"), [("cls", None), ("lm", None), ("lm", 1)], ids=["cls", "lm", "lm-rows"]
)
def test_factorized_projection_covers_conv1d_and_the_tied_embedding(head, chunk_bytes, monkeypatch):
    """GPT-2's Conv1D layers are factorized; the hooks' projection equals the dense one.

    The tied LM head's weight is a rest parameter: its gradient is formed in
    row chunks (``lm-rows``: one row at a time) and count-sketched.
    """
    if chunk_bytes is not None:
        monkeypatch.setattr(_hook_computer, "REST_CHUNK_BYTES", chunk_bytes)
    model = FAMILIES[0].build(head)
    task, batch = _task(head), _batch(head)
    projector = FactorizedProjector.from_model(model, k_in=4, k_out=3, seed=5, rest_proj_dim=16)
    conv1d = transformers.pytorch_utils.Conv1D
    factorized = {layer.name for layer in projector.layers}
    expected = {n for n, m in model.named_modules() if type(m) in (conv1d, nn.Linear)}
    if head == "lm":
        # lm_head's weight is wte's: it is one rest parameter, fed by both modules.
        assert model.lm_head.weight is model.transformer.wte.weight
        expected.discard("lm_head")
    assert factorized == expected
    assert all(layer.transposed for layer in projector.layers if layer.name != "score")
    with HookGradientComputer(model, task) as gc:
        fast = gc.project(batch, projector, model_id=0)
    dense = projector.project(_loop_reference(model, task, batch), model_id=0)
    torch.testing.assert_close(fast, dense)


def test_conv1d_layers_change_the_fingerprint():
    """A transposed layer lays out its coordinates differently: another map, another print."""
    model = FAMILIES[0].build("cls")
    projector = FactorizedProjector.from_model(model, k_in=4, k_out=3, seed=5, rest_proj_dim=16)
    assert '["LT",' in projector.fingerprint.extra


class LogitWithoutBatchOutput(AbstractModelOutput):
    """A task defined for one example only: layer hooks have no batched output for it."""

    get_output = staticmethod(LabelLogit.get_output)

    def get_out_to_loss_grad(
        self, model: nn.Module, weights: Any, buffers: Any, batch: Any
    ) -> Tensor:
        return torch.ones(batch[0].shape[0], 1)


def test_vmap_failure_without_a_batched_output_names_the_hook_computer():
    model = FAMILIES[0].build("cls")
    gc = FunctionalGradientComputer(model, LogitWithoutBatchOutput())
    with pytest.raises(
        VmapTraceError,
        match=r"vmap cannot trace GPT2ForSequenceClassification.*"
        r"Use HookGradientComputer.*get_batch_output",
    ) as info:
        gc.compute_per_sample_grad(_batch("cls"))
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_traker_text_classification_on_gpt2_with_the_default_computer(tmp_path):
    """TRAK's text task (input_ids, token_type_ids, attention_mask, labels) on a GPT-2 classifier.

    The default computer routes to the hooks; the scores equal those of a
    TRAKer built on HookGradientComputer with the same projector.
    """
    model = FAMILIES[0].build("cls").float()
    ids, mask, labels = _batch("cls", lengths=(5, SEQ, 6, 7, SEQ, 4))
    batch = (ids, torch.zeros_like(ids), mask, labels)
    grad_dim = sum(p.numel() for p in model.parameters())
    scores = {}
    for name, computer in (("default", None), ("hooks", HookGradientComputer)):
        extra = {} if computer is None else {"gradient_computer": computer}
        traker = TRAKer(
            model,
            "text_classification",
            6,
            save_dir=tmp_path / name,
            projector=CountSketchProjector(grad_dim, 16, 3, "cpu"),
            device="cpu",
            lambda_reg=1.0,
            progress=False,
            **extra,
        )
        traker.load_checkpoint(model.state_dict(), model_id=0)
        traker.featurize(batch, num_samples=6)
        traker.finalize_features()
        traker.start_scoring_checkpoint("val", model.state_dict(), model_id=0, num_targets=2)
        traker.score(tuple(t[:2] for t in batch), num_samples=2)
        scores[name] = np.asarray(traker.finalize_scores("val"))
    np.testing.assert_allclose(scores["default"], scores["hooks"], rtol=1e-4, atol=1e-6)
    assert np.abs(scores["hooks"]).max() > 0


@pytest.mark.parametrize(
    "module_path",
    [
        "transformers.models.llama.modeling_llama.LlamaRMSNorm",
        # (1 + weight) * n(x): the rule needs no formula per variant.
        "transformers.models.gemma.modeling_gemma.GemmaRMSNorm",
    ],
    ids=["llama", "gemma"],
)
def test_rms_norm_variants_get_the_elementwise_scale_rule(module_path):
    from gradsketch.attribution._layers import GRAD_SAMPLERS, hf
    from gradsketch.attribution._layers.norm import elementwise_scale_grad_sample

    module_name, _, cls_name = module_path.rpartition(".")
    cls = getattr(pytest.importorskip(module_name), cls_name)
    torch.manual_seed(0)
    norm = cls(8).to(F64)
    with torch.no_grad():
        norm.weight.normal_()
    container = nn.Sequential(norm)
    registered = hf.register_model_types(container)
    assert GRAD_SAMPLERS[cls] is elementwise_scale_grad_sample
    assert registered in ([cls], [])  # [] when an earlier test registered it
    x, g = torch.randn(3, 4, 8, dtype=F64), torch.randn(3, 4, 8, dtype=F64)
    got = GRAD_SAMPLERS[cls](norm, (x,), g)["weight"]
    for b in range(3):
        (expected,) = torch.autograd.grad((norm(x[b]) * g[b]).sum(), [norm.weight])
        torch.testing.assert_close(got[b], expected)
