"""The influence benchmarks' protocols: digits and the standard-library GPT-2, with ground truths.

The digits protocol (``benchmarks/bench_influence.py``): an MLP 64-32-10
(:func:`build`) trained by the digits demo's recipe on :data:`N_TRAIN` rows,
:data:`N_TARGETS` test digits scored by the margin (:func:`margin_of`), and
the margins of models retrained on random halves (:func:`ground_truth`).
The GPT-2 protocol: the LM demo's model on standard-library chunks
(:func:`gpt2_settings`, :func:`lm_split`) with the demo's ground truth
(:func:`gpt2_ground_truth`, cached). ``run_*`` score a protocol with one
gradsketch method through TRAKer's four calls (:func:`featurize_all`,
:func:`score_targets`); ``benchmarks/bench_influence_defaults.py`` builds
its five protocols from the same pieces.
"""

from __future__ import annotations

import copy
import logging
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

N_TRAIN, N_TARGETS, HIDDEN = 1000, 100, 32
QUIET = logging.WARNING


def build(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 10))


def train(x: torch.Tensor, y: torch.Tensor, seed: int, builder: Any = build) -> nn.Module:
    """``builder(seed)`` trained by the digits demo's recipe (SGD, 20 epochs) on ``(x, y)``."""
    from gradsketch.demos._digits import train_model

    return train_model(builder(seed), x, y, seed=seed)


def data(n_train: int = N_TRAIN, n_targets: int = N_TARGETS):
    from gradsketch.demos._digits import load_digits_split

    split = load_digits_split(seed=0)
    x, y = split.x_train[:n_train], split.y_train[:n_train]
    return x, y, split.x_test[:n_targets], split.y_test[:n_targets]


def ground_truth(x, y, xt, yt, lds_models: int, builder: Any = build):
    """``(masks, margins)`` of ``lds_models`` models retrained on random halves (seed 10,000)."""
    from gradsketch.attribution import lds_ground_truth
    from gradsketch.demos._digits import margins

    def train_fn(idx: np.ndarray, seed: int) -> nn.Module:
        t = torch.from_numpy(idx)
        return train(x[t], y[t], seed, builder)

    def eval_fn(model: nn.Module) -> torch.Tensor:
        with torch.no_grad():
            return margins(model, xt, yt)

    truth = lds_ground_truth(train_fn, eval_fn, len(x), lds_models, seed=10_000, progress=False)
    return truth.subset_masks, truth.target_outputs


# -- gradsketch ------------------------------------------------------------------------
def _rows(batch) -> int:
    return int(batch[0].shape[0])


def featurize_all(attributor: Any, checkpoints, train_batches) -> None:
    """Featurize each checkpoint (state dicts, model-id order) on ``train_batches``; finalize."""
    for model_id, ckpt in enumerate(checkpoints):
        attributor.load_checkpoint(ckpt, model_id=model_id)
        for batch in train_batches:
            attributor.featurize(batch, num_samples=_rows(batch))
    attributor.finalize_features()


def score_targets(attributor: Any, checkpoints, query_batches, exp: str = "lds") -> None:
    """Store the target features of experiment ``exp`` on every checkpoint."""
    num_targets = sum(_rows(b) for b in query_batches)
    for model_id, ckpt in enumerate(checkpoints):
        attributor.start_scoring_checkpoint(exp, ckpt, model_id=model_id, num_targets=num_targets)
        for batch in query_batches:
            attributor.score(batch, num_samples=_rows(batch))


def featurize_and_score(attributor: Any, checkpoints, x, y, xt, yt) -> np.ndarray:
    """TRAKer's flow on the protocol (TRAKer and InfluenceComputer alike).

    Every checkpoint is featurized in batches of 250, then the targets scored on each.
    """
    batch = 250
    featurize_all(
        attributor,
        checkpoints,
        [(x[i : i + batch], y[i : i + batch]) for i in range(0, len(x), batch)],
    )
    score_targets(attributor, checkpoints, [(xt, yt)])
    return np.asarray(attributor.finalize_scores("lds"))


def run_traker(checkpoints, x, y, xt, yt, tmp: str, **kwargs: Any) -> np.ndarray:
    from gradsketch.attribution import TRAKer

    traker = TRAKer(
        build(0),
        "image_classification",
        len(x),
        save_dir=tempfile.mkdtemp(dir=tmp),
        device="cpu",
        use_half_precision=False,
        logging_level=QUIET,
        lambda_reg="auto",
        progress=False,
        **kwargs,
    )
    return featurize_and_score(traker, checkpoints, x, y, xt, yt)


def run_influence(checkpoints, x, y, xt, yt, tmp: str, **kwargs: Any) -> np.ndarray:
    from gradsketch.attribution import InfluenceComputer

    ic = InfluenceComputer(
        build(0),
        "image_classification",
        len(x),
        tempfile.mkdtemp(dir=tmp),
        progress=False,
        **kwargs,
    )
    return featurize_and_score(ic, checkpoints, x, y, xt, yt)


def _ce(model: nn.Module, batch) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1], reduction="none")


def margin_of(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """TRAK's margin ``z_y - logsumexp_{j != y} z_j`` per row (differentiable)."""
    labels = labels.reshape(-1, 1)
    correct = logits.gather(1, labels).squeeze(1)
    return correct - logits.scatter(1, labels, float("-inf")).logsumexp(1)


def _margin(model: nn.Module, batch) -> torch.Tensor:
    """TRAK's margin of a digits batch ``(inputs, labels)``."""
    return margin_of(model(batch[0]), batch[1])


def run_bif(checkpoints, x, y, xt, yt, tmp: str, **kwargs: Any) -> np.ndarray:
    from gradsketch.slt import bayesian_influence

    scores = bayesian_influence(
        build(0),
        (x, y),
        (xt, yt),
        _ce,
        query_fn=_margin,
        checkpoints=checkpoints,
        progress=False,
        **kwargs,
    )
    return scores.float().numpy()


# -- GPT-2 protocol ----------------------------------------------------------------------
# The second protocol: the LM demo's model and ground truth at benchmark size.
# Ground truths are cached (--cache-dir) since retraining dominates a run's time.
LM_QUIET = {"progress": False}


def gpt2_settings(quick: bool, lds_models: int) -> Any:
    """The LM demo's settings for the protocol: 512 chunks, 64 queries (quick: 128, 16, 6)."""
    from gradsketch.demos.lm import LMDemoSettings

    return LMDemoSettings(
        num_train=128 if quick else 512,
        num_queries=16 if quick else 64,
        epochs=3,
        lds_models=6 if quick else lds_models,
        num_checkpoints=3,
        proj_dim=512,
        lambda_reg="auto",
    )


def lm_rows(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``language_modeling`` batch: every token real and predicted."""
    return ids, torch.ones_like(ids), ids.clone()


def gpt2_ground_truth(s: Any, train_ids, query_ids, cache_dir: str | None):
    """``(masks, outputs)`` of :func:`gradsketch.demos.lm.lds_truth`, cached per settings."""
    import hashlib
    import json

    from gradsketch.demos.lm import lds_truth

    key = hashlib.sha256(json.dumps(s.to_dict(), sort_keys=True).encode()).hexdigest()[:12]
    path = None if cache_dir is None else Path(cache_dir) / f"gpt2_truth_{key}.npz"
    if path is not None and path.exists():
        with np.load(path) as z:
            return z["masks"], z["outputs"], True
    truth = lds_truth(s, train_ids, query_ids)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, masks=truth.subset_masks, outputs=truth.target_outputs)
    return truth.subset_masks, truth.target_outputs, False


def run_lm_trak(models, train_ids, query_ids, s: Any, tmp: str) -> np.ndarray:
    from gradsketch.demos.lm import attribute

    scores, _, _ = attribute(
        models, train_ids, query_ids, s, tempfile.mkdtemp(dir=tmp), per_token=False
    )
    return scores


def run_lm_influence(models, train_ids, query_ids, s: Any, tmp: str, **kwargs: Any) -> np.ndarray:
    """``TRAKer(method=...)`` on the LM: featurize, finalize, score, ensemble."""
    from gradsketch.attribution import TRAKer
    from gradsketch.sketch import FactorizedProjector

    projection = kwargs.pop("projection", None)
    drop_head = kwargs.pop("drop_lm_head", False)
    model = models[0]
    grad_wrt = None
    if drop_head:
        grad_wrt = [n for n, _ in model.named_parameters() if n != "transformer.wte.weight"]
    projector = None
    if projection is not None:
        projector = FactorizedProjector.from_model(
            model, k_in=projection[0], k_out=projection[1], seed=s.seed
        )
    n, bs = int(train_ids.shape[0]), 64
    traker = TRAKer(
        copy.deepcopy(model),  # it loads every checkpoint: keep models[0] intact
        "language_modeling",
        n,
        save_dir=tempfile.mkdtemp(dir=tmp),
        device="cpu",
        logging_level=QUIET,
        projector=projector,
        projector_seed=s.seed,
        grad_wrt=grad_wrt,
        progress=False,
        **kwargs,
    )
    states = [member.state_dict() for member in models]
    featurize_all(traker, states, lm_batches(train_ids, bs))
    score_targets(traker, states, [lm_rows(query_ids)], "lm")
    return np.asarray(traker.finalize_scores("lm"))


def lm_batches(ids: torch.Tensor, batch_size: int) -> list[tuple[torch.Tensor, ...]]:
    """``language_modeling`` batches of ``batch_size`` chunks."""
    return [lm_rows(ids[i : i + batch_size]) for i in range(0, int(ids.shape[0]), batch_size)]


def lm_loss(model: nn.Module, batch) -> torch.Tensor:
    """``[B]`` summed next-token loss of each chunk."""
    ids = batch[0]
    logits = model(input_ids=ids).logits[:, :-1]
    return F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").sum(1)


def _lm_log_likelihood(model: nn.Module, batch) -> torch.Tensor:
    return -lm_loss(model, batch)


def run_lm_bif(models, train_ids, query_ids, s: Any, tmp: str, **kwargs: Any) -> np.ndarray:
    from gradsketch.slt import bayesian_influence

    scores = bayesian_influence(
        models[0],
        (train_ids,),
        (query_ids,),
        lm_loss,
        query_fn=_lm_log_likelihood,
        checkpoints=[m.state_dict() for m in models],
        progress=False,
        **kwargs,
    )
    return scores.float().numpy()


def lm_split(s: Any) -> tuple[Tensor, Tensor]:
    """``(train_ids, query_ids)``: the LM demo's chunks of ``s`` (its modules, sizes, seed)."""
    from gradsketch.demos._lm_corpus import load_corpus, split_chunks

    corpus = load_corpus(s.modules, chunk_len=s.chunk_len)
    train_idx, query_idx = split_chunks(len(corpus), s.num_train, s.num_queries, seed=s.seed)
    return corpus.token_ids(train_idx), corpus.token_ids(query_idx)
