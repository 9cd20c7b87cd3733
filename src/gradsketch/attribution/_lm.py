"""Hugging Face conventions: a language-modeling task, classification without token types.

Tasks here take batches the way Hugging Face code builds them: a dict with
``input_ids``, ``attention_mask`` and ``labels`` (what a tokenizer and a data
collator return) or TRAK's positional tuple. :meth:`as_batch` turns either
into the task's canonical tuple, which is what the gradient computers see
(``vmap`` and the layer hooks index batches by position).

**Language modeling** (TRAK's derivation, Park et al., ICML 2023, sec. 3,
applied token by token). A causal LM predicts token ``y_t`` from
the tokens before it with probability ``p_t = softmax(z_{t-1})[y_t]``; its
loss is ``L = -Σ_t log p_t`` over the predicted tokens (``labels != -100``).
Writing each token's loss as a logistic loss of its log-odds,

    f_t = log(p_t / (1 - p_t)) = z_{y_t} - logsumexp_{j≠y_t} z_j,
    -log p_t = log(1 + exp(-f_t)),

makes each token one example of TRAK's binary-classification derivation, so
the model output of a sequence is ``f = Σ_t f_t`` and the out-to-loss term
is ``-dL/df_t = 1 - p_t``, a diagonal ``Q = diag(1 - p_t)`` over the tokens:
the loss gradient is ``∇L = -Σ_t (1 - p_t) ∇f_t``. TRAK's score keeps one
out-to-loss weight per training example, so the diagonal is replaced by its
mean over the example's predicted tokens, ``q = mean_t (1 - p_t)``: exact
when the tokens' ``1 - p_t`` agree, and the weight for which ``q ∇f`` matches
``Σ_t (1 - p_t) ∇f_t`` in expectation when the token gradients are
exchangeable. Because ``f`` is a sum over tokens, a query's feature is the
sum of its tokens' features, and per-token scores (``per_token=True`` in
:meth:`TRAKer.start_scoring_checkpoint`) add up over the tokens to the
query's score.

**Sequence-to-sequence LM** (``"seq2seq_lm"``: T5, BART, ...). The output is
the summed log-likelihood of the target tokens, ``f = Σ_t log p(y_t | x,
y_<t)`` over ``labels != -100`` (the decoder's logits at ``t`` predict
``labels[:, t]``, no shift), and the training loss is ``-f``, so ``Q = 1``.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from gradsketch._model_kind import hf_model_kind, model_label
from gradsketch.attribution._modelout import (
    BatchedModelOutput,
    SoftmaxModelOutput,
    TextClassificationModelOutput,
    margins,
    model_logits,
    register_loss_grad_from_output,
    register_task,
    softmax_loss_grad,
)
from gradsketch.attribution._task import register_task_slot
from gradsketch.errors import BatchFormatError, UnsupportedModelError

#: Label value of positions that are not predicted (Hugging Face's convention).
IGNORE_INDEX = -100


_FORWARD_PARAMS: dict[type[nn.Module], tuple[frozenset[str], bool]] = {}


def _forward_params(model_type: type[nn.Module]) -> tuple[frozenset[str], bool]:
    """Named parameters of ``model_type.forward`` and whether it takes ``**kwargs`` (cached)."""
    if model_type not in _FORWARD_PARAMS:
        params = inspect.signature(model_type.forward).parameters.values()
        names = frozenset(p.name for p in params)
        var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        _FORWARD_PARAMS[model_type] = (names, var_kw)
    return _FORWARD_PARAMS[model_type]


def _wrapped(model: nn.Module) -> nn.Module:
    """The model a peft wrapper forwards to (``model`` itself otherwise)."""
    base = getattr(model, "get_base_model", None)
    return base() if callable(base) else model


def _accepted(model: nn.Module, key: str) -> bool:
    """Whether ``model``'s forward takes ``key``.

    Hugging Face forwards collect attention-implementation options in
    ``**kwargs`` and name every input they read, so for them (and for peft
    wrappers, judged by the wrapped model) only named inputs are passed;
    other models with ``**kwargs`` get every input, as TRAK passes them.
    """
    target = _wrapped(model)
    names, var_kw = _forward_params(type(target))
    if key in names:
        return True
    return var_kw and not type(target).__module__.startswith("transformers.")


def _call_model(
    model: nn.Module,
    params: tuple[dict[str, Tensor], dict[str, Tensor]] | None,
    kwargs: Mapping[str, Tensor | None],
) -> Tensor:
    """Logits of ``model(**kwargs)``, without a KV cache, through ``functional_call`` if given.

    ``None`` values are left out (the model's defaults apply).
    """
    kw: dict[str, Any] = {
        k: v
        for k, v in kwargs.items()
        if v is not None and (k == "input_ids" or _accepted(model, k))
    }
    target = _wrapped(model)
    names, var_kw = _forward_params(type(target))
    # A KV cache holds the batch's keys: a module run again on one example (the
    # hooks' per-example fallback) would append to it. Models that take
    # `use_cache` through **kwargs (SwitchTransformers) get it too.
    if "use_cache" in names or (var_kw and hasattr(getattr(target, "config", None), "use_cache")):
        kw["use_cache"] = False
    if params is None:
        out = model(**kw)
    else:
        out = torch.func.functional_call(model, params, args=(), kwargs=kw)
    return model_logits(out)


def _get(batch: Mapping[str, Any], key: str) -> Tensor | None:
    value = batch.get(key)
    return None if value is None else torch.as_tensor(value)


def _tuple_items(
    batch: Sequence[Any], task: str, sizes: range, expected: str
) -> list[Tensor | None]:
    """A tuple batch's entries as tensors (``None`` kept), checked to number one of ``sizes``."""
    items = list(batch)
    if len(items) not in sizes:
        raise BatchFormatError(
            f"`batch` for {task} has {len(items)} entries; expected {expected}, or a dict with "
            "those keys."
        )
    return [None if t is None else torch.as_tensor(t) for t in items]


def _require_ids(batch: Mapping[str, Any], task: str) -> Tensor:
    ids = _get(batch, "input_ids")
    if ids is None:
        raise BatchFormatError(
            f"`batch` for {task} is a mapping without 'input_ids'; it has keys {sorted(batch)}. "
            "Pass the tokenizer's output (input_ids, attention_mask, ...)."
        )
    return ids


# -- language modeling ----------------------------------------------------------
def _upcast_half(t: Tensor) -> Tensor:
    # Log-softmax over a vocabulary in bf16 / fp16 loses the small probabilities;
    # the loss head runs in float32 (its gradient flows back in the model's dtype).
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _scatter_into(t: Tensor, index: Tensor, src: Tensor | float) -> Tensor:
    """``t.scatter_(-1, index, src)``: under ``torch.func.vmap`` it runs per example.

    functorch has no batching rule for in-place ``scatter_`` and warns that it
    falls back to a loop over the batch; the fallback is exact and the vmap
    path serves small models only, so the warning is silenced here.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="There is a performance drop")
        return t.scatter_(-1, index, src)


class _LogOdds(torch.autograd.Function):
    """``f = z_y - log Σ_{j≠y} exp(z_j)`` over the last dim, one vocabulary-sized tensor each way.

    Forward: ``e = exp(z - m)``, ``m`` the largest of the other classes'
    logits (the largest or second largest of ``z``: no vocabulary-sized
    mask), with ``e_y`` set to 0 in place, so the other classes are summed
    without ``e_y`` (no cancellation where ``p_y`` is close to 1; the sum is
    at least 1, so it never underflows however confident the label), and
    ``f = z_y - m - log Σ e``. Backward:
    ``df/dz = onehot(y) - softmax_{j≠y}(z)``, recomputed from the saved logits
    as ``exp(z - (z_y - f))`` (``z_y - f`` is the others' log-sum-exp) in one
    tensor, in place; where the graph is differentiated again
    (``create_graph``, ``torch.func``) it is built from out-of-place
    operations, so higher derivatives are exact.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(z: Tensor, index: Tensor) -> Tensor:  # type: ignore[override]
        best = z.topk(min(2, z.shape[-1]), dim=-1)
        first = best.values[..., :1]
        second = best.values[..., -1:]
        top = torch.where(best.indices[..., :1] == index, second, first)
        e = z - top
        e.exp_()
        _scatter_into(e, index, 0.0)
        others = top + e.sum(-1, keepdim=True).log()
        return (z.gather(-1, index) - others).squeeze(-1)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, Tensor], output: Tensor) -> None:
        z, index = inputs
        ctx.save_for_backward(z, index, output)
        ctx.mark_non_differentiable(index)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        z, index, f = ctx.saved_tensors
        shift = z.gather(-1, index) - f.unsqueeze(-1)
        g = grad.unsqueeze(-1)
        if torch.is_grad_enabled():
            return (-g * torch.exp(z - shift)).scatter(-1, index, g), None
        out = z - shift
        out.exp_().mul_(-g)
        return _scatter_into(out, index, g), None


def token_log_odds(logits: Tensor, labels: Tensor) -> Tensor:
    """``[B, T]`` log-odds ``f_t = log(p_t / (1 - p_t))`` of each label, 0 where ignored.

    Follows Hugging Face's shift: ``labels[:, t]`` is predicted from
    ``logits[:, t - 1]``, so position 0 is never predicted (its entry is 0).
    ``f_t = z_y - log Σ_{j≠y} exp(z_j)`` is computed without a vocabulary-sized
    mask or softmax copy: one ``exp`` pass forward and one backward (see
    :class:`_LogOdds`), where the masked ``logsumexp`` it replaces made about
    ten vocabulary-sized tensors per token.

    Args:
        logits: ``[B, T, V]`` next-token logits.
        labels: ``[B, T]`` token ids, ``-100`` where not predicted.

    Example:
        >>> logits = torch.zeros(1, 3, 4)          # uniform: p = 1/4, log-odds log(1/3)
        >>> token_log_odds(logits, torch.tensor([[5, 1, -100]]))
        tensor([[ 0.0000, -1.0986,  0.0000]])
    """
    z = _upcast_half(logits[:, :-1])
    target = labels[:, 1:]
    valid = target != IGNORE_INDEX
    safe = target.masked_fill(~valid, 0).long().unsqueeze(-1)
    odds = _LogOdds.apply(z, safe).masked_fill(~valid, 0.0)
    return torch.cat([torch.zeros_like(odds[:, :1]), odds], dim=1)


def token_one_minus_p(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """``[B, T]`` per-token out-to-loss terms ``1 - p_t`` (0 where ignored), detached."""
    target = labels[:, 1:]
    valid = target != IGNORE_INDEX
    z = _upcast_half(logits[:, :-1])
    if temperature != 1.0:
        z = z / temperature
    # p_y = exp(z_y - logsumexp z): one vocabulary-sized temporary, not a softmax copy.
    z_y = z.gather(-1, target.masked_fill(~valid, 0).long().unsqueeze(-1)).squeeze(-1)
    p = torch.exp(z_y - z.logsumexp(-1))
    q = (1 - p) * valid.to(p.dtype)
    return torch.cat([torch.zeros_like(q[:, :1]), q], dim=1).detach()


def _mean_over_tokens(q: Tensor, labels: Tensor) -> Tensor:
    """``[B, 1]``: the mean of ``q`` over each example's predicted tokens (0 if none)."""
    count = (labels[:, 1:] != IGNORE_INDEX).sum(1, keepdim=True).clamp(min=1)
    return q.sum(1, keepdim=True) / count.to(q.dtype)


@register_task("language_modeling", token_mask=lambda batch: batch[1])
class LanguageModelingModelOutput(SoftmaxModelOutput):
    """Causal LM output: summed per-token log-odds; ``Q`` the mean of ``1 - p_t`` (module docs).

    Batches: a dict with ``input_ids`` and optionally ``attention_mask`` and
    ``labels``, or a tuple ``(input_ids,)``, ``(input_ids, attention_mask)``
    or ``(input_ids, attention_mask, labels)``, all ``[B, T]``. Missing
    ``attention_mask`` means every token is real; missing ``labels`` means
    ``input_ids`` with padding (``attention_mask == 0``) set to ``-100``, as
    Hugging Face's language-modeling collator does. Labels are not shifted by
    the caller: the model's logits at ``t - 1`` predict ``labels[:, t]``.
    The model is called as ``model(input_ids=..., attention_mask=...)``
    (``use_cache=False`` where accepted) and must return ``[B, T, V]``
    logits or an object with ``.logits``.

    Args:
        temperature: softmax temperature of the out-to-loss term.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
        >>> model = LlamaForCausalLM(cfg).eval()
        >>> task = LanguageModelingModelOutput()
        >>> batch = task.as_batch({"input_ids": torch.tensor([[1, 5, 7, 2], [3, 4, 0, 0]]),
        ...                        "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])})
        >>> batch[2]
        tensor([[   1,    5,    7,    2],
                [   3,    4, -100, -100]])
        >>> task.get_batch_output(model, *batch).shape
        torch.Size([2])
    """

    #: Columns a ``datasets.Dataset`` may provide (``input_ids`` required).
    columns = ("input_ids", "attention_mask", "labels")

    @staticmethod
    def as_batch(batch: Mapping[str, Any] | Sequence[Any]) -> tuple[Tensor, Tensor, Tensor]:
        """The canonical ``(input_ids, attention_mask, labels)`` of a dict or tuple batch."""
        if isinstance(batch, Mapping):
            ids = _require_ids(batch, "language_modeling")
            mask, labels = _get(batch, "attention_mask"), _get(batch, "labels")
        else:
            items = _tuple_items(
                batch,
                "language_modeling",
                range(1, 4),
                "(input_ids,), (input_ids, attention_mask) or (input_ids, attention_mask, labels)",
            )
            items += [None] * (3 - len(items))
            ids = torch.as_tensor(items[0])
            mask, labels = items[1:]
        if ids.dim() != 2:
            raise BatchFormatError(
                f"`input_ids` must be [batch, seq_len], got shape {tuple(ids.shape)}."
            )
        for name, t in (("attention_mask", mask), ("labels", labels)):
            if t is not None and tuple(t.shape) != tuple(ids.shape):
                raise BatchFormatError(
                    f"`{name}` has shape {tuple(t.shape)} but `input_ids` has "
                    f"{tuple(ids.shape)}; they must match."
                )
        if mask is None:
            mask = torch.ones_like(ids)
        if labels is None:
            labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
        return ids, mask, labels

    @staticmethod
    def per_token_length(batch: Sequence[Tensor]) -> int:
        """Tokens per example in per-token rows: the sequence length."""
        return int(batch[0].shape[1])

    @staticmethod
    def per_token_batch(batch: Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """``B * T`` copies of a canonical batch, copy ``(b, t)`` keeping only label ``t``.

        The output of copy ``(b, t)`` is ``f_t`` of example ``b``, so its
        gradient is that token's: per-token features come from the ordinary
        per-example path.

        Example:
            >>> ids = torch.tensor([[4, 5, 6]])
            >>> LanguageModelingModelOutput.per_token_batch((ids, torch.ones_like(ids), ids))[2]
            tensor([[   4, -100, -100],
                    [-100,    5, -100],
                    [-100, -100,    6]])
        """
        ids, mask, labels = batch
        b, t = ids.shape
        eye = torch.eye(t, dtype=torch.bool, device=labels.device)
        per_token = labels.unsqueeze(1).masked_fill(~eye, IGNORE_INDEX).reshape(b * t, t)
        return (
            ids.repeat_interleave(t, dim=0),
            mask.repeat_interleave(t, dim=0),
            per_token,
        )

    @classmethod
    def outputs(  # type: ignore[override]
        cls, model: nn.Module, params: Any, batch: Sequence[Tensor]
    ) -> Tensor:
        """``[B]`` outputs ``Σ_t f_t`` of ``(input_ids, attention_mask, labels)``."""
        return token_log_odds(cls.batch_logits(model, params, batch), batch[2]).sum(1)

    @staticmethod
    def get_batch_output(
        model: nn.Module, input_ids: Tensor, attention_mask: Tensor, labels: Tensor
    ) -> Tensor:
        """``[B]`` outputs ``Σ_t f_t`` of one batched forward (used by layer hooks)."""
        batch = (input_ids, attention_mask, labels)
        return LanguageModelingModelOutput.outputs(model, None, batch)

    def out_to_loss_from_logits(self, logits: Tensor, labels: Tensor) -> Tensor:
        """``[B, 1]``: the mean over predicted tokens of ``1 - p_t``."""
        q = token_one_minus_p(logits.detach(), labels, self.loss_temperature)
        return _mean_over_tokens(q, labels)

    @staticmethod
    def batch_logits(model: nn.Module, params: Any, batch: Sequence[Tensor]) -> Any:
        """``[B, T, V]`` logits of ``model(input_ids=..., attention_mask=...)``."""
        return _call_model(model, params, {"input_ids": batch[0], "attention_mask": batch[1]})

    def q_from_output(self, output: Any, batch: Sequence[Tensor]) -> Tensor:
        """``[B, 1]`` out-to-loss terms (mean of ``1 - p_t`` over predicted tokens)."""
        return self.out_to_loss_from_logits(model_logits(output), batch[2])


@register_task_slot("check_batch", LanguageModelingModelOutput)
def language_model_check(model: nn.Module, batch: Sequence[Any]) -> None:
    """Refuse a transformers model without next-token logits, by its class and config.

    An encoder-decoder (``config.is_encoder_decoder``: T5, BART) has its
    own task, ``"seq2seq_lm"``; an encoder or a classification head (BERT,
    RoBERTa, ViT) has the classification tasks. Checked before any forward
    pass (a forward would fail with transformers' message about missing
    decoder inputs, or a tensor-shape error). Other modules are not judged.

    Raises:
        UnsupportedModelError: naming the model type and the task to use.
    """
    kind = hf_model_kind(model)
    if kind in (None, "causal_lm"):
        return
    if kind == "encoder_decoder":
        what = "an encoder-decoder (`config.is_encoder_decoder` is true)"
        instead = 'use task="seq2seq_lm" (batches with input_ids, attention_mask and labels)'
    else:
        what = "not a causal language model (no causal LM head)"
        instead = (
            'use a classification task: task="text_classification" for a sequence '
            'classifier, task="image_classification" for an image classifier'
        )
    raise UnsupportedModelError(
        f'task="language_modeling" attributes causal language models, got '
        f"{model_label(model)}: {what}. Supported: AutoModelForCausalLM-style models "
        "(`config.is_encoder_decoder` false and a causal LM head, e.g. GPT2LMHeadModel, "
        f"LlamaForCausalLM). For this model {instead}."
    )


# -- sequence-to-sequence language modeling ------------------------------------------
def target_log_likelihood(logits: Tensor, labels: Tensor, selected: Tensor | None = None) -> Tensor:
    """``[B, T]`` log-probabilities ``log p(y_t)`` of the labels (no shift), 0 where ignored.

    Args:
        logits: ``[B, T, V]`` decoder logits; ``logits[:, t]`` predicts ``labels[:, t]``.
        labels: ``[B, T]`` token ids, ``-100`` where not predicted.
        selected: ``[B, T]`` optional 0/1 mask of the positions to keep (per-token rows).

    Example:
        >>> target_log_likelihood(torch.zeros(1, 2, 4), torch.tensor([[3, -100]]))
        tensor([[-1.3863,  0.0000]])
    """
    valid = labels != IGNORE_INDEX
    if selected is not None:
        valid = valid & (selected != 0)
    logp = torch.log_softmax(_upcast_half(logits), dim=-1)
    picked = logp.gather(-1, labels.masked_fill(~valid, 0).long().unsqueeze(-1)).squeeze(-1)
    return picked.masked_fill(~valid, 0.0)


def _decoder_inputs(model: nn.Module, labels: Tensor) -> dict[str, Tensor]:
    """The decoder's inputs from the labels: the model's own right shift (start token, pad).

    Hugging Face encoder-decoders define ``prepare_decoder_input_ids_from_labels``;
    a model without it gets ``labels=`` and shifts them itself.
    """
    prepare = getattr(_wrapped(model), "prepare_decoder_input_ids_from_labels", None)
    if callable(prepare):
        return {"decoder_input_ids": prepare(labels=labels)}
    return {"labels": labels}


@register_task("seq2seq_lm")
class Seq2SeqLMModelOutput(BatchedModelOutput):
    """Encoder-decoder LM output: the summed log-likelihood of the target tokens; ``Q = 1``.

    ``f = Σ_t log p(y_t | x, y_<t)`` over the labels that are not ``-100``
    (module docs). Batches: a dict with ``input_ids`` and ``labels`` and
    optionally ``attention_mask`` and ``decoder_attention_mask``, or a tuple
    ``(input_ids, attention_mask, labels[, decoder_attention_mask])``; sources
    ``[B, S]``, targets ``[B, T]``. A missing ``attention_mask`` is all ones;
    a missing ``decoder_attention_mask`` is all ones too, which is what T5
    and BART assume without one (causal attention over the targets). The
    canonical tuple is ``(input_ids, attention_mask, labels,
    decoder_attention_mask)``, plus a fifth entry ``target_mask`` ``[B, T]``
    in per-token rows (:meth:`per_token_batch`), which selects the positions
    that enter ``f`` while the decoder still reads every label. The decoder's
    inputs are the labels shifted right by the model
    (``prepare_decoder_input_ids_from_labels``); the model is called as
    ``model(input_ids=..., attention_mask=..., decoder_input_ids=...,
    decoder_attention_mask=...)`` and must return ``[B, T, V]`` logits or an
    object with ``.logits``.

    Example:
        >>> batch = Seq2SeqLMModelOutput.as_batch(
        ...     {"input_ids": torch.tensor([[5, 6, 7]]), "labels": torch.tensor([[8, -100]])})
        >>> [tuple(t.shape) for t in batch]
        [(1, 3), (1, 3), (1, 2), (1, 2)]
    """

    #: Columns a ``datasets.Dataset`` may provide (``input_ids`` and ``labels`` required).
    columns = ("input_ids", "attention_mask", "labels", "decoder_attention_mask")
    #: Columns a dataset must have.
    required_columns = ("input_ids", "labels")

    @staticmethod
    def as_batch(batch: Mapping[str, Any] | Sequence[Any]) -> tuple[Tensor, ...]:
        """The canonical ``(input_ids, attention_mask, labels, decoder_attention_mask)``."""
        extra: list[Tensor] = []
        if isinstance(batch, Mapping):
            ids = _require_ids(batch, "seq2seq_lm")
            labels = _get(batch, "labels")
            if labels is None:
                raise BatchFormatError(
                    f"`batch` for seq2seq_lm has no 'labels' (the target token ids); it has keys "
                    f"{sorted(batch)}. Tokenize the targets with text_target=... ."
                )
            mask, dmask = _get(batch, "attention_mask"), _get(batch, "decoder_attention_mask")
        else:
            items = _tuple_items(
                batch,
                "seq2seq_lm",
                range(3, 6),
                "(input_ids, attention_mask, labels) or (input_ids, attention_mask, labels, "
                "decoder_attention_mask)",
            )
            ids, mask, labels = (torch.as_tensor(t) for t in items[:3])
            dmask = None if len(items) < 4 else items[3]
            extra = [torch.as_tensor(t) for t in items[4:]]
        if ids.dim() != 2 or labels.dim() != 2 or labels.shape[0] != ids.shape[0]:
            raise BatchFormatError(
                f"`input_ids` must be [batch, source_len] and `labels` [batch, target_len], got "
                f"shapes {tuple(ids.shape)} and {tuple(labels.shape)}."
            )
        mask = torch.ones_like(ids) if mask is None else mask
        dmask = torch.ones_like(labels) if dmask is None else dmask
        for name, t, like in (
            ("attention_mask", mask, ids),
            ("decoder_attention_mask", dmask, labels),
            *(("target_mask", t, labels) for t in extra),
        ):
            if tuple(t.shape) != tuple(like.shape):
                raise BatchFormatError(
                    f"`{name}` has shape {tuple(t.shape)} but must match {tuple(like.shape)}."
                )
        return (ids, mask, labels, dmask, *extra)

    @staticmethod
    def per_token_length(batch: Sequence[Tensor]) -> int:
        """Tokens per example in per-token rows: the target length."""
        return int(batch[2].shape[1])

    @staticmethod
    def per_token_batch(batch: Sequence[Tensor]) -> tuple[Tensor, ...]:
        """``B * T`` copies of a canonical batch, copy ``(b, t)`` selecting target token ``t``.

        Every copy keeps the whole target (the decoder reads it) and adds a
        ``target_mask`` with a single one at ``t``: the copy's output is
        ``log p(y_t)`` of example ``b``, so its gradient is that token's.

        Example:
            >>> ids, labels = torch.tensor([[4, 5]]), torch.tensor([[6, 7, -100]])
            >>> rows = Seq2SeqLMModelOutput.per_token_batch(
            ...     (ids, torch.ones_like(ids), labels, torch.ones_like(labels)))
            >>> rows[4]
            tensor([[1, 0, 0],
                    [0, 1, 0],
                    [0, 0, 1]])
        """
        ids, mask, labels, dmask = batch[:4]
        b, t = labels.shape
        eye = torch.eye(t, dtype=labels.dtype, device=labels.device)
        if len(batch) > 4:
            eye = batch[4].unsqueeze(1) * eye
        else:
            eye = eye.expand(b, t, t)
        return (
            ids.repeat_interleave(t, dim=0),
            mask.repeat_interleave(t, dim=0),
            labels.repeat_interleave(t, dim=0),
            dmask.repeat_interleave(t, dim=0),
            eye.reshape(b * t, t),
        )

    @staticmethod
    def outputs(model: nn.Module, params: Any, batch: Sequence[Tensor]) -> Tensor:
        """``[B]`` outputs ``Σ_t log p(y_t)`` of a canonical batch."""
        ids, mask, labels, dmask = batch[:4]
        kwargs: dict[str, Tensor | None] = {
            "input_ids": ids,
            "attention_mask": mask,
            "decoder_attention_mask": dmask,
            **_decoder_inputs(model, labels),
        }
        logits = _call_model(model, params, kwargs)
        selected = batch[4] if len(batch) > 4 else None
        return target_log_likelihood(logits, labels, selected).sum(1)

    @staticmethod
    def get_batch_output(model: nn.Module, *batch: Tensor) -> Tensor:
        """``[B]`` outputs of one batched forward (used by layer hooks)."""
        return Seq2SeqLMModelOutput.outputs(model, None, batch)

    def get_out_to_loss_grad(
        self,
        model: nn.Module,
        weights: dict[str, Tensor],
        buffers: dict[str, Tensor],
        batch: Iterable[Tensor],
    ) -> Tensor:
        """``[B, 1]`` ones: the training loss is ``-f``."""
        return _seq2seq_ones(tuple(batch))


def _seq2seq_ones(batch: Sequence[Tensor]) -> Tensor:
    return torch.ones(batch[0].shape[0], 1, dtype=torch.float32, device=batch[0].device)


@register_loss_grad_from_output(Seq2SeqLMModelOutput)
def seq2seq_loss_grad(task: Seq2SeqLMModelOutput, output: Any, batch: Sequence[Tensor]) -> Tensor:
    """``[B, 1]`` ones (``Q`` does not depend on the model's output)."""
    return _seq2seq_ones(batch)


# -- sequence classification ------------------------------------------------------
@register_task("text_classification")
class SequenceClassificationModelOutput(TextClassificationModelOutput):
    """TRAK's text-classification margin, also for models without ``token_type_ids``.

    Registered as ``"text_classification"``. Batches: TRAK's tuple
    ``(input_ids, token_type_ids, attention_mask, label)``, the tuple
    ``(input_ids, attention_mask, label)`` for tokenizers without token types
    (GPT-2, Llama), or a dict with ``input_ids``, ``attention_mask``,
    ``labels`` (or ``label``) and optionally ``token_type_ids``.
    ``token_type_ids`` reach the model only when its ``forward`` takes them.
    Output and out-to-loss term are TRAK's (margin, ``1 - p_y``).

    Example:
        >>> batch = SequenceClassificationModelOutput.as_batch(
        ...     {"input_ids": torch.ones(2, 3, dtype=torch.long), "labels": torch.tensor([0, 1])})
        >>> [tuple(t.shape) for t in batch]
        [(2, 3), (2, 3), (2,)]
    """

    columns = ("input_ids", "token_type_ids", "attention_mask", "labels", "label")

    @staticmethod
    def as_batch(batch: Mapping[str, Any] | Sequence[Any]) -> tuple[Tensor, ...]:
        """``(input_ids[, token_type_ids], attention_mask, labels)`` of a dict or tuple batch."""
        if not isinstance(batch, Mapping):
            items = _tuple_items(
                batch,
                "text_classification",
                range(3, 5),
                "(input_ids, token_type_ids, attention_mask, label) or (input_ids, "
                "attention_mask, label)",
            )
            return tuple(torch.as_tensor(t) for t in items)
        ids = _require_ids(batch, "text_classification")
        labels = _get(batch, "labels")
        if labels is None:
            labels = _get(batch, "label")
        if labels is None:
            raise BatchFormatError(
                f"`batch` for text_classification has no 'labels' (or 'label'); it has keys "
                f"{sorted(batch)}."
            )
        mask = _get(batch, "attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask
        types = _get(batch, "token_type_ids")
        return (ids, mask, labels) if types is None else (ids, types, mask, labels)

    @staticmethod
    def batch_logits(model: nn.Module, params: Any, batch: Sequence[Tensor]) -> Any:
        """Logits of ``model(input_ids=..., [token_type_ids=...,] attention_mask=...)``."""
        names = ("input_ids", "token_type_ids") if len(batch) == 4 else ("input_ids",)
        kw = {**dict(zip(names, batch)), "attention_mask": batch[-2]}
        return _call_model(model, params, kw)

    @staticmethod
    def get_batch_output(model: nn.Module, *batch: Tensor) -> Tensor:
        """``[B]`` margins of one batched forward (used by layer hooks)."""
        logits = SequenceClassificationModelOutput.batch_logits(model, None, batch)
        return margins(logits, batch[-1])


register_loss_grad_from_output(LanguageModelingModelOutput, SequenceClassificationModelOutput)(
    softmax_loss_grad
)
