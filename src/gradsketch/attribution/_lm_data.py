"""Batches in Hugging Face form: dicts from a ``DataLoader``, and ``datasets.Dataset`` inputs.

:func:`as_task_batch` turns a dict (or tuple) batch into the task's
canonical tuple; :func:`as_loader` turns a ``datasets.Dataset`` into an
in-order ``DataLoader`` over the task's columns (padding ragged rows on the
right), which ``TRAKer.featurize_loader`` can also shard across ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from gradsketch.attribution._lm import (
    IGNORE_INDEX,
    BatchFormatError,
    LanguageModelingModelOutput,
)

#: Right-padding value of each known column (``labels`` are ignored there).
PAD_VALUES = {
    "input_ids": 0,
    "attention_mask": 0,
    "token_type_ids": 0,
    "decoder_attention_mask": 0,
    "labels": IGNORE_INDEX,
}


def _dict_tasks() -> list[str]:
    """Registered task names whose class converts dict batches (has ``as_batch``)."""
    from gradsketch.attribution._modelout import TASK_TO_MODELOUT

    return sorted(
        n for n, cls in TASK_TO_MODELOUT.items() if callable(getattr(cls, "as_batch", None))
    )


def as_task_batch(task: Any, batch: Any) -> tuple[Tensor, ...]:
    """The task's canonical tuple for a dict or tuple ``batch``.

    Tasks that define ``as_batch`` (the Hugging Face tasks) convert dicts and
    fill defaults; for the others a dict is refused and a tuple kept.
    """
    convert = getattr(task, "as_batch", None)
    if callable(convert):
        return tuple(convert(batch))
    if isinstance(batch, Mapping):
        raise BatchFormatError(
            f"`batch` is a mapping with keys {sorted(batch)}, but task "
            f"{type(task).__name__} takes positional tuples; pass a tuple, or use a task "
            f"that reads dicts ({', '.join(repr(n) for n in _dict_tasks())})."
        )
    return tuple(batch)


def is_hf_dataset(obj: Any) -> bool:
    """Whether ``obj`` is a ``datasets.Dataset`` (checked without importing ``datasets``)."""
    return any(
        c.__module__.startswith("datasets.") and c.__name__ == "Dataset" for c in type(obj).__mro__
    )


def _stack(key: str, values: list[Any]) -> Tensor:
    tensors = [torch.as_tensor(v) for v in values]
    if all(t.shape == tensors[0].shape for t in tensors):
        return torch.stack(tensors)
    if key not in PAD_VALUES or any(t.dim() != 1 for t in tensors):
        raise BatchFormatError(
            f"column {key!r} has rows of different shapes {[tuple(t.shape) for t in tensors[:4]]}"
            f"; only {sorted(PAD_VALUES)} (1-D) are padded. Pad it when tokenizing."
        )
    length = max(t.shape[0] for t in tensors)
    out = torch.full((len(tensors), length), PAD_VALUES[key], dtype=tensors[0].dtype)
    for i, t in enumerate(tensors):
        out[i, : t.shape[0]] = t
    return out


def collate_rows(rows: Sequence[Mapping[str, Any]]) -> dict[str, Tensor]:
    """Stack dict rows into a dict batch, right-padding ragged token columns.

    A missing ``attention_mask`` is made of ones before padding, so padded
    positions are masked (and, as labels, ignored).

    Example:
        >>> batch = collate_rows([{"input_ids": [5, 6, 7]}, {"input_ids": [8]}])
        >>> batch["input_ids"], batch["attention_mask"]
        (tensor([[5, 6, 7],
                [8, 0, 0]]), tensor([[1, 1, 1],
                [1, 0, 0]]))
    """
    if not rows:
        raise BatchFormatError("`rows` is empty; a batch needs at least one row.")
    keys = list(rows[0])
    columns = {k: [r[k] for r in rows] for k in keys}
    if "input_ids" in columns and "attention_mask" not in columns:
        columns["attention_mask"] = [[1] * len(torch.as_tensor(v)) for v in columns["input_ids"]]
    return {k: _stack(k, v) for k, v in columns.items()}


def as_loader(data: Any, task: Any, batch_size: int) -> Iterable[Any]:
    """``data`` itself, or an in-order ``DataLoader`` over a ``datasets.Dataset``'s columns.

    Only the columns the task reads (its ``columns`` attribute) are kept, so
    text columns next to the token ids do no harm.

    Raises:
        BatchFormatError: the dataset has none of the task's columns.
    """
    if not is_hf_dataset(data):
        return data
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` must be a positive int, got {batch_size!r}.")
    wanted = getattr(task, "columns", None)
    if wanted is None:
        raise BatchFormatError(
            f"task {type(task).__name__} does not say which dataset columns it reads (no "
            "`columns` attribute); pass a DataLoader of its tuple batches instead."
        )
    present = [c for c in wanted if c in data.column_names]
    needed = [c for c in getattr(task, "required_columns", ("input_ids",)) if c in wanted]
    missing = [c for c in needed if c not in present]
    if missing:
        raise BatchFormatError(
            f"the dataset has columns {data.column_names} but task {type(task).__name__} needs "
            f"{', '.join(repr(c) for c in missing)} (and reads {list(wanted)}); tokenize it first."
        )
    view = data.select_columns(present).with_format(None)
    return DataLoader(view, batch_size=batch_size, shuffle=False, collate_fn=collate_rows)


def _vocab_size(model: Any) -> int | None:
    """Rows of the model's input embedding (``None`` when it has no HF embedding accessor)."""
    getter = getattr(model, "get_input_embeddings", None)
    if not callable(getter):
        return None
    try:
        emb = getter()
    except (NotImplementedError, AttributeError):
        return None
    size = getattr(emb, "num_embeddings", None)
    return int(size) if isinstance(size, int) else None


def check_token_batch(task: Any, model: Any, batch: Sequence[Tensor], what: str) -> None:
    """Refuse token ids outside the vocabulary and rows with no predicted token.

    Checked for the Hugging Face tasks (those with ``as_batch``), on the
    canonical batch: ``input_ids`` (and ``labels`` other than ``-100``) must lie
    in ``[0, vocab_size)`` of the model's input embedding; for the language
    tasks (whose third entry is ``labels``) each row must predict at least one
    token, else its gradient is zero and its scores silently all zero.

    Raises:
        BatchFormatError: naming the rows, the largest id and the vocabulary size.
    """
    if not callable(getattr(task, "as_batch", None)) or not batch:
        return
    vocab = _vocab_size(model)
    ids = batch[0]
    columns = [("input_ids", ids)]
    labels = batch[2] if len(batch) >= 3 and hasattr(task, "per_token_batch") else None
    if labels is not None:
        columns.append(("labels", labels))
    for name, t in columns:
        if t.dtype.is_floating_point or t.dtype == torch.bool or t.numel() == 0:
            continue
        valid = t != IGNORE_INDEX if name == "labels" else torch.ones_like(t, dtype=torch.bool)
        low = valid & (t < 0)
        high = valid & (t >= vocab) if vocab is not None else torch.zeros_like(low)
        bad = (low | high).reshape(t.shape[0], -1).any(dim=1)
        if bool(bad.any()):
            rows = torch.nonzero(bad).reshape(-1).tolist()
            values = t[valid]
            raise BatchFormatError(
                f"{what}: `{name}` of batch rows {rows[:10]} hold token ids outside "
                f"[0, {vocab if vocab is not None else 'vocab_size'}): smallest "
                f"{int(values.min())}, largest {int(values.max())}, but the model's vocabulary "
                f"has {vocab} tokens. Tokenize with the model's own tokenizer (or resize its "
                "embeddings), and mark ignored labels with -100."
            )
    if labels is None or labels.dim() != 2:
        return
    # Causal LMs predict labels[:, 1:] (Hugging Face's shift); seq2seq every label.
    shifted = isinstance(task, LanguageModelingModelOutput)
    predicted = labels[:, 1:] if shifted else labels
    empty = ~(predicted != IGNORE_INDEX).any(dim=1)
    if bool(empty.any()):
        rows = torch.nonzero(empty).reshape(-1).tolist()
        raise BatchFormatError(
            f"{what}: batch rows {rows[:10]} ({len(rows)} of {labels.shape[0]}) predict no token: "
            "every label (after the first, which a causal LM never predicts) is -100, so their "
            "gradient and scores would be all zero. Drop those rows, or keep at least one label "
            "per row that is not -100."
        )
