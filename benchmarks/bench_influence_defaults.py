"""Influence defaults: LDS of K-FAC / EK-FAC over damping x curvature on five protocols.

Run ``python benchmarks/bench_influence_defaults.py`` (``--quick``: a smoke
run of every protocol at toy sizes, one checkpoint, one sample seed, three
dampings, without Kronfluence, whose path the ``bench`` test
``tests/attribution/test_bench_influence_defaults.py`` runs; ``--protocols
digits-mlp,bert`` to pick; ``--seeds``, ``--absolute``, ``--pooled-multiples``,
``--fractions`` replace a part of the grid, ``--no-baselines`` and
``--no-kronfluence`` drop rows; ``--summary a.jsonl [b.jsonl ...]`` turns the
lines of one or more runs into the markdown tables of RESULTS.md and a
ranking of the settings across protocols). Prints one JSON line per
(protocol, method, curvature, damping, seed): its LDS, its seconds and the
CPU. Needs Kronfluence 1.0.1 for its rows (``make bench-setup``); without it
they are skipped with a note. Every training is seeded and runs on one
thread, so a second run rebuilds the same checkpoints and ground truths.

Protocols (each: ``--checkpoints`` independently seeded trainings on all
training rows, scores averaged over them; ground truth from models
retrained on random halves, LDS the mean Spearman correlation over queries):

- ``digits-mlp``: ``bench_influence.py``'s digits protocol (MLP 64-32-10, 1,000
  training rows of ``load_digits``, 100 test targets, TRAK's margin).
- ``digits-logreg``: the same rows and targets, a logistic regression
  (one ``Linear(64, 10)``).
- ``digits-cnn``: the same rows and targets, the demos' small CNN on the 8x8
  images (``build_cnn(channels=8)``: two 3x3 convolutions, pooling, a linear head).
- ``gpt2``: ``bench_influence.py``'s GPT-2 protocol (the LM demo's 2-layer
  GPT-2 on 512 chunks of 64 bytes of the standard library, 64 query chunks,
  the summed log-likelihood; ground truth cached in ``--cache-dir``).
- ``bert``: a tiny ``BertForSequenceClassification`` built from a config
  (2 layers, width 64, byte vocabulary plus a [CLS] id, no dropout) telling
  which of two standard-library modules (``textwrap.py``, ``base64.py``) a
  32-byte chunk comes from: 512 training chunks, 64 query chunks, task
  ``"text_classification"``, TRAK's margin.

Grid: ``TRAKer(method=m, curvature=c, sample_seed=s)`` for m in {``kfac``,
``ekfac``} and c in {``"loss"``, ``"sampled"`` (sample seeds 0, 1, 2)}; each is
featurized once and scored at every damping (the damping only enters the
solve, so a TRAKer re-opened on the same store with another ``lambda_reg``
scores the same features): the absolute values 1e-8 (Kronfluence 1.0.1's
default), 1e-3 and 1e-2; ``m x λ̄`` for m in {0.01, 0.1, 1, 10, 100}, where
``λ̄`` is 0.1 x the mean eigenvalue of the protocol's EK-FAC empirical
Fisher over all layers (the value ``"auto"`` would take if the model were
one layer; the same absolute numbers for every row of a protocol); and
``"auto"`` at fractions {0.001, 0.01, 0.1, 0.3, 1, 10} of each layer's own mean
eigenvalue (0.3 is the library's ``"auto"``, chosen by this grid; the others set the library's
fraction for the duration of the solve, :func:`auto_fraction`). Baselines:
``identity`` and TRAK (k = 512, ``lambda_reg="auto"``). Reference:
Kronfluence 1.0.1 EK-FAC with its defaults (sampled true Fisher) fitted
once per checkpoint and scored at its default damping 1e-8 and at its
heuristic (``damping_factor=None``, 0.1 x each module's mean eigenvalue).

Seconds: a grid row's is the featurize + finalize + target time of its
configuration (shared by its dampings) plus its own scoring; Kronfluence's
covers its fit and both scorings. Lines carry the 1-minute load average.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_influence as bi
from _common import emit, machine_info, setup_torch, time_once

PROTOCOLS = ("digits-mlp", "digits-logreg", "digits-cnn", "gpt2", "bert")
METHODS = ("ekfac", "kfac")


@dataclasses.dataclass(frozen=True)
class Grid:
    """The settings every configuration is scored at."""

    #: Seeds of ``curvature="sampled"``.
    seeds: tuple[int, ...] = (0, 1, 2)
    #: Absolute dampings: Kronfluence 1.0.1's default and two round numbers.
    absolute: tuple[float, ...] = (1e-8, 1e-3, 1e-2)
    #: Multiples of the protocol's pooled "auto" value λ̄ (4 decades around it).
    pooled_multiples: tuple[float, ...] = (0.01, 0.1, 1.0, 10.0, 100.0)
    #: Fractions of each layer's mean eigenvalue (0.3 is the library's "auto").
    fractions: tuple[float, ...] = (0.001, 0.01, 0.1, 0.3, 1.0, 10.0)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Grid:
        """The default grid (``--quick``: :data:`QUICK_GRID`) with the fields given on the CLI."""
        base = QUICK_GRID if args.quick else cls()
        given = {}
        for field in ("seeds", "absolute", "pooled_multiples", "fractions"):
            text = getattr(args, field)
            if text is not None:
                kind = int if field == "seeds" else float
                given[field] = tuple(kind(v) for v in text.split(",") if v.strip())
        return dataclasses.replace(base, **given)


#: ``--quick``: one sample seed and one damping of each kind.
QUICK_GRID = Grid(seeds=(0,), absolute=(1e-8,), pooled_multiples=(1.0,), fractions=(0.3,))
#: Kronfluence's damping_factor: its default, and None for its heuristic.
KRONFLUENCE_DAMPINGS = (bi.KRONFLUENCE_DEFAULT_DAMPING, None)
#: Retrained models per protocol (``--lds-models`` sets them all).
LDS_MODELS = {"digits-mlp": 40, "digits-logreg": 40, "digits-cnn": 30, "gpt2": 20, "bert": 30}
BENCH = "influence_defaults"


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
    "digits-mlp": bi.build,
    "digits-logreg": build_logreg,
    "digits-cnn": build_small_cnn,
}


def digits_protocol(name: str, sizes: Sizes) -> Protocol:
    """A digits protocol of ``bench_influence.py`` with the architecture ``name`` names."""
    builder = DIGITS_BUILDERS[name]
    x, y, xt, yt = bi.data(sizes.num_train, sizes.num_queries)
    masks, outputs = bi.ground_truth(x, y, xt, yt, sizes.lds_models, builder)
    models = [bi.train(x, y, seed, builder) for seed in range(sizes.checkpoints)]
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
        kronfluence=lambda tmp, dampings: bi.digits_kronfluence(
            models, x, y, xt, yt, tmp, "ekfac", dampings
        ),
        info={"measurement": "margin", "parameters": _parameters(models[0])},
    )


def _parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# -- GPT-2 -----------------------------------------------------------------------------
def gpt2_protocol(sizes: Sizes, cache_dir: str | None = None) -> Protocol:
    """``bench_influence.py``'s GPT-2 protocol at ``sizes``."""
    from bench_lm import _split

    import gradsketch.attribution._lm  # noqa: F401  (registers "language_modeling")
    from gradsketch.demos.lm import train_lm

    s = dataclasses.replace(
        bi.gpt2_settings(False, sizes.lds_models),
        num_train=sizes.num_train,
        num_queries=sizes.num_queries,
        **({} if sizes.epochs is None else {"epochs": sizes.epochs}),
    )
    train_ids, query_ids = _split(s)
    masks, outputs, cached = bi.gpt2_ground_truth(s, train_ids, query_ids, cache_dir)
    models = [train_lm(train_ids, s, seed=s.seed + 1 + c)[0] for c in range(sizes.checkpoints)]
    return Protocol(
        name="gpt2",
        task="language_modeling",
        model=copy.deepcopy(models[0]),
        checkpoints=[_state(m) for m in models],
        train_batches=bi.lm_batches(train_ids, 64),
        query_batches=[bi._lm_rows(query_ids)],
        masks=masks,
        outputs=outputs,
        kronfluence=lambda tmp, dampings: bi.lm_kronfluence(
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
    config = BertConfig(
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
        return bi.margin_of(*_bert_forward(model, rows)).numpy()


def bert_protocol(sizes: Sizes) -> Protocol:
    """The BERT protocol at ``sizes`` (see the module docstring)."""
    from torch.utils.data import TensorDataset

    import gradsketch.attribution._lm  # noqa: F401  (registers "text_classification")
    from gradsketch.attribution import lds_ground_truth

    s = BertSettings(
        num_train=sizes.num_train,
        num_queries=sizes.num_queries,
        **({} if sizes.epochs is None else {"epochs": sizes.epochs}),
    )
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
        kronfluence=lambda tmp, dampings: bi.kronfluence_ensemble(
            models,
            bi.kronfluence_classifier_task(_bert_forward),
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
    full = {"gpt2": (512, 64), "bert": (512, 64)}.get(name, (bi.N_TRAIN, bi.N_TARGETS))
    return Sizes(*full, lds_models=lds_models or LDS_MODELS[name], checkpoints=checkpoints)


# -- the grid --------------------------------------------------------------------------
@contextlib.contextmanager
def auto_fraction(fraction: float | None) -> Iterator[None]:
    """Per-layer methods' ``lambda_reg="auto"`` at ``fraction`` x each layer's mean eigenvalue.

    Sets the library's fraction (``LAYER_AUTO_DAMPING_FRACTION``, 0.3) as read by
    the per-layer solve, and restores it; ``None`` leaves it alone. TRAK's
    own ``"auto"`` is untouched.
    """
    from gradsketch.attribution import _kfac

    if fraction is None:
        yield
        return
    before = _kfac.LAYER_AUTO_DAMPING_FRACTION
    _kfac.LAYER_AUTO_DAMPING_FRACTION = float(fraction)
    try:
        yield
    finally:
        _kfac.LAYER_AUTO_DAMPING_FRACTION = before


def open_traker(p: Protocol, save_dir: str, **kwargs: Any) -> Any:
    """A TRAKer on ``p``'s model and task with a store in ``save_dir`` (new or re-opened)."""
    from gradsketch.attribution import TRAKer

    return TRAKer(
        copy.deepcopy(p.model),
        p.task,
        p.num_train,
        save_dir=save_dir,
        device="cpu",
        logging_level=bi.QUIET,
        progress=False,
        **kwargs,
    )


def fit(p: Protocol, save_dir: str, **kwargs: Any) -> Any:
    """Featurize and finalize every checkpoint, store the queries' features ("lds"); scores.

    The scores at the TRAKer's own damping are computed once here: that
    also writes everything the store holds for re-opened TRAKers.
    """
    traker = open_traker(p, save_dir, **kwargs)
    bi.featurize_all(traker, p.checkpoints, p.train_batches)
    bi.score_targets(traker, p.checkpoints, p.query_batches)
    return traker, np.array(traker.finalize_scores("lds"), dtype=np.float64)


def rescore(p: Protocol, save_dir: str, damping: float | str, fraction: float | None, **kwargs):
    """The stored experiment's ``[n, m]`` scores at another damping (features reused)."""
    traker = open_traker(p, save_dir, lambda_reg=damping, **kwargs)
    with auto_fraction(fraction):
        return np.array(traker.finalize_scores("lds"), dtype=np.float64)


def pooled_auto(traker: Any, checkpoints: int) -> float:
    """0.1 x the mean of all layers' eigenvalues, averaged over checkpoints (λ̄)."""
    means = []
    for model_id in range(checkpoints):
        values = torch.cat(
            [v.double().flatten() for _, _, v in traker.preconditioner(model_id).eigen]
        )
        means.append(float(values.mean()))
    return 0.1 * float(np.mean(means))


def damping_grid(grid: Grid, pooled: float) -> list[dict[str, Any]]:
    """The dampings each configuration is scored at (``damping``, and how it was chosen)."""
    out: list[dict[str, Any]] = [{"damping": d} for d in grid.absolute]
    out += [{"damping": m * pooled, "pooled_multiple": m} for m in grid.pooled_multiples]
    out += [{"damping": "auto", "fraction": f} for f in grid.fractions]
    return out


def _record(p: Protocol, scores: np.ndarray, **fields: Any) -> dict[str, Any]:
    from gradsketch.attribution import linear_datamodeling_score

    return {
        "bench": BENCH,
        "protocol": p.name,
        **fields,
        "lds": float(linear_datamodeling_score(scores, p.masks, p.outputs)),
        "checkpoints": len(p.checkpoints),
        "lds_models": p.lds_models,
        "loadavg_1min": os.getloadavg()[0],
    }


def grid_rows(
    p: Protocol,
    tmp: str,
    method: str,
    curvature: str,
    seed: int | None,
    pooled: float | None,
    grid: Grid = Grid(),
) -> tuple[list[dict[str, Any]], float]:
    """One configuration featurized once and scored at every damping; its rows and λ̄.

    ``pooled`` (λ̄) is computed from this configuration when ``None``.
    """
    save_dir = tempfile.mkdtemp(dir=tmp)
    options = {"method": method, "curvature": curvature, "sample_seed": seed}
    fit_s, (traker, _) = time_once(lambda: fit(p, save_dir, lambda_reg="auto", **options))
    if pooled is None:
        pooled = pooled_auto(traker, len(p.checkpoints))
    rows = []
    for entry in damping_grid(grid, pooled):
        score_s, scores = time_once(
            lambda e=entry: rescore(p, save_dir, e["damping"], e.get("fraction"), **options)
        )
        rows.append(
            _record(
                p,
                scores,
                method=method,
                curvature=curvature,
                seed=seed,
                **entry,
                seconds=fit_s + score_s,
                fit_seconds=fit_s,
            )
        )
    shutil.rmtree(save_dir, ignore_errors=True)
    return rows, pooled


def baseline_rows(p: Protocol, tmp: str) -> list[dict[str, Any]]:
    """Identity and TRAK (k = 512, ``"auto"``) on the same checkpoints."""
    from gradsketch.attribution import HookGradientComputer

    trak: dict[str, Any] = {"method": "trak", "proj_dim": 512, "lambda_reg": "auto"}
    if p.hooks:
        trak["gradient_computer"] = HookGradientComputer
    rows = []
    for options in ({"method": "identity"}, trak):
        start = time.perf_counter()
        _, scores = fit(p, tempfile.mkdtemp(dir=tmp), **options)
        damping = options.get("lambda_reg")
        row = _record(p, scores, method=options["method"], curvature="loss", damping=damping)
        rows.append({**row, "seconds": time.perf_counter() - start})
    return rows


def kronfluence_rows(p: Protocol, tmp: str) -> list[dict[str, Any]]:
    """Kronfluence 1.0.1 EK-FAC (its defaults) at its default damping and at its heuristic."""
    try:
        import kronfluence
    except ImportError as err:
        return [
            {"bench": BENCH, "protocol": p.name, "method": "kronfluence ekfac", "skipped": str(err)}
        ]
    seconds, scores = time_once(lambda: p.kronfluence(tmp, KRONFLUENCE_DAMPINGS))
    return [
        {
            **_record(
                p,
                scores[d],
                method="kronfluence ekfac",
                curvature="sampled (kronfluence)",
                damping="heuristic" if d is None else d,
            ),
            "seconds": seconds,
            "kronfluence": kronfluence.__version__,
        }
        for d in KRONFLUENCE_DAMPINGS
    ]


def run_protocol(
    p: Protocol, grid: Grid = Grid(), kronfluence: bool = True, baselines: bool = True
) -> list[dict[str, Any]]:
    """Every row of the grid on ``p``, emitted as it is measured."""
    out: list[dict[str, Any]] = []

    def put(rows: list[dict[str, Any]]) -> None:
        for row in rows:
            emit(row)
        out.extend(rows)

    with tempfile.TemporaryDirectory() as tmp:
        pooled = None
        for method in METHODS:  # EK-FAC's empirical Fisher first: it fixes λ̄
            for curvature, seed in [("loss", None)] + [("sampled", s) for s in grid.seeds]:
                rows, pooled = grid_rows(p, tmp, method, curvature, seed, pooled, grid)
                put(rows)
        if baselines:
            put(baseline_rows(p, tmp))
        if kronfluence:
            put(kronfluence_rows(p, tmp))
    return out


# -- tables ----------------------------------------------------------------------------
def _damping_key(row: dict[str, Any]) -> tuple[int, float]:
    if "pooled_multiple" in row:
        return 1, row["pooled_multiple"]
    if "fraction" in row:
        return 2, row["fraction"]
    return 0, row["damping"]


def _kfac_default_fraction() -> float:
    from gradsketch.attribution import _kfac

    return _kfac.LAYER_AUTO_DAMPING_FRACTION


def _damping_label(row: dict[str, Any]) -> str:
    if "pooled_multiple" in row:
        return f"{row['pooled_multiple']:g} λ̄ = {row['damping']:.2g}"
    if "fraction" in row:
        label = f'`"auto"` at {row["fraction"]:g}'
        default = row["fraction"] == _kfac_default_fraction()
        return label + (" (the default)" if default else "")
    return f"{row['damping']:g}"


def _cell(values: list[float]) -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{np.mean(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def dedupe(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of several runs: the first of each setting, and a warning where runs disagree."""
    seen: dict[tuple[Any, ...], float] = {}
    out = []
    for r in rows:
        if r.get("bench") == BENCH and "lds" in r:
            how = _damping_key(r) if r["method"] in METHODS else str(r.get("damping"))
            key = (r["protocol"], r["method"], r.get("curvature"), r.get("seed"), how)
            if key in seen:
                if abs(seen[key] - r["lds"]) > 1e-3:
                    print(f"runs disagree at {key}: {seen[key]} and {r['lds']}", file=sys.stderr)
                continue
            seen[key] = r["lds"]
        out.append(r)
    return out


def tables(rows: list[dict[str, Any]]) -> str:
    """Markdown: per protocol, damping x (method, curvature) LDS, then the references."""
    rows = dedupe(rows)
    lines: list[str] = []
    grid = [r for r in rows if r.get("bench") == BENCH and r.get("method") in METHODS]
    for name in dict.fromkeys(r["protocol"] for r in rows if r.get("bench") == BENCH):
        mine = [r for r in grid if r["protocol"] == name]
        if not mine:
            continue
        cols = [(m, c) for m in ("kfac", "ekfac") for c in ("loss", "sampled")]
        head = " | ".join(f"{m.upper().replace('FAC', '-FAC')} {c}" for m, c in cols)
        lines += [f"**{name}**", "", f"| damping | {head} |", "|---" * (len(cols) + 1) + "|"]
        for key in sorted({_damping_key(r) for r in mine}):
            at = [r for r in mine if _damping_key(r) == key]
            cells = [
                _cell([r["lds"] for r in at if (r["method"], r["curvature"]) == mc]) for mc in cols
            ]
            lines.append(f"| {_damping_label(at[0])} | " + " | ".join(cells) + " |")
        seconds = [
            next((f"{r['seconds']:.1f}" for r in mine if (r["method"], r["curvature"]) == mc), "–")
            for mc in cols
        ]
        lines.append("| seconds: fit + one scoring (seed 0) | " + " | ".join(seconds) + " |")
        lines.append("")
        others = [r for r in rows if r.get("protocol") == name and r.get("method") not in METHODS]
        for r in others:
            if "lds" in r:
                lines.append(
                    f"- {r['method']} (damping {r.get('damping')}): {r['lds']:.3f}, "
                    f"{r['seconds']:.1f} s"
                )
        lines.append("")
    return "\n".join([*lines, ranking(rows)])


def ranking(rows: list[dict[str, Any]], top: int = 12) -> str:
    """Markdown: the grid's settings ranked by their mean regret across protocols.

    A setting is (method, curvature, damping as chosen: absolute, multiple
    of λ̄, or "auto" fraction); its LDS on a protocol is the mean over sample
    seeds; its regret there is the protocol's best grid LDS minus its own.
    Only protocols that have every setting count.
    """
    grid = [r for r in dedupe(rows) if r.get("bench") == BENCH and r.get("method") in METHODS]
    per: dict[tuple[Any, ...], dict[str, list[float]]] = {}
    for r in grid:
        key = (r["method"], r["curvature"], _damping_key(r))
        per.setdefault(key, {}).setdefault(r["protocol"], []).append(r["lds"])
    protocols = sorted({p for v in per.values() for p in v})
    protocols = [p for p in protocols if all(p in v for v in per.values())]
    if not protocols:
        return ""
    lds = {k: [float(np.mean(v[p])) for p in protocols] for k, v in per.items()}
    best = np.max(np.array(list(lds.values())), axis=0)
    scored = sorted(lds, key=lambda k: float(np.mean(best - np.array(lds[k]))))
    labels = {
        (r["method"], r["curvature"], _damping_key(r)): _damping_label(r).split(" = ")[0]
        for r in grid
    }
    head = " | ".join(protocols)
    lines = [
        f"**ranking over {len(protocols)} protocols** (regret: the protocol's best grid LDS "
        "minus the setting's)",
        "",
        f"| method | curvature | damping | mean regret | worst regret | {head} |",
        "|---" * (5 + len(protocols)) + "|",
    ]
    for k in scored[:top]:
        regret = best - np.array(lds[k])
        cells = " | ".join(f"{v:.3f}" for v in lds[k])
        lines.append(
            f"| {k[0]} | {k[1]} | {labels[k]} | {regret.mean():.3f} | {regret.max():.3f} | "
            f"{cells} |"
        )
    return "\n".join([*lines, ""])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="toy sizes, one checkpoint, one sample seed, 3 dampings, no Kronfluence: a smoke "
        "run of about a minute",
    )
    parser.add_argument("--protocols", default=",".join(PROTOCOLS), help="comma-separated")
    parser.add_argument(
        "--lds-models", type=int, default=None, help=f"retrained models (default {LDS_MODELS})"
    )
    parser.add_argument("--checkpoints", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (see bench_influence)"
    )
    parser.add_argument("--cache-dir", default=None, help="folder caching the GPT-2 ground truth")
    parser.add_argument("--no-kronfluence", action="store_true", help="skip Kronfluence's rows")
    parser.add_argument(
        "--no-baselines", action="store_true", help="skip the identity and TRAK rows"
    )
    for field, help_ in (
        ("seeds", "sample seeds of curvature='sampled'"),
        ("absolute", "absolute dampings"),
        ("pooled-multiples", "multiples of the pooled 'auto' value"),
        ("fractions", "fractions of each layer's mean eigenvalue"),
    ):
        parser.add_argument(
            f"--{field}", default=None, help=f"comma-separated {help_} (default: the grid's)"
        )
    parser.add_argument(
        "--summary", nargs="+", default=None, help="print the tables of JSONL runs and exit"
    )
    args = parser.parse_args(argv)
    if args.summary:
        rows = []
        for path in args.summary:
            with open(path) as f:
                rows += [json.loads(line) for line in f if line.startswith("{")]
        print(tables(rows))
        return
    setup_torch(args.threads)
    logging.basicConfig(level=logging.ERROR)
    with contextlib.suppress(ImportError):
        import kronfluence.analyzer  # imports are not part of any row's time
    emit({"bench": "machine", **machine_info()})
    for name in [n.strip() for n in args.protocols.split(",") if n.strip()]:
        sizes = protocol_sizes(name, args.quick, args.lds_models, args.checkpoints)
        seconds, p = time_once(lambda n=name, z=sizes: build_protocol(n, z, args.cache_dir))
        emit(
            {
                "bench": f"{BENCH}_protocol",
                "protocol": name,
                **dataclasses.asdict(sizes),
                **p.info,
                "seconds": seconds,
            }
        )
        # Kronfluence calls gc.collect() about 14 times per checkpoint (0.5-1 s each in a
        # process holding transformers): --quick leaves it to the `bench` test.
        kronfluence = not (args.no_kronfluence or args.quick)
        run_protocol(p, Grid.from_args(args), kronfluence, not args.no_baselines)


if __name__ == "__main__":
    main()
