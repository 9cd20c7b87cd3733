"""Token data for the SLT layer: datasets as tensors, per-token losses, observables.

Datasets arrive as a ``datasets.Dataset`` with an ``input_ids`` column, a
``[n, seq]`` integer tensor, or any sequence of ``{"input_ids": ...}`` rows;
they are turned into one ``[n, seq]`` int64 tensor once, so that batches are
index lookups rather than a DataLoader's per-row collation.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from gradsketch._hash import tensors_digest
from gradsketch._model_kind import classifier_task, hf_model_kind, model_label
from gradsketch.errors import NonFiniteLossError, UnsupportedModelError

__all__ = [
    "LossFn",
    "NonFiniteLossError",
    "Observable",
    "as_token_tensor",
    "check_causal_lm",
    "check_finite_weights",
    "check_token_range",
    "obs_id",
    "per_token_loss",
    "token_digest",
    "vocab_size",
]

#: ``(model, input_ids [batch, seq]) -> per-token loss [batch, seq - 1]``.
LossFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def nonfinite_cause(step: int, lr: float) -> str:
    """Why a chain's loss is NaN or infinite at ``step``, and the fix, for the error text.

    Example:
        >>> nonfinite_cause(3, 1e-4)
        'after 3 steps: the chain diverged; lower `lr` (try lr=1e-05) or raise `localization`'
    """
    if step == 0:
        return "at the model's own weights: check them and `loss_fn`"
    return (
        f"after {step} steps: the chain diverged; lower `lr` (try lr={lr / 10:.2g}) or raise "
        "`localization`"
    )


def as_token_tensor(dataset: Any, *, name: str = "dataset") -> torch.Tensor:
    """The ``input_ids`` of a dataset as one ``[n, seq]`` int64 CPU tensor.

    Example:
        >>> as_token_tensor([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5, 6]}]).shape
        torch.Size([2, 3])
    """
    if isinstance(dataset, torch.Tensor):
        ids = dataset
    elif hasattr(dataset, "column_names") and hasattr(dataset, "with_format"):
        if "input_ids" not in dataset.column_names:
            raise ValueError(
                f"`{name}` has columns {dataset.column_names} but no 'input_ids'; tokenize it "
                "into an 'input_ids' column of equal-length sequences."
            )
        # One batch read of the column (indexing the column alone reads row by row).
        column = dataset.with_format("numpy")[:]["input_ids"]
        if column.dtype == object:
            raise ValueError(
                f"`{name}` has 'input_ids' sequences of different lengths; pad or chunk them to "
                "one length."
            )
        ids = torch.as_tensor(column)
    elif isinstance(dataset, Mapping) and "input_ids" in dataset:
        ids = torch.as_tensor(dataset["input_ids"])
    else:
        try:
            rows = [row["input_ids"] for row in dataset]
        except (TypeError, KeyError, IndexError) as exc:
            raise TypeError(
                f"`{name}` must be a datasets.Dataset with an 'input_ids' column, a [n, seq] "
                f"integer tensor, or rows {{'input_ids': ...}}; got {type(dataset).__name__}."
            ) from exc
        ids = torch.stack([torch.as_tensor(r) for r in rows]) if rows else torch.empty(0, 0)
    if ids.dim() != 2 or ids.is_floating_point() or ids.is_complex():
        raise ValueError(
            f"`{name}` must hold integer token ids of shape [n, seq], got dtype {ids.dtype} and "
            f"shape {tuple(ids.shape)}; pad or chunk the sequences to one length."
        )
    if ids.shape[1] < 2:
        raise ValueError(
            f"`{name}` sequences must have at least 2 tokens for a next-token loss, got "
            f"{ids.shape[1]}."
        )
    return ids.to(device="cpu", dtype=torch.int64).contiguous()


def vocab_size(model: nn.Module) -> int | None:
    """Rows of the model's input embedding (token ids it takes), or None when unknown.

    Example:
        >>> vocab_size(torch.nn.Sequential(torch.nn.Embedding(5, 3)))
        5
    """
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    if embedding is None:
        embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if isinstance(embedding, nn.Embedding):
        return int(embedding.num_embeddings)
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return int(size) if isinstance(size, int) else None


def check_token_range(ids: torch.Tensor, vocab: int, *, name: str = "dataset") -> None:
    """Refuse token ids outside ``[0, vocab)`` (the embedding would fail on them).

    Example:
        >>> check_token_range(torch.tensor([[0, 7]]), 5)
        Traceback (most recent call last):
        ...
        ValueError: `dataset` holds token id 7 (row 0), but the model's vocabulary has 5 ids ...
    """
    if ids.numel() == 0:
        return
    high, low = int(ids.max()), int(ids.min())
    if high < vocab and low >= 0:
        return
    bad = high if high >= vocab else low
    row = int((ids == bad).any(dim=1).nonzero()[0, 0])
    raise ValueError(
        f"`{name}` holds token id {bad} (row {row}), but the model's vocabulary has {vocab} ids "
        f"(0..{vocab - 1}); tokenize with the model's own tokenizer, or resize its embeddings "
        "(model.resize_token_embeddings) to cover the ids."
    )


def check_finite_weights(model: nn.Module) -> None:
    """Refuse a model with a NaN or infinite parameter, naming it (every loss would be too).

    Example:
        >>> layer = torch.nn.Linear(2, 1)
        >>> with torch.no_grad():
        ...     layer.bias.fill_(float("inf"))
        Parameter containing:
        tensor([inf], requires_grad=True)
        >>> check_finite_weights(layer)
        Traceback (most recent call last):
        ...
        gradsketch.errors.NonFiniteLossError: `model` parameter 'bias' holds 1 NaN ...
    """
    for pname, param in model.named_parameters():
        finite = torch.isfinite(param.detach())
        if not bool(finite.all()):
            count = int((~finite).sum())
            raise NonFiniteLossError(
                f"`model` parameter {pname!r} holds {count} NaN or infinite values of "
                f"{param.numel()}; every loss of this model is non-finite. Reload the trained "
                "weights (the checkpoint or the training run that wrote them is broken)."
            )


def token_digest(ids: torch.Tensor) -> str:
    """A short digest of a token tensor (its shape and values), for settings records."""
    return tensors_digest([ids], shapes=True)


def _logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is in the hf extra
        PreTrainedModel = ()  # type: ignore[assignment,misc]
    if isinstance(model, PreTrainedModel):
        # Skip the KV cache and the output wrapper: only the logits are used.
        return model(input_ids, return_dict=False, use_cache=False)[0]  # type: ignore[no-any-return]
    out = model(input_ids)
    return out.logits if hasattr(out, "logits") else out  # type: ignore[no-any-return]


def check_causal_lm(model: nn.Module, api: str = "gradsketch.slt") -> None:
    """Refuse a transformers model that is not a causal LM, before any work (no forward pass).

    :func:`per_token_loss` (the default loss) reads next-token logits
    ``[batch, seq, vocab]`` of ``model(input_ids)``: an encoder-decoder
    (``config.is_encoder_decoder``: T5, BART) needs decoder inputs, and an
    encoder or a classification head (BERT, RoBERTa, ViT) has no
    next-token logits. Modules that are not transformers models are left
    to the forward pass (a plain ``nn.Module`` returning logits works).

    Raises:
        UnsupportedModelError: naming the model type, what ``slt`` samples
            and what to use instead.

    Example:
        >>> check_causal_lm(torch.nn.Sequential(torch.nn.Embedding(5, 5)))  # not transformers
    """
    kind = hf_model_kind(model)
    if kind in (None, "causal_lm"):
        return
    if kind == "encoder_decoder":
        what = "an encoder-decoder (`config.is_encoder_decoder` is true)"
        instead = (
            "For training-data attribution of a sequence-to-sequence model use "
            '`gradsketch.attribution.TRAKer(..., task="seq2seq_lm")`.'
        )
    else:
        what = "not a causal language model (no causal LM head)"
        task = classifier_task(model)
        instead = (
            f"For attribution of a classifier use `gradsketch.attribution.TRAKer(..., "
            f'task="{task}")`.'
            if task is not None
            else "For an encoder, attribution has the classification tasks of "
            '`gradsketch.attribution.TRAKer` (e.g. task="text_classification").'
        )
    raise UnsupportedModelError(
        f"{api} samples causal language models, got {model_label(model)}: {what}. "
        "Supported: AutoModelForCausalLM-style models (`config.is_encoder_decoder` false and "
        "a causal LM head, e.g. GPT2LMHeadModel, LlamaForCausalLM) whose "
        "`model(input_ids)` gives next-token logits. "
        f"{instead} To sample this model anyway, pass `loss_fn=(model, input_ids) -> "
        "[batch, seq - 1]` per-token losses that fit it; "
        "`gradsketch.slt.bayesian_influence` takes any model with a per-example `loss_fn`."
    )


def per_token_loss(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of every position: ``[batch, seq - 1]``.

    ``loss[b, t] = -log softmax(logits[b, t])[input_ids[b, t + 1]]``, computed
    by torch's ``cross_entropy`` over every position (the last one's target
    ignored), so that the forward pass does not copy the logits without their
    last position. It rounds as devinterp's default loss (``log_softmax``,
    then ``gather``) and as a ``loss_fn`` a user writes that way, forward and
    backward, on every CPU instruction set: a loss scaled by 2 at half the
    ``n_beta`` then gives the same chains and LLC bit for bit. (The native
    one-pass kernel, :func:`~gradsketch.slt._fast.token_cross_entropy`,
    rounds its own way.)

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Embedding(5, 5))
        >>> per_token_loss(model, torch.tensor([[0, 1, 2]])).shape
        torch.Size([1, 2])
    """
    logits = _logits(model, input_ids)
    b, s, v = logits.shape
    targets = torch.full_like(input_ids, -100)  # cross_entropy's ignore_index
    targets[:, :-1] = input_ids[:, 1:]
    loss = F.cross_entropy(logits.reshape(b * s, v), targets.view(-1), reduction="none")
    return loss.view(b, s)[:, :-1]


def obs_id(task_name: str) -> str:
    """An observable's name as an identifier (devinterp's rule: non-alphanumerics become ``_``).

    Example:
        >>> obs_id("pile-10k")
        'pile_10k'
    """
    out = "".join(c if c.isalnum() or c == "_" else "_" for c in task_name)
    if out and out[0].isdigit():
        out = "_" + out
    return out or "_"


class Observable:
    """A probe dataset whose per-token loss is recorded at every draw.

    The sequences are fixed once: ``batch_size * batches_per_draw`` rows
    drawn without replacement by ``random.Random(seed).sample`` (devinterp's
    choice, so both pick the same rows).

    Args:
        name: The observable's name (its variables are ``loss_<obs_id>``).
        ids: ``[n, seq]`` token ids.
        batches_per_draw: Batches evaluated at each draw.
        batch_size: Rows per batch.
        seed: Seed of the row choice.
    """

    def __init__(
        self, name: str, ids: torch.Tensor, *, batches_per_draw: int, batch_size: int, seed: int
    ) -> None:
        if isinstance(batches_per_draw, bool) or not isinstance(batches_per_draw, int):
            raise TypeError(
                f"`batches_per_draw` of {name!r} must be an int, got {batches_per_draw!r}."
            )
        if batches_per_draw < 1:
            raise ValueError(
                f"`batches_per_draw` of {name!r} must be >= 1, got {batches_per_draw}."
            )
        self.name = name
        self.obs_id = obs_id(name)
        self.batches_per_draw = batches_per_draw
        self.n_samples = batch_size * batches_per_draw
        if ids.shape[0] < self.n_samples:
            raise ValueError(
                f"observable {name!r} has {ids.shape[0]} sequences but needs batch_size * "
                f"batches_per_draw = {self.n_samples}; lower `batches_per_draw` for it (pass "
                "(dataset, batches_per_draw)) or give more sequences."
            )
        rows = random.Random(seed).sample(range(ids.shape[0]), self.n_samples)
        self.input_ids = ids[torch.tensor(rows, dtype=torch.int64)]
        self.digest = token_digest(ids)
