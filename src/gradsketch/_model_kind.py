"""What kind of Hugging Face model a module is, judged by its class and config, never a forward.

``gradsketch.slt`` samples causal language models and the attribution task
``"language_modeling"`` reads a causal LM's logits; an encoder (BERT,
RoBERTa, ViT) or an encoder-decoder (T5, BART) given to them used to fail
deep inside a forward pass with a message about tensor shapes. Both callers
ask :func:`hf_model_kind` first and refuse with what the model is and what
serves it instead (:func:`model_label`, :func:`classifier_task`).

Ground floor: imports no gradsketch package and not transformers (the
classes are recognised by the names along their MRO).

Example:
    >>> import torch
    >>> hf_model_kind(torch.nn.Linear(2, 2)) is None
    True
"""

from __future__ import annotations

from typing import Any

__all__ = ["CAUSAL_HEADS", "classifier_task", "hf_model_kind", "model_label"]

#: Class-name endings of Hugging Face causal language-model heads
#: (``AutoModelForCausalLM``'s classes: ``LlamaForCausalLM``, ``GPT2LMHeadModel``...).
CAUSAL_HEADS = ("ForCausalLM", "LMHeadModel")


def _target(model: Any) -> Any:
    """The model a peft wrapper forwards to (``model`` itself otherwise)."""
    base = getattr(model, "get_base_model", None)
    return base() if callable(base) else model


def _is_transformers_model(cls: type) -> bool:
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
        for c in cls.__mro__
    )


def hf_model_kind(model: Any) -> str | None:
    """``"causal_lm"``, ``"encoder_decoder"`` or ``"other"``; None for a non-transformers module.

    ``"encoder_decoder"``: ``config.is_encoder_decoder`` is true (T5, BART).
    ``"causal_lm"``: a class along the MRO is a causal LM head (its name ends
    with one of :data:`CAUSAL_HEADS`). ``"other"``: every other transformers
    model (encoders such as BERT or ViT, classification heads, bare
    ``*Model`` backbones without an LM head).
    """
    target = _target(model)
    cls = type(target)
    if not _is_transformers_model(cls):
        return None
    if getattr(getattr(target, "config", None), "is_encoder_decoder", False):
        return "encoder_decoder"
    if any(c.__name__.endswith(CAUSAL_HEADS) for c in cls.__mro__):
        return "causal_lm"
    return "other"


def model_label(model: Any) -> str:
    """``"BertForSequenceClassification (config.model_type='bert')"``, for messages."""
    target = _target(model)
    model_type = getattr(getattr(target, "config", None), "model_type", None)
    return f"{type(target).__name__} (config.model_type={model_type!r})"


def classifier_task(model: Any) -> str | None:
    """The attribution task of a classification head (``"text_classification"``...), else None."""
    name = type(_target(model)).__name__
    if name.endswith("ForImageClassification"):
        return "image_classification"
    if name.endswith("ForSequenceClassification"):
        return "text_classification"
    return None
