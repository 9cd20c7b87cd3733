"""Tiny Hugging Face language models and token data for the slt tests (built in code)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 256
SEQ = 17  # tokens per sequence: 16 predicted positions


def tiny_gpt2(*, dropout: float = 0.0, n_head: int = 4, seed: int = 0) -> torch.nn.Module:
    """GPT-2, 2 layers, width 32, byte vocabulary; dropout off unless asked."""
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=n_head,
        vocab_size=VOCAB,
        n_positions=64,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )
    return transformers.GPT2LMHeadModel(cfg)


def tiny_llama(*, heads: int = 4, kv_heads: int = 2, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=64,
        vocab_size=64,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(cfg)


def tiny_neox(*, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.GPTNeoXConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=64,
        tie_word_embeddings=False,
    )
    return transformers.GPTNeoXForCausalLM(cfg)


def tiny_qwen2(*, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=64,
        tie_word_embeddings=False,
    )
    return transformers.Qwen2ForCausalLM(cfg)


def token_data(n: int, *, seq: int = SEQ, seed: int = 0) -> torch.Tensor:
    """``[n, seq]`` byte tokens with some structure (repeated runs), so losses vary."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randint(0, VOCAB, (n, seq // 2 + 1), generator=gen)
    return base.repeat_interleave(2, dim=1)[:, :seq].contiguous()


def trained_tiny_gpt2(ids: torch.Tensor, *, steps: int = 60) -> torch.nn.Module:
    """:func:`tiny_gpt2` after ``steps`` full-batch Adam steps on ``ids``.

    Near a minimum the sampled loss rises above L(w*), as the step-size pilots
    need; at a random init it may fall, and whether it does depends on how
    the installed transformers initialises the weights.
    """
    model = tiny_gpt2()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        logits = model(ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def reference_token_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Float64 next-token cross-entropy by log-softmax and gather (the obvious way)."""
    with torch.no_grad():
        logits = model(ids).logits.double()
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    return -logp.gather(-1, ids[:, 1:, None])[..., 0]


def loss_on_two_threads(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The default per-token loss, refusing to run on other than 2 torch threads.

    Module-level, so ``sample(cores=k)`` can send it to its worker processes.
    """
    from gradsketch.slt import per_token_loss

    threads = torch.get_num_threads()
    assert threads == 2, f"the loss ran on {threads} torch threads, not 2"
    return per_token_loss(model, ids)


def loss_on_two_threads_with_global_dropout(
    model: torch.nn.Module, ids: torch.Tensor
) -> torch.Tensor:
    """:func:`loss_on_two_threads` through torch's functional dropout (its global generator).

    Chains whose loss draws from torch's global generator cannot share a
    process, so ``sample(cores=k)`` runs them in worker processes.
    """
    return torch.nn.functional.dropout(loss_on_two_threads(model, ids), p=0.1, training=True)


def count_calibrations(monkeypatch: pytest.MonkeyPatch, step: float = 2.345e-4) -> list[int]:
    """Replace ``lr="auto"``'s pilot runs by a counter returning ``step``; the calls list.

    For tests of what is cached, shared and recorded, not of the calibration,
    which ``tests/slt/test_auto_lr.py::test_auto_records_the_calibrated_step``
    runs for real (the pilots cost seconds each).
    """
    import gradsketch.sampling

    calls: list[int] = []

    def counted(*args: object, **kwargs: object) -> float:
        calls.append(1)
        return step

    monkeypatch.setattr(gradsketch.sampling, "calibrated_lr", counted)
    return calls
