"""The five protocols that chose the per-layer methods' defaults, at any size.

``benchmarks/bench_influence_defaults.py`` scores K-FAC and EK-FAC on them
over dampings, curvatures and sample seeds. :func:`build_protocol` builds
one of :data:`PROTOCOLS` at :class:`Sizes`: the digits MLP, logistic
regression and CNN, the standard-library GPT-2 and a tiny BERT classifier
telling two standard-library files apart; each :class:`Protocol` holds its
independently seeded checkpoints, training and query batches, and the
outputs of models retrained on random halves (the LDS ground truth).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from gradsketch.demos.protocols._influence import (
    N_TARGETS,
    N_TRAIN,
    build,
    data,
    gpt2_ground_truth,
    gpt2_settings,
    ground_truth,
    lm_batches,
    lm_rows,
    lm_split,
    margin_of,
    train,
)
from gradsketch.demos.protocols._references import (
    digits_kronfluence,
    kronfluence_classifier_task,
    kronfluence_ensemble,
    lm_kronfluence,
)

PROTOCOLS = ("digits-mlp", "digits-logreg", "digits-cnn", "gpt2", "bert")

#: Retrained models per protocol (``--lds-models`` sets them all).
LDS_MODELS = {"digits-mlp": 40, "digits-logreg": 40, "digits-cnn": 30, "gpt2": 20, "bert": 30}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """A protocol's size: training rows, queries, retrained models, checkpoints."""

    num_train: int
    num_queries: int
    lds_models: int
    checkpoints: int = 3
    #: Training epochs of the text protocols (``None``: their own default).
    epochs: int | None = None


@dataclasses.dataclass
class Protocol:
    """Everything the grid needs of one protocol.

    Attributes:
        name: the protocol's name.
        task: the gradsketch task.
        model: the architecture (a TRAKer loads each checkpoint into a copy).
        checkpoints: the trained checkpoints' state dicts.
        train_batches: the training rows in the task's batch form, in order.
        query_batches: the queries likewise.
        masks: ``[lds_models, n]`` the retrained models' subsets.
        outputs: ``[lds_models, m]`` their measurements of the queries.
        kronfluence: ``(tmp, dampings) -> {damping: [n, m] scores}``,
            positive = helps the query.
        hooks: TRAK through ``HookGradientComputer`` (Hugging Face models).
        info: facts for the protocol's header line.
    """

    name: str
    task: str
    model: nn.Module
    checkpoints: list[dict[str, Tensor]]
    train_batches: list[tuple[Tensor, ...]]
    query_batches: list[tuple[Tensor, ...]]
    masks: np.ndarray
    outputs: np.ndarray
    kronfluence: Callable[[str, tuple[float | None, ...]], dict[float | None, np.ndarray]]
    hooks: bool = False
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def num_train(self) -> int:
        return sum(int(b[0].shape[0]) for b in self.train_batches)

    @property
    def lds_models(self) -> int:
        return int(self.masks.shape[0])


def _state(model: nn.Module) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- digits protocols ----------------------------------------------------------------------
def build_logreg(seed: int) -> nn.Sequential:
    """Multinomial logistic regression on the 64 pixels."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 10))


def build_small_cnn(seed: int) -> nn.Sequential:
    """The demos' digits CNN with 8 and 16 channels."""
    from gradsketch.demos._digits import build_cnn

    return build_cnn(channels=8, seed=seed)


DIGITS_BUILDERS: dict[str, Callable[[int], nn.Module]] = {
    "digits-mlp": build,
    "digits-logreg": build_logreg,
    "digits-cnn": build_small_cnn,
}


def digits_protocol(name: str, sizes: Sizes) -> Protocol:
    """A digits protocol of ``bench_influence.py`` with the architecture ``name`` names."""
    builder = DIGITS_BUILDERS[name]
    x, y, xt, yt = data(sizes.num_train, sizes.num_queries)
    masks, outputs = ground_truth(x, y, xt, yt, sizes.lds_models, builder)
    models = [train(x, y, seed, builder) for seed in range(sizes.checkpoints)]
    batch = 250
    return Protocol(
        name=name,
        task="image_classification",
        model=builder(0),
        checkpoints=[_state(m) for m in models],
        train_batches=[(x[i : i + batch], y[i : i + batch]) for i in range(0, len(x), batch)],
        query_batches=[(xt, yt)],
        masks=masks,
        outputs=outputs,
        kronfluence=lambda tmp, dampings: digits_kronfluence(
            models, x, y, xt, yt, tmp, "ekfac", dampings
        ),
        info={"measurement": "margin", "parameters": _parameters(models[0])},
    )


def _parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# -- GPT-2 -----------------------------------------------------------------------------
def gpt2_protocol(sizes: Sizes, cache_dir: str | None = None) -> Protocol:
    """``bench_influence.py``'s GPT-2 protocol at ``sizes``."""
    from gradsketch.demos.lm import train_lm

    s = dataclasses.replace(
        gpt2_settings(False, sizes.lds_models),
        num_train=sizes.num_train,
        num_queries=sizes.num_queries,
        **({} if sizes.epochs is None else {"epochs": sizes.epochs}),
    )
    train_ids, query_ids = lm_split(s)
    masks, outputs, cached = gpt2_ground_truth(s, train_ids, query_ids, cache_dir)
    models = [train_lm(train_ids, s, seed=s.seed + 1 + c)[0] for c in range(sizes.checkpoints)]
    return Protocol(
        name="gpt2",
        task="language_modeling",
        model=copy.deepcopy(models[0]),
        checkpoints=[_state(m) for m in models],
        train_batches=lm_batches(train_ids, 64),
        query_batches=[lm_rows(query_ids)],
        masks=masks,
        outputs=outputs,
        kronfluence=lambda tmp, dampings: lm_kronfluence(
            models, train_ids, query_ids, tmp, "ekfac", dampings
        ),
        hooks=True,
        info={
            "measurement": "summed log-likelihood",
            "parameters": _parameters(models[0]),
            "ground_truth_cached": cached,
        },
    )


# -- BERT ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BertSettings:
    """The BERT protocol: which module a chunk of standard-library source comes from."""

    modules: tuple[str, ...] = ("textwrap.py", "base64.py")
    chunk_len: int = 32
    num_train: int = 512
    num_queries: int = 64
    width: int = 64
    layers: int = 2
    heads: int = 2
    epochs: int = 6
    batch_size: int = 32
    lr: float = 2e-3
    weight_decay: float = 0.01
    seed: int = 0


#: The [CLS] id: the byte values are 0..255.
CLS_ID = 256


def bert_data(s: BertSettings) -> tuple[tuple[Tensor, Tensor, Tensor], tuple[Tensor, ...]]:
    """``(input_ids, attention_mask, labels)`` of the training and query chunks.

    Chunks of every module in ``s.modules`` (non-overlapping, from each file's
    start), split by a seeded permutation; the label is the module's index,
    the input ``[CLS]`` followed by the chunk's bytes.
    """
    from gradsketch.demos._lm_corpus import load_corpus, split_chunks

    corpus = load_corpus(s.modules, chunk_len=s.chunk_len)
    labels = torch.tensor([s.modules.index(c.source) for c in corpus.chunks])
    ids = torch.cat([torch.full((len(corpus), 1), CLS_ID), corpus.token_ids()], dim=1)
    train, query = split_chunks(len(corpus), s.num_train, s.num_queries, seed=s.seed)

    def rows(idx: np.ndarray) -> tuple[Tensor, Tensor, Tensor]:
        t = torch.as_tensor(idx)
        return ids[t], torch.ones_like(ids[t]), labels[t]

    return rows(train), rows(query)


def build_bert(s: BertSettings, seed: int) -> nn.Module:
    """A tiny ``BertForSequenceClassification`` (no dropout), initialised from ``seed``."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config_class: Any = BertConfig  # its keywords are typed by a kwargs catch-all
    config = config_class(
        vocab_size=CLS_ID + 1,
        hidden_size=s.width,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        intermediate_size=2 * s.width,
        max_position_embeddings=s.chunk_len + 1,
        type_vocab_size=1,
        num_labels=len(s.modules),
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForSequenceClassification(config).eval()


def _bert_forward(model: nn.Module, batch) -> tuple[Tensor, Tensor]:
    ids, mask, labels = batch
    return model(input_ids=ids, attention_mask=mask).logits, labels


def train_bert(s: BertSettings, rows: tuple[Tensor, ...], seed: int) -> nn.Module:
    """AdamW on the cross-entropy, learning rate decaying linearly to 0; in eval mode."""
    model = build_bert(s, seed).train()
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=s.weight_decay)
    n = int(rows[0].shape[0])
    total = s.epochs * math.ceil(n / s.batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 - step / total)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(s.epochs):
        order = torch.randperm(n, generator=gen)
        for start in range(0, n, s.batch_size):
            idx = order[start : start + s.batch_size]
            logits, labels = _bert_forward(model, tuple(t[idx] for t in rows))
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(logits, labels).backward()
            opt.step()
            sched.step()
    return model.eval()


def bert_margins(model: nn.Module, rows: tuple[Tensor, ...]) -> np.ndarray:
    with torch.no_grad():
        return margin_of(*_bert_forward(model, rows)).numpy()


def bert_protocol(sizes: Sizes) -> Protocol:
    """The BERT protocol at ``sizes`` (see the module docstring)."""
    from torch.utils.data import TensorDataset

    from gradsketch.attribution import lds_ground_truth

    s = BertSettings(num_train=sizes.num_train, num_queries=sizes.num_queries)
    if sizes.epochs is not None:
        s = dataclasses.replace(s, epochs=sizes.epochs)
    train_rows, query_rows = bert_data(s)
    truth = lds_ground_truth(
        lambda idx, seed: train_bert(s, tuple(t[torch.as_tensor(idx)] for t in train_rows), seed),
        lambda model: bert_margins(model, query_rows),
        s.num_train,
        sizes.lds_models,
        seed=10_000,
        progress=False,
    )
    models = [train_bert(s, train_rows, seed) for seed in range(sizes.checkpoints)]
    with torch.no_grad():
        logits, labels = _bert_forward(models[0], query_rows)
    batch = 64
    return Protocol(
        name="bert",
        task="text_classification",
        model=copy.deepcopy(models[0]),
        checkpoints=[_state(m) for m in models],
        train_batches=[
            tuple(t[i : i + batch] for t in train_rows) for i in range(0, s.num_train, batch)
        ],
        query_batches=[query_rows],
        masks=truth.subset_masks,
        outputs=truth.target_outputs,
        kronfluence=lambda tmp, dampings: kronfluence_ensemble(
            models,
            kronfluence_classifier_task(_bert_forward),
            TensorDataset(*train_rows),
            TensorDataset(*query_rows),
            tmp,
            strategy="ekfac",
            dampings=dampings,
            sign=-1.0,
            train_batch=batch,
        ),
        hooks=True,
        info={
            "measurement": "margin",
            "parameters": _parameters(models[0]),
            "modules": list(s.modules),
            "query_accuracy": float((logits.argmax(1) == labels).float().mean()),
        },
    )


def build_protocol(name: str, sizes: Sizes, cache_dir: str | None = None) -> Protocol:
    """The protocol ``name`` (one of :data:`PROTOCOLS`) at ``sizes``."""
    if name in DIGITS_BUILDERS:
        return digits_protocol(name, sizes)
    if name == "gpt2":
        return gpt2_protocol(sizes, cache_dir)
    if name == "bert":
        return bert_protocol(sizes)
    raise ValueError(f"unknown protocol {name!r}; pick from {PROTOCOLS}.")


def protocol_sizes(name: str, quick: bool, lds_models: int | None, checkpoints: int) -> Sizes:
    """Full or ``--quick`` sizes of protocol ``name`` (quick: toy sizes, one checkpoint)."""
    if quick:
        small = {"gpt2": (32, 8), "bert": (32, 8)}.get(name, (100, 10))
        return Sizes(*small, lds_models=3, checkpoints=1, epochs=1)
    full = {"gpt2": (512, 64), "bert": (512, 64)}.get(name, (N_TRAIN, N_TARGETS))
    return Sizes(*full, lds_models=lds_models or LDS_MODELS[name], checkpoints=checkpoints)


# -- the grid --------------------------------------------------------------------------
