"""Tiny Hugging Face models of many families, their batches and float64 loop references.

Every family is built from a config in code (2 layers, width 64, never
downloaded weights) with the head its task reads: a causal LM for
``"language_modeling"``, a sequence classifier for ``"text_classification"``,
an image classifier for ``"image_classification"`` and an encoder-decoder
LM for ``"seq2seq_lm"``. Batches are right-padded: every other sequence is
shorter than the batch's length, with ``attention_mask`` zeros (and labels
``-100``) past its end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor, nn

VOCAB, SEQ, WIDTH, LAYERS, HEADS, CLASSES, PAD = 64, 16, 64, 2, 4, 3, 0
TARGET_SEQ = 12  # seq2seq targets are shorter than their sources
IMAGE, PATCH, CHANNELS = 16, 4, 3
COMMON = {"vocab_size": VOCAB, "pad_token_id": PAD, "bos_token_id": 1, "eos_token_id": 2}
#: The task of each kind of head.
TASKS = {
    "lm": "language_modeling",
    "cls": "text_classification",
    "image": "image_classification",
    "seq2seq": "seq2seq_lm",
}


def _transformers() -> Any:
    import transformers

    return transformers


def tiny_gpt2(
    vocab: int,
    positions: int,
    *,
    tie: bool = True,
    dtype: torch.dtype = torch.float64,
    width: int = 8,
) -> nn.Module:
    """A one-layer GPT-2 (``width`` wide, two heads, no dropout) from seed 0, in eval mode."""
    transformers = _transformers()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=vocab,
        n_positions=positions,
        n_embd=width,
        n_layer=1,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=tie,
    )
    return transformers.GPT2LMHeadModel(cfg).to(dtype).eval()


@dataclass(frozen=True)
class Family:
    """A model family: its config, the head class and the kind of task it serves.

    ``vmap`` says whether ``torch.func.vmap`` traces the model (else the
    functional computer hands over to the layer hooks); ``rtol`` is the
    relative tolerance of float64 comparisons (families that compute a part
    in float32 whatever the weights' dtype need more than rounding).
    """

    name: str
    config: Callable[[], Any]
    head: str
    kind: str
    vmap: bool = False
    rtol: float = 1e-7

    @property
    def task(self) -> str:
        return TASKS[self.kind]

    def build(self, dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Module:
        cfg = self.config()
        if self.kind == "cls":
            cfg.num_labels = CLASSES
        if getattr(cfg, "router_dtype", "float32") != str(dtype).removeprefix("torch."):
            _skip_mixed_router(self.head)
        torch.manual_seed(seed)
        model = getattr(_transformers(), self.head)(cfg)
        return model.to(dtype).eval()

    def batch(self, n: int = 4, seed: int = 1, dtype: torch.dtype = torch.float64) -> tuple:
        """A canonical batch of ``n`` examples for this family's task."""
        return make_batch(self.kind, n, seed, dtype)


def _lengths(n: int, seq: int, g: torch.Generator) -> Tensor:
    """Full length for even rows, a random shorter one (at least 3) for odd rows."""
    short = torch.randint(3, seq, (n,), generator=g)
    return torch.where(torch.arange(n) % 2 == 0, torch.full((n,), seq), short)


def _tokens(n: int, seq: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
    mask = (torch.arange(seq) < _lengths(n, seq, g)[:, None]).long()
    ids = torch.randint(3, VOCAB, (n, seq), generator=g).masked_fill(mask == 0, PAD)
    return ids, mask


def _skip_mixed_router(head: str) -> None:
    """Skip where a Switch router cannot run beside weights of another dtype.

    Transformers before the router learned to cast its own classifier (5.0 among
    them) feed it float32 inputs whatever the weights' dtype, so a float64 model
    fails inside transformers; newer versions run it.
    """
    import inspect

    module = inspect.getmodule(getattr(_transformers(), head))
    router = getattr(module, "SwitchTransformersTop1Router", None)
    if router is not None and "self.classifier.to(" not in inspect.getsource(router.forward):
        pytest.skip(f"this transformers' {head} router mixes float32 inputs with other weights")


def make_batch(kind: str, n: int, seed: int = 1, dtype: torch.dtype = torch.float64) -> tuple:
    """``n`` right-padded examples in the canonical tuple of the task of ``kind``."""
    g = torch.Generator().manual_seed(seed)
    if kind == "image":
        images = torch.randn(n, CHANNELS, IMAGE, IMAGE, generator=g, dtype=torch.float64)
        return images.to(dtype), torch.arange(n) % CLASSES
    ids, mask = _tokens(n, SEQ, g)
    if kind == "lm":
        return ids, mask, ids.masked_fill(mask == 0, -100)
    if kind == "cls":
        return ids, mask, torch.arange(n) % CLASSES
    targets, target_mask = _tokens(n, TARGET_SEQ, g)
    return ids, mask, targets.masked_fill(target_mask == 0, -100)


def loop_reference(model: nn.Module, task: Any, batch: tuple) -> dict[str, Tensor]:
    """Per-example gradients from one backward of a batch of one per example.

    Tied weights get the sum of their uses (one ``.grad``); unused
    parameters get zeros.
    """
    rows: dict[str, list[Tensor]] = {n: [] for n, _ in model.named_parameters()}
    output = getattr(task, "get_batch_output", None)
    if output is None:
        from gradsketch.attribution._modelout import resolve_batch_output

        output = resolve_batch_output(task)
    for i in range(batch[0].shape[0]):
        model.zero_grad()
        output(model, *(t[i : i + 1] for t in batch)).sum().backward()
        for n, p in model.named_parameters():
            rows[n].append(torch.zeros_like(p) if p.grad is None else p.grad.detach().clone())
    model.zero_grad()
    return {n: torch.stack(r) for n, r in rows.items()}


def float64_case(
    family: Family, n: int = 4
) -> tuple[nn.Module, Any, tuple[Tensor, ...], dict[str, Tensor]]:
    """``family``'s float64 model, its task, ``family.batch(n)`` and the loop's gradients."""
    from gradsketch.attribution._lm_data import as_task_batch
    from gradsketch.attribution._modelout import resolve_task

    model = family.build(torch.float64)
    task = resolve_task(family.task)
    batch = as_task_batch(task, family.batch(n))
    return model, task, batch, loop_reference(model, task, batch)


# -- configs -----------------------------------------------------------------------
def _decoder(name: str, **extra: Any) -> Callable[[], Any]:
    """A Llama-style config class (``num_hidden_layers``, ``hidden_size``, ...)."""

    def build() -> Any:
        cls = getattr(_transformers(), name)
        kw: dict[str, Any] = {
            "num_hidden_layers": LAYERS,
            "hidden_size": WIDTH,
            "num_attention_heads": HEADS,
            "intermediate_size": 2 * WIDTH,
            "max_position_embeddings": 2 * SEQ,
            **COMMON,
        }
        kw.update(extra)
        return cls(**kw)

    return build


def _gpt2() -> Any:
    return _transformers().GPT2Config(
        n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, n_positions=2 * SEQ, **COMMON
    )


def _gpt_neo() -> Any:
    return _transformers().GPTNeoConfig(
        num_layers=LAYERS,
        hidden_size=WIDTH,
        num_heads=HEADS,
        attention_types=[[["global", "local"], 1]],
        window_size=8,
        max_position_embeddings=2 * SEQ,
        intermediate_size=2 * WIDTH,
        **COMMON,
    )


def _gptj() -> Any:
    return _transformers().GPTJConfig(
        n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, n_positions=2 * SEQ, rotary_dim=8, **COMMON
    )


def _bloom() -> Any:
    return _transformers().BloomConfig(n_layer=LAYERS, hidden_size=WIDTH, n_head=HEADS, **COMMON)


def _opt() -> Any:
    return _transformers().OPTConfig(
        num_hidden_layers=LAYERS,
        hidden_size=WIDTH,
        ffn_dim=2 * WIDTH,
        num_attention_heads=HEADS,
        max_position_embeddings=2 * SEQ,
        word_embed_proj_dim=WIDTH,
        **COMMON,
    )


def _falcon() -> Any:
    return _transformers().FalconConfig(
        num_hidden_layers=LAYERS, hidden_size=WIDTH, num_attention_heads=HEADS, **COMMON
    )


def _gemma3() -> Any:
    return _decoder("Gemma3TextConfig", num_key_value_heads=2, head_dim=16, sliding_window=8)()


def _distilbert() -> Any:
    return _transformers().DistilBertConfig(
        n_layers=LAYERS,
        dim=WIDTH,
        n_heads=HEADS,
        hidden_dim=2 * WIDTH,
        max_position_embeddings=2 * SEQ,
        **COMMON,
    )


def _vit() -> Any:
    return _transformers().ViTConfig(
        image_size=IMAGE,
        patch_size=PATCH,
        num_channels=CHANNELS,
        hidden_size=WIDTH,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=2 * WIDTH,
        num_labels=CLASSES,
    )


def _t5() -> Any:
    return _transformers().T5Config(
        d_model=WIDTH,
        d_kv=WIDTH // HEADS,
        d_ff=2 * WIDTH,
        num_layers=LAYERS,
        num_heads=HEADS,
        relative_attention_num_buckets=8,
        decoder_start_token_id=PAD,
        **COMMON,
    )


def _bart() -> Any:
    return _transformers().BartConfig(
        d_model=WIDTH,
        encoder_layers=LAYERS,
        decoder_layers=LAYERS,
        encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS,
        encoder_ffn_dim=2 * WIDTH,
        decoder_ffn_dim=2 * WIDTH,
        max_position_embeddings=2 * SEQ,
        decoder_start_token_id=2,
        forced_eos_token_id=None,
        **COMMON,
    )


def _switch() -> Any:
    return _transformers().SwitchTransformersConfig(
        d_model=WIDTH,
        d_kv=WIDTH // HEADS,
        d_ff=2 * WIDTH,
        num_layers=LAYERS,
        num_decoder_layers=LAYERS,
        num_heads=HEADS,
        num_experts=4,
        encoder_sparse_step=1,
        decoder_sparse_step=1,
        relative_attention_num_buckets=8,
        decoder_start_token_id=PAD,
        **COMMON,
    )


def _family(name: str, config: Callable[[], Any], head: str, kind: str, **kw: Any) -> Family:
    return Family(name, config, head, kind, **kw)


#: Every family, in the order of the matrix. MoE families run their experts
#: eagerly: the default grouped matmul has no float64 kernel. Gemma 2's window
#: spans the sequence: with a shorter one, eager attention gives padded queries
#: whose window holds padding only a row of -inf, and NaN flows into the
#: example. Gemma and Mixtral-style routers compute in float32 whatever the
#: weights' dtype (float32 rounding in float64 runs).
FAMILIES: list[Family] = [
    _family("gpt2", _gpt2, "GPT2LMHeadModel", "lm"),
    _family("gpt_neo", _gpt_neo, "GPTNeoForCausalLM", "lm", vmap=True),
    _family("gpt_neox", _decoder("GPTNeoXConfig"), "GPTNeoXForCausalLM", "lm"),
    _family("gptj", _gptj, "GPTJForCausalLM", "lm"),
    _family("bloom", _bloom, "BloomForCausalLM", "lm"),
    _family("opt", _opt, "OPTForCausalLM", "lm"),
    _family("llama", _decoder("LlamaConfig", num_key_value_heads=2), "LlamaForCausalLM", "lm"),
    _family(
        "mistral", _decoder("MistralConfig", num_key_value_heads=2), "MistralForCausalLM", "lm"
    ),
    _family("qwen2", _decoder("Qwen2Config", num_key_value_heads=2), "Qwen2ForCausalLM", "lm"),
    _family(
        "qwen3",
        _decoder("Qwen3Config", num_key_value_heads=2, head_dim=16),
        "Qwen3ForCausalLM",
        "lm",
    ),
    _family(
        "gemma",
        _decoder("GemmaConfig", num_key_value_heads=2, head_dim=16),
        "GemmaForCausalLM",
        "lm",
        rtol=1e-5,
    ),
    _family(
        "gemma2",
        _decoder("Gemma2Config", num_key_value_heads=2, head_dim=16, sliding_window=SEQ),
        "Gemma2ForCausalLM",
        "lm",
        vmap=True,
        rtol=1e-5,
    ),
    _family("gemma3", _gemma3, "Gemma3ForCausalLM", "lm", rtol=1e-5),
    _family("phi", _decoder("PhiConfig"), "PhiForCausalLM", "lm"),
    _family("phi3", _decoder("Phi3Config", num_key_value_heads=2), "Phi3ForCausalLM", "lm"),
    _family("falcon", _falcon, "FalconForCausalLM", "lm", vmap=True),
    _family("olmo", _decoder("OlmoConfig"), "OlmoForCausalLM", "lm"),
    _family(
        "stablelm",
        _decoder("StableLmConfig", num_key_value_heads=HEADS),
        "StableLmForCausalLM",
        "lm",
    ),
    _family(
        "mixtral",
        _decoder(
            "MixtralConfig",
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            experts_implementation="eager",
        ),
        "MixtralForCausalLM",
        "lm",
        rtol=1e-5,
    ),
    _family(
        "qwen2_moe",
        _decoder(
            "Qwen2MoeConfig",
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=2 * WIDTH,
            experts_implementation="eager",
        ),
        "Qwen2MoeForCausalLM",
        "lm",
        rtol=1e-5,
    ),
    _family("bert", _decoder("BertConfig"), "BertForSequenceClassification", "cls"),
    _family("roberta", _decoder("RobertaConfig"), "RobertaForSequenceClassification", "cls"),
    _family("distilbert", _distilbert, "DistilBertForSequenceClassification", "cls"),
    _family(
        "deberta_v2",
        _decoder("DebertaV2Config"),
        "DebertaV2ForSequenceClassification",
        "cls",
        vmap=True,
    ),
    _family("vit", _vit, "ViTForImageClassification", "image", vmap=True),
    _family("t5", _t5, "T5ForConditionalGeneration", "seq2seq"),
    _family("bart", _bart, "BartForConditionalGeneration", "seq2seq"),
    _family("switch", _switch, "SwitchTransformersForConditionalGeneration", "seq2seq"),
]
BY_NAME = {f.name: f for f in FAMILIES}


def _falcon_grouped() -> Any:
    """Falcon's new decoder architecture: query_key_value as [kv head][its q heads, k, v]."""
    return _transformers().FalconConfig(
        num_hidden_layers=LAYERS,
        hidden_size=WIDTH,
        num_attention_heads=HEADS,
        num_kv_heads=2,
        new_decoder_architecture=True,
        **COMMON,
    )


#: The causal language models of the matrix, and layouts only some checkpoints of a
#: family use (not part of the attribution matrix).
DECODERS: list[Family] = [f for f in FAMILIES if f.kind == "lm"] + [
    _family("falcon_grouped", _falcon_grouped, "FalconForCausalLM", "lm"),
]
DECODERS_BY_NAME = {f.name: f for f in DECODERS}


def _bigcode(multi_query: bool) -> Callable[[], Any]:
    def build() -> Any:
        return _transformers().GPTBigCodeConfig(
            n_layer=LAYERS,
            n_embd=WIDTH,
            n_head=HEADS,
            n_positions=2 * SEQ,
            multi_query=multi_query,
            **COMMON,
        )

    return build


DECODERS += [
    _family("gpt_bigcode", _bigcode(False), "GPTBigCodeForCausalLM", "lm"),
    _family("gpt_bigcode_mq", _bigcode(True), "GPTBigCodeForCausalLM", "lm"),
]
DECODERS_BY_NAME = {f.name: f for f in DECODERS}
