"""The language-model demo: TRAK on a small GPT-2 trained on the standard library's source.

``run_lm_demo`` trains small Hugging Face causal LMs (GPT-2 by default,
built from a config: no download) byte-level on chunks of the Python
standard library's own source files (:mod:`gradsketch.demos._lm_corpus`),
featurizes the training chunks with :class:`~gradsketch.attribution.TRAKer`
(task ``"language_modeling"``, layer hooks + factorized projection), scores
held-out query chunks with per-token scores, and writes an HTML report
(:mod:`gradsketch.demos._lm_report`): each query's tokens shaded by their
attribution to its top proponent, and its top proponents and opponents with
their text and source file.

LDS protocol (Park et al., ICML 2023, sec. 2): ``lds_models`` models are
retrained from scratch, with the same settings, on random halves ``S_i`` of
the training chunks; each query's measurement is its summed log-likelihood
``Σ_t log p(x_t | x_<t)`` under the retrained model, and the LDS is the
Spearman correlation over ``i`` of ``Σ_{s ∈ S_i} scores[s, q]`` with that
measurement, averaged over queries. TRAK's model output for a sequence is
the summed per-token log-odds (see ``gradsketch.attribution._lm``), a
monotone per-token transform of the same log-likelihoods.

Run it with ``python -m gradsketch.demos.lm --out demo_lm_out``
(``--quick`` for a smoke test in about a minute).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import math
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from gradsketch._threads import torch_threads
from gradsketch.demos._errors import LMDemoSettingsError
from gradsketch.demos._lm_corpus import (
    BYTE_VOCAB,
    EOS_ID,
    STDLIB_MODULES,
    load_corpus,
    split_chunks,
)
from gradsketch.demos._lm_report import query_views, write_report

logger = logging.getLogger(__name__)

#: Name of the TRAK experiment holding the query chunks.
EXPERIMENT = "stdlib_queries"

#: The LDS's subsets are random halves of the training chunks.
LDS_SUBSET_FRACTION = 0.5

#: What the LDS correlates with the predicted subset sums.
LDS_MEASUREMENT = "summed log-likelihood of the query chunk"

#: Model families the demo can build (GPT-2 is the demo's; the others share the hook path).
ARCHITECTURES = ("gpt2", "llama", "gpt_neox")

#: Sizes ``quick=True`` uses: every step runs, in well under a minute.
QUICK: dict[str, Any] = {
    "num_train": 128,
    "num_queries": 4,
    "epochs": 2,
    "num_checkpoints": 1,
    "lds_models": 4,
    "proj_dim": 64,
    "report_queries": 4,
}


@dataclass(frozen=True)
class LMDemoSettings:
    """Everything that determines a run of the demo (saved in ``summary.json``).

    Attributes:
        arch: model family, one of :data:`ARCHITECTURES`.
        n_layer: transformer blocks.
        width: hidden size.
        n_head: attention heads.
        chunk_len: tokens (bytes) per chunk.
        num_train: training chunks.
        num_queries: held-out query chunks scored.
        epochs: passes over the training chunks (also for the LDS models).
        batch_size: chunks per optimiser step.
        featurize_batch_size: chunks per featurize / score call.
        lr: AdamW learning rate (linear decay to 0 over the run).
        weight_decay: AdamW weight decay.
        warmup_steps: optimiser steps of linear learning-rate warmup from 0 before
            the decay (transformers' ``get_linear_schedule_with_warmup``; 0: none).
        num_checkpoints: independently seeded models TRAK ensembles over.
        proj_dim: feature dimension k (an upper bound for the factorized projector).
        lambda_reg: ridge damping of ``ΦᵀΦ``, a number >= 0 or ``"auto"``.
        lds_models: models retrained on random halves for the LDS (0: no LDS).
        top_k: proponents and opponents per query in the report.
        report_queries: queries shown in the report.
        seed: seeds the split, the models, the projector and the LDS subsets.
        threads: torch intra-op threads during the run (1 by default: on a shared
            machine, OpenMP threads that wait for each other cost more than they gain).
        modules: standard-library files of the corpus.
    """

    arch: str = "gpt2"
    n_layer: int = 2
    width: int = 64
    n_head: int = 2
    chunk_len: int = 64
    num_train: int = 768
    num_queries: int = 16
    epochs: int = 5
    batch_size: int = 8
    featurize_batch_size: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_steps: int = 0
    num_checkpoints: int = 4
    proj_dim: int = 512
    lambda_reg: float | str = "auto"
    lds_models: int = 30
    top_k: int = 3
    report_queries: int = 8
    seed: int = 0
    threads: int = 1
    modules: tuple[str, ...] = STDLIB_MODULES

    def __post_init__(self) -> None:
        lows = {
            "n_layer": 1,
            "width": 2,
            "n_head": 1,
            "chunk_len": 2,
            "num_train": 2,
            "num_queries": 1,
            "epochs": 1,
            "batch_size": 1,
            "featurize_batch_size": 1,
            "num_checkpoints": 1,
            "proj_dim": 1,
            "lds_models": 0,
            "top_k": 1,
            "report_queries": 1,
            "threads": 1,
            "warmup_steps": 0,
        }
        for name, low in lows.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise LMDemoSettingsError(
                    f"`{name}` must be an integer >= {low}, got {value!r}; the default is "
                    f"{getattr(LMDemoSettings, name)!r}."
                )
        if self.arch not in ARCHITECTURES:
            raise LMDemoSettingsError(
                f"`arch` must be one of {', '.join(map(repr, ARCHITECTURES))}, got {self.arch!r}."
            )
        if self.width % self.n_head:
            raise LMDemoSettingsError(
                f"`width`={self.width} is not a multiple of `n_head`={self.n_head}; pick a "
                "width divisible by the number of heads."
            )
        if 0 < self.lds_models < 3:
            raise LMDemoSettingsError(
                f"`lds_models` must be 0 (no LDS) or >= 3, got {self.lds_models}; a rank "
                "correlation needs at least 3 models (20 or more for a stable LDS)."
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise LMDemoSettingsError(f"`seed` must be an int, got {self.seed!r}.")
        for name in ("lr", "weight_decay"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, float | int)
                or not math.isfinite(value)
                or value < 0
                or (name == "lr" and value == 0)
            ):
                raise LMDemoSettingsError(
                    f"`{name}` must be a finite number {'> 0' if name == 'lr' else '>= 0'}, "
                    f"got {value!r}."
                )
        lam = self.lambda_reg
        if not (
            lam == "auto"
            or (
                isinstance(lam, float | int)
                and not isinstance(lam, bool)
                and math.isfinite(lam)
                and lam >= 0
            )
        ):
            raise LMDemoSettingsError(
                f"`lambda_reg` must be a finite number >= 0 or 'auto', got {lam!r}."
            )
        if not self.modules:
            raise LMDemoSettingsError("`modules` is empty; pass standard-library file paths.")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready settings."""
        record = dataclasses.asdict(self)
        record["modules"] = list(self.modules)
        return record


# -- models -------------------------------------------------------------------------
def build_lm(settings: LMDemoSettings, *, seed: int) -> nn.Module:
    """A freshly initialised causal LM of ``settings.arch`` over the byte vocabulary.

    Vocabulary: 256 byte values plus :data:`EOS_ID`; no dropout, so the
    model's gradients are deterministic functions of its weights.

    Example:
        >>> model = build_lm(LMDemoSettings(), seed=0)
        >>> type(model).__name__, model(torch.zeros(1, 8, dtype=torch.long)).logits.shape
        ('GPT2LMHeadModel', torch.Size([1, 8, 257]))
    """
    torch.manual_seed(seed)
    s = settings
    # Every family: the byte vocabulary plus end-of-text, which also pads.
    tokens: dict[str, Any] = dict(
        vocab_size=BYTE_VOCAB + 1, bos_token_id=EOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID
    )
    if s.arch == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        gpt2 = GPT2Config(
            n_positions=s.chunk_len,
            n_embd=s.width,
            n_layer=s.n_layer,
            n_head=s.n_head,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **tokens,
        )
        return GPT2LMHeadModel(gpt2)
    # Llama and GPT-NeoX name their sizes alike.
    sizes: dict[str, Any] = dict(
        hidden_size=s.width,
        intermediate_size=4 * s.width,
        num_hidden_layers=s.n_layer,
        num_attention_heads=s.n_head,
        max_position_embeddings=s.chunk_len,
        **tokens,
    )
    if s.arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(num_key_value_heads=s.n_head, **sizes))
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    return GPTNeoXForCausalLM(GPTNeoXConfig(**sizes))


def lr_multiplier(step: int, total: int, warmup_steps: int = 0) -> float:
    """The demo's learning rate at optimiser step ``step`` of ``total``, as a fraction of ``lr``.

    A linear warmup from 0 over ``warmup_steps`` steps, then a linear decay
    to 0 at ``total`` (transformers' ``get_linear_schedule_with_warmup``);
    without warmup, ``1 - step / total``.

    Example:
        >>> [round(lr_multiplier(t, 8, warmup_steps=2), 3) for t in range(8)]
        [0.0, 0.5, 1.0, 0.833, 0.667, 0.5, 0.333, 0.167]
    """
    if step < warmup_steps:
        return step / warmup_steps
    if not warmup_steps:
        return 1.0 - step / total
    return max(0.0, (total - step) / max(1, total - warmup_steps))


def train_lm(
    ids: Tensor,
    settings: LMDemoSettings,
    *,
    seed: int,
    progress: bool = False,
    init_state: Mapping[str, Tensor] | None = None,
) -> tuple[nn.Module, list[float]]:
    """Train :func:`build_lm` on ``ids`` ``[n, T]`` with AdamW for ``settings.epochs``.

    The initialisation and the batch order both come from ``seed``; the
    learning rate follows :func:`lr_multiplier`. ``init_state`` (a state dict of
    the same architecture) replaces the initialisation, which makes the run a
    fine-tune: ``seed`` then fixes only the batch order. Returns the model in
    eval mode and the mean training loss of each epoch.

    Example:
        >>> s = LMDemoSettings(epochs=2, batch_size=8)
        >>> ids = load_corpus(["bisect.py"]).token_ids(range(16))
        >>> model, losses = train_lm(ids, s, seed=0)
        >>> losses[1] < losses[0]
        True
    """
    model = build_lm(settings, seed=seed)
    if init_state is not None:
        model.load_state_dict(init_state)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    gen = torch.Generator().manual_seed(seed)
    n = int(ids.shape[0])
    steps_per_epoch = math.ceil(n / settings.batch_size)
    total = steps_per_epoch * settings.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: lr_multiplier(step, total, settings.warmup_steps)
    )
    losses = []
    bar = tqdm(total=total, desc="training", disable=not progress, leave=False)
    for _ in range(settings.epochs):
        order = torch.randperm(n, generator=gen)
        epoch_loss = 0.0
        for start in range(0, n, settings.batch_size):
            batch = ids[order[start : start + settings.batch_size]]
            loss = model(input_ids=batch, labels=batch).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            epoch_loss += float(loss.detach()) * int(batch.shape[0])
            bar.update()
        losses.append(epoch_loss / n)
    bar.close()
    model.eval()
    return model, losses


@torch.no_grad()
def sequence_log_likelihood(model: nn.Module, ids: Tensor, *, batch_size: int = 64) -> np.ndarray:
    """``[n]`` summed log-likelihoods ``Σ_{t>=1} log p(x_t | x_<t)`` of the rows of ``ids``.

    Example:
        >>> model = build_lm(LMDemoSettings(), seed=0).eval()
        >>> sequence_log_likelihood(model, torch.zeros(3, 8, dtype=torch.long)).shape
        (3,)
    """
    out = []
    for start in range(0, int(ids.shape[0]), batch_size):
        x = ids[start : start + batch_size]
        logp = torch.log_softmax(model(input_ids=x).logits[:, :-1].double(), dim=-1)
        out.append(logp.gather(-1, x[:, 1:].unsqueeze(-1)).squeeze(-1).sum(1))
    return torch.cat(out).numpy()


def _lm_batch(ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The ``language_modeling`` task's tuple: every token real, every token predicted."""
    return ids, torch.ones_like(ids), ids.clone()


# -- attribution --------------------------------------------------------------------
def attribute(
    models: Sequence[nn.Module],
    train_ids: Tensor,
    query_ids: Tensor,
    settings: LMDemoSettings,
    save_dir: str | Path,
    *,
    per_token: bool = True,
    progress: bool = False,
) -> tuple[np.ndarray, np.ndarray | None, dict[str, Any]]:
    """TRAK scores of the queries, whole and per token, ensembled over ``models``.

    Args:
        models: the checkpoints (same architecture).
        train_ids: ``[n, T]`` training chunks.
        query_ids: ``[m, T]`` query chunks.
        settings: the demo's settings (projection, damping, batch size, seed).
        save_dir: the TRAK store's folder.
        per_token: also compute per-token scores (``T`` gradients per query).
        progress: show progress bars.

    Returns:
        ``scores [n, m]``, ``token_scores [n, m, T]`` (summing over ``T`` to
        ``scores``; ``None`` without ``per_token``) and a record of the
        TRAKer's settings.
    """
    # Importing the package registers its tasks, "language_modeling" among them.
    from gradsketch.attribution import HookGradientComputer, TRAKer

    n, m = int(train_ids.shape[0]), int(query_ids.shape[0])
    # TRAKer loads every checkpoint into its model: a copy, so that models[0]
    # keeps checkpoint 0's weights for its own scoring call (and the caller).
    traker = TRAKer(
        copy.deepcopy(models[0]),
        "language_modeling",
        n,
        save_dir=save_dir,
        load_from_save_dir=False,
        device="cpu",
        gradient_computer=HookGradientComputer,
        proj_dim=settings.proj_dim,
        projector_seed=settings.seed,
        lambda_reg=settings.lambda_reg,
        progress=progress,
        logging_level=logging.WARNING,
    )
    bs = settings.featurize_batch_size
    for model_id, model in enumerate(models):
        traker.load_checkpoint(model.state_dict(), model_id=model_id)
        for start in range(0, n, bs):
            batch = _lm_batch(train_ids[start : start + bs])
            traker.featurize(batch, num_samples=int(batch[0].shape[0]))
    traker.finalize_features()
    for model_id, model in enumerate(models):
        traker.start_scoring_checkpoint(
            EXPERIMENT, model.state_dict(), model_id=model_id, num_targets=m, per_token=per_token
        )
        # Per-token scoring runs T per-example gradients per query: smaller batches.
        step = max(1, bs // 8) if per_token else bs
        for start in range(0, m, step):
            batch = _lm_batch(query_ids[start : start + step])
            traker.score(batch, num_samples=int(batch[0].shape[0]))
    scores = np.asarray(traker.finalize_scores(EXPERIMENT))
    token_scores = (
        np.asarray(traker.finalize_scores(EXPERIMENT, per_token=True)) if per_token else None
    )
    record = {
        "proj_dim": int(traker.proj_dim),
        "projector": traker.settings.projector,
        "grad_dim": int(traker.grad_dim),
        "gradient_computer": "HookGradientComputer",
        "task": "language_modeling",
    }
    return scores, token_scores, record


# -- the demo -----------------------------------------------------------------------
def run_lm_demo(
    out_dir: str | Path,
    settings: LMDemoSettings | None = None,
    *,
    quick: bool = False,
    progress: bool = True,
    **overrides: Any,
) -> dict[str, Any]:
    """Train, attribute, report and evaluate (LDS) on the standard library's source.

    Writes to ``out_dir``: ``report.html`` (the page), ``scores.npy``
    (``[num_train, num_queries]``), ``token_scores.npy``
    (``[num_train, num_queries, chunk_len]``), ``chunks.json`` (the training
    and query chunks' source files, lines and offsets), ``summary.json``
    (settings, corpus files and hashes, timings, losses, LDS), the first
    checkpoint's weights (``model_0.pt``), the LDS ground truth
    (``lds_truth.npz``: subset ``masks`` and retrained ``outputs``; both
    read by ``benchmarks/bench_lm.py --from-demo``) and the TRAK store under
    ``trak_store/``.

    Args:
        out_dir: output folder (created; an earlier run there is replaced).
        settings: the run's settings (default :class:`LMDemoSettings`).
        quick: apply :data:`QUICK`'s smaller sizes first.
        progress: show progress bars.
        **overrides: fields of :class:`LMDemoSettings` to change.

    Returns:
        The summary (also written to ``summary.json``).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:  # doctest: +SKIP
        ...     print(run_lm_demo(d, quick=True, progress=False)["lds"])
    """
    base = settings if settings is not None else LMDemoSettings()
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(LMDemoSettings)})
    if unknown:
        raise LMDemoSettingsError(
            f"unknown settings {unknown}; allowed are "
            f"{[f.name for f in dataclasses.fields(LMDemoSettings)]}."
        )
    changes = {**(QUICK if quick else {}), **overrides}
    if "modules" in changes:
        changes["modules"] = tuple(changes["modules"])
    s = dataclasses.replace(base, **changes)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    store = out / "trak_store"
    if store.exists():
        shutil.rmtree(store)
    timings: dict[str, float] = {}
    with torch_threads(s.threads):
        start = time.perf_counter()
        corpus = load_corpus(s.modules, chunk_len=s.chunk_len)
        train_idx, query_idx = split_chunks(len(corpus), s.num_train, s.num_queries, seed=s.seed)
        train_ids, query_ids = corpus.token_ids(train_idx), corpus.token_ids(query_idx)

        models, losses = [], []
        for c in tqdm(range(s.num_checkpoints), desc="checkpoints", disable=not progress):
            model, epoch_losses = train_lm(train_ids, s, seed=s.seed + 1 + c, progress=progress)
            models.append(model)
            losses.append(epoch_losses)
        timings["train_s"] = time.perf_counter() - start

        start = time.perf_counter()
        scores, token_scores, trak_record = attribute(
            models, train_ids, query_ids, s, store, progress=progress
        )
        assert token_scores is not None
        timings["attribute_s"] = time.perf_counter() - start

        log_lik = sequence_log_likelihood(models[0], query_ids)
        start = time.perf_counter()
        lds, per_query, lds_record = _lds(s, out, train_ids, query_ids, scores, progress)
        timings["lds_s"] = time.perf_counter() - start

    np.save(out / "scores.npy", scores)
    torch.save(models[0].state_dict(), out / "model_0.pt")
    np.save(out / "token_scores.npy", token_scores)
    train_chunks = [corpus.chunks[int(i)] for i in train_idx]
    query_chunks = [corpus.chunks[int(i)] for i in query_idx]
    (out / "chunks.json").write_text(
        json.dumps(
            {
                "train": [[c.source, c.line, c.offset] for c in train_chunks],
                "queries": [[c.source, c.line, c.offset] for c in query_chunks],
            }
        )
        + "\n"
    )
    shown = list(range(min(s.report_queries, s.num_queries)))
    views = query_views(
        scores,
        token_scores,
        train_chunks,
        query_chunks,
        log_lik,
        top_k=min(s.top_k, s.num_train),
        queries=shown,
    )
    same_file = float(
        np.mean(
            [
                train_chunks[int(np.argmax(scores[:, j]))].source == query_chunks[j].source
                for j in range(s.num_queries)
            ]
        )
    )
    if lds is None:
        lds_text = "not computed (lds_models=0)"
    else:
        low, high = lds_record["ci95"]
        lds_text = f"{lds:.3f} (bootstrap 95 % interval {low:.2f} to {high:.2f})"
    facts = {
        "model": f"{s.arch}, {s.n_layer} layers, width {s.width}, byte vocabulary, "
        f"{sum(p.numel() for p in models[0].parameters()):,} parameters",
        "corpus": f"{len(s.modules)} standard-library files (Python {corpus.python}), "
        f"{s.num_train} training and {s.num_queries} query chunks of {s.chunk_len} bytes",
        "TRAK": f"{s.num_checkpoints} checkpoint(s), features of dimension "
        f"{trak_record['proj_dim']}, lambda {s.lambda_reg}",
        "LDS": f"{lds_text} over {s.lds_models} models retrained on random halves",
        "top proponent from the query's own file": f"{same_file:.0%} of queries",
    }
    write_report(
        out / "report.html",
        views,
        title="gradsketch: which standard-library chunks taught the model this code",
        facts=facts,
    )
    summary: dict[str, Any] = {
        "settings": s.to_dict(),
        "corpus": {
            "stdlib": corpus.stdlib,
            "python": corpus.python,
            "files": corpus.files,
            "num_chunks": len(corpus),
            "train_chunks": [int(i) for i in train_idx],
            "query_chunks": [int(i) for i in query_idx],
        },
        "torch": torch.__version__,
        "trak": trak_record,
        "train_losses": losses,
        "query_log_likelihood": [float(v) for v in log_lik],
        "top_proponent_same_file": same_file,
        "lds": lds,
        "lds_per_query": per_query,
        "lds_protocol": lds_record,
        "timings_s": timings,
        "report": str((out / "report.html").resolve()),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
    return summary


def lds_truth(
    s: LMDemoSettings,
    train_ids: Tensor,
    query_ids: Tensor,
    *,
    progress: bool = False,
    init_state: Mapping[str, Tensor] | None = None,
) -> Any:
    """Retrain on ``s.lds_models`` random halves; each query's summed log-likelihood.

    Model ``i`` is :func:`train_lm` on subset ``i`` with seed ``s.seed + 1 + i``
    (the subsets come from ``s.seed``; see
    :func:`~gradsketch.attribution.lds_ground_truth`), from ``init_state``
    where one is given (fine-tunes of one model that differ in data and order).

    Returns:
        :class:`~gradsketch.attribution.LDSGroundTruth`: ``[lds_models, n]``
        masks and ``[lds_models, m]`` log-likelihoods.
    """
    from gradsketch.attribution import lds_ground_truth

    if s.lds_models < 3:
        raise LMDemoSettingsError(
            f"`lds_models`={s.lds_models}: the LDS needs at least 3 retrained models."
        )

    def train(idx: np.ndarray, seed: int) -> nn.Module:
        return train_lm(train_ids[torch.as_tensor(idx)], s, seed=seed, init_state=init_state)[0]

    def evaluate(model: nn.Module) -> np.ndarray:
        return sequence_log_likelihood(model, query_ids)

    return lds_ground_truth(
        train,
        evaluate,
        int(train_ids.shape[0]),
        s.lds_models,
        LDS_SUBSET_FRACTION,
        seed=s.seed,
        progress=progress,
    )


def _lds(
    s: LMDemoSettings,
    out: Path,
    train_ids: Tensor,
    query_ids: Tensor,
    scores: np.ndarray,
    progress: bool,
) -> tuple[float | None, list[float | None], dict[str, Any]]:
    from gradsketch.attribution import linear_datamodeling_interval, linear_datamodeling_score

    record: dict[str, Any] = {
        "num_models": s.lds_models,
        "subset_fraction": LDS_SUBSET_FRACTION,
        "measurement": LDS_MEASUREMENT,
        "training": "same settings as the checkpoints; model i seeded with seed + 1 + i",
        "subset_seed": s.seed,
    }
    if s.lds_models == 0:
        return None, [], record
    truth = lds_truth(s, train_ids, query_ids, progress=progress)
    np.savez(out / "lds_truth.npz", masks=truth.subset_masks, outputs=truth.target_outputs)
    lds, per_query = linear_datamodeling_score(
        scores, truth.subset_masks, truth.target_outputs, return_per_target=True
    )
    _, low, high = linear_datamodeling_interval(scores, truth.subset_masks, truth.target_outputs)
    record["ci95"] = [round(low, 4), round(high, 4)]
    return (
        float(lds),
        [None if math.isnan(v) else float(v) for v in per_query],
        record,
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """``python -m gradsketch.demos.lm --out DIR [--quick] [--arch A] [--lds-models N]``."""
    parser = argparse.ArgumentParser(
        prog="python -m gradsketch.demos.lm",
        description="TRAK on a small GPT-2 trained on the Python standard library's source.",
    )
    parser.add_argument("--out", default="demo_lm_out", help="output folder")
    parser.add_argument("--quick", action="store_true", help="smoke-test sizes")
    parser.add_argument("--arch", choices=ARCHITECTURES, help="model family")
    parser.add_argument("--lds-models", type=int, help="models retrained for the LDS")
    parser.add_argument("--num-train", type=int, help="training chunks")
    parser.add_argument("--seed", type=int, help="master seed")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    args = parser.parse_args(argv)
    overrides = {
        name: value
        for name, value in (
            ("arch", args.arch),
            ("lds_models", args.lds_models),
            ("num_train", args.num_train),
            ("seed", args.seed),
        )
        if value is not None
    }
    summary = run_lm_demo(args.out, quick=args.quick, progress=not args.no_progress, **overrides)
    print(f"report: {summary['report']}")
    print(f"LDS: {summary['lds']}  timings (s): {summary['timings_s']}")
    return summary


if __name__ == "__main__":
    main()
