"""Influence methods side by side on the digits MLP and a GPT-2: LDS and wall time (fit + score).

Run ``python benchmarks/bench_influence.py`` (``--quick`` for a smoke run with
fewer retrained models; ``--lds-models`` and ``--checkpoints`` to change the
protocol). Prints one JSON line per method. Needs Kronfluence 1.0.1 (the
``bench`` extra, installed with ``--no-deps``); without it those rows are
skipped with a note.

Protocol (the issue's digits protocol): an MLP 64-32-10 (ReLU) trained with
:func:`gradsketch.demos._digits.train_model` on the first 1,000
training rows of ``load_digits_split(seed=0)``; 100 targets from the test
split; the output is TRAK's margin. Ground truth: ``--lds-models`` models
retrained on random halves (:func:`lds_ground_truth`, seed 10,000); LDS is the
mean over targets of Spearman's correlation. Checkpoints are independent
trainings (seeds 0, 1, 2, ...) of the full 1,000 rows; every method averages
its scores over the same checkpoints.

Methods: gradsketch TRAK (``lambda_reg="auto"``, k=512); gradsketch
``TRAKer(method=...)`` identity / K-FAC / EK-FAC (exact per-layer gradients,
and EK-FAC in the factorized-projected space ``k_in = k_out = 16``; both
curvatures); gradsketch ``bayesian_influence`` (SGLD draws, query observable
the margin); Kronfluence identity / K-FAC / EK-FAC (its defaults: sampled
true Fisher, damping ``ScoreArguments().damping_factor`` = 1e-8, not its
0.1 x mean-eigenvalue heuristic, which ``damping_factor=None`` selects;
measurement the margin, train loss the summed cross-entropy). Kronfluence's
scores are ``∇f_qᵀ H⁻¹ ∇L_i``, the effect on the query of *removing*
example i, so they are negated to compare with the others' "positive =
helps the query". dattri 0.3.0's CPU
attributors (:func:`dattri_rows`: influence functions explicit / CG / LiSSA
/ DataInf / Arnoldi / EK-FAC, TRAK, TracIn) on the same checkpoints, targets
and margin, signs aligned the same way; skipped with a note without dattri
(the ``bench`` extra). Each line also gives
the fraction of top-5 proponents that share the target's label (the main
job's gallery criterion).

GPT-2 protocol (``--protocol gpt2``; ``both`` runs it before the digits
one): the LM demo's Hugging Face GPT-2 (2 layers, width 64, byte-level
vocabulary) trained with :func:`gradsketch.demos.lm.train_lm` (3 epochs) on
512 chunks of 64 bytes of the Python standard library, 64 held-out query
chunks, measurement each query's summed log-likelihood. Ground truth:
``--lm-lds-models`` models retrained on random halves
(:func:`gradsketch.demos.lm.lds_truth`; cached in ``--cache-dir``, keyed by
the settings). Checkpoints are the demo's (seeds 1, 2, 3 on all 512 chunks).
Methods: gradsketch TRAK through the demo's ``attribute`` (k=512,
``lambda_reg="auto"``, 1 and 3 checkpoints); ``TRAKer(method=...,
task="language_modeling")`` identity / K-FAC / EK-FAC (full, projected
32x32, without the tied ``lm_head``, curvatures ``"loss"`` and
``"sampled"``); ``bayesian_influence`` (loss the chunk's summed token loss,
query observable its log-likelihood); Kronfluence identity / K-FAC / EK-FAC
through :func:`kronfluence_pairwise` with ``bench_lm``'s task (Conv1D
converted to Linear, measurement the summed loss, so no sign change; its
default damping 1e-8). Lines carry the 1-minute
load average: on a shared machine the times are only comparable within one
run. ``bench_influence_defaults.py`` reuses these protocols (and three more)
for the per-layer methods' damping x curvature grid.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import logging
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, machine_info, setup_torch, time_once

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
    """TRAKer's flow on the protocol (TRAKer and InfluenceComputer alike): every
    checkpoint featurized in batches of 250, then the targets scored on each."""
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


# -- Kronfluence -------------------------------------------------------------------------
#: Kronfluence 1.0.1's own default damping (``ScoreArguments().damping_factor``);
#: ``None`` selects its heuristic, 0.1 x each module's mean eigenvalue.
KRONFLUENCE_DEFAULT_DAMPING = 1e-8


def kronfluence_classifier_task(forward: Any) -> Any:
    """A Kronfluence ``Task`` for a classifier: ``forward(model, batch) -> (logits, labels)``.

    Training loss: the batch's summed cross-entropy, under labels drawn from
    the model's own predictions when Kronfluence asks for a sample (its true
    Fisher); measurement: the summed margin (:func:`margin_of`).
    """
    from kronfluence.task import Task

    class ClassifierTask(Task):
        def compute_train_loss(self, batch, model, sample=False):
            logits, labels = forward(model, batch)
            if sample:
                with torch.no_grad():
                    probs = torch.softmax(logits.detach(), -1)
                    labels = torch.multinomial(probs, 1).flatten()
            return F.cross_entropy(logits, labels, reduction="sum")

        def compute_measurement(self, batch, model):
            return margin_of(*forward(model, batch)).sum()

    return ClassifierTask()


def _digits_forward(model: nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor]:
    return model(batch[0]), batch[1]


def kronfluence_pairwise(
    model: nn.Module,
    task: Any,
    train_ds: Any,
    query_ds: Any,
    workdir: str,
    *,
    strategy: str,
    dampings: tuple[float | None, ...] = (KRONFLUENCE_DEFAULT_DAMPING,),
    train_batch: int = 250,
    query_batch: int | None = None,
    seed: int = 0,
) -> dict[float | None, np.ndarray]:
    """Kronfluence's ``[n_train, n_query]`` pairwise scores of one model, per damping factor.

    The factors of ``strategy`` are fitted once (torch's generator seeded
    with ``seed`` for the sampled labels of its true Fisher), then scored at
    each ``damping_factor`` in ``dampings`` (``None``: its heuristic). Scores
    are Kronfluence's own sign, ``∇f_qᵀ H⁻¹ ∇L_i``; ``model`` is prepared
    (wrapped) in place.
    """
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.utils.dataset import DataLoaderKwargs

    model = prepare_model(model.eval(), task)
    analyzer = Analyzer(
        "bench",
        model,
        task,
        cpu=True,
        disable_tqdm=True,
        output_dir=workdir,
        log_level=logging.ERROR,
    )
    analyzer.set_dataloader_kwargs(DataLoaderKwargs(num_workers=0))
    torch.manual_seed(seed)
    analyzer.fit_all_factors(
        "factors",
        train_ds,
        per_device_batch_size=train_batch,
        factor_args=FactorArguments(strategy=strategy),
        overwrite_output_dir=True,
    )
    out: dict[float | None, np.ndarray] = {}
    for i, damping in enumerate(dampings):
        analyzer.compute_pairwise_scores(
            f"scores{i}",
            "factors",
            query_ds,
            train_ds,
            per_device_query_batch_size=query_batch or len(query_ds),
            per_device_train_batch_size=train_batch,
            score_args=ScoreArguments(damping_factor=damping),
            overwrite_output_dir=True,
        )
        scores = analyzer.load_pairwise_scores(f"scores{i}")["all_modules"]  # [queries, train]
        out[damping] = scores.T.double().numpy()
    return out


def kronfluence_ensemble(
    models: list[nn.Module],
    task: Any,
    train_ds: Any,
    query_ds: Any,
    tmp: str,
    *,
    strategy: str,
    dampings: tuple[float | None, ...],
    sign: float = 1.0,
    prepare: Any = copy.deepcopy,
    **kwargs: Any,
) -> dict[float | None, np.ndarray]:
    """``sign`` x the mean over ``models`` of :func:`kronfluence_pairwise`, per damping.

    ``prepare(model)`` gives the copy Kronfluence wraps (the models stay as they are).
    """
    total = {d: np.zeros((len(train_ds), len(query_ds))) for d in dampings}
    for i, model in enumerate(models):
        workdir = str(Path(tempfile.mkdtemp(dir=tmp)) / f"kf{i}")
        scores = kronfluence_pairwise(
            prepare(model),
            task,
            train_ds,
            query_ds,
            workdir,
            strategy=strategy,
            dampings=dampings,
            **kwargs,
        )
        for d in dampings:
            total[d] += sign * scores[d] / len(models)
    return total


def digits_kronfluence(
    models, x, y, xt, yt, tmp: str, strategy: str, dampings: tuple[float | None, ...]
) -> dict[float | None, np.ndarray]:
    """Kronfluence's ``strategy`` on a digits protocol (any architecture), per damping.

    Its scores are the effect of *removing* a training row on the query's
    margin, so they are negated ("positive = helps").
    """
    from torch.utils.data import TensorDataset

    return kronfluence_ensemble(
        models,
        kronfluence_classifier_task(_digits_forward),
        TensorDataset(x, y),
        TensorDataset(xt, yt),
        tmp,
        strategy=strategy,
        dampings=dampings,
        sign=-1.0,
    )


def run_kronfluence(checkpoints, x, y, xt, yt, tmp: str, strategy: str) -> np.ndarray:
    """Kronfluence's ``strategy`` at its default damping, averaged over the MLP's checkpoints."""
    models = []
    for ckpt in checkpoints:
        models.append(build(0))
        models[-1].load_state_dict(ckpt)
    damping = KRONFLUENCE_DEFAULT_DAMPING
    return digits_kronfluence(models, x, y, xt, yt, tmp, strategy, (damping,))[damping]


# -- dattri ------------------------------------------------------------------------------
#: dattri 0.3.0's attributors that run on CPU (its influence-function family, TRAK, TracIn).
DATTRI_METHODS = (
    "if-explicit",
    "if-cg",
    "if-lissa",
    "if-datainf",
    "if-arnoldi",
    "if-ekfac",
    "trak",
    "tracin",
)


def _dattri_functions(model: nn.Module):
    """dattri's ``f(params, data)`` forms of the training loss and of the margin.

    The influence-function attributors call them on ``(1, ...)`` slices of a
    batch (and the loss on whole batches, for the Hessian); TRAK and TracIn
    on single unbatched examples. Both forms reduce over the batch: the loss
    by its mean (dattri's convention for curvature), the margin by its sum
    (a one-row batch gives the row's margin). Labels are cast back to
    integers: dattri's LiSSA hands the loss float labels.
    """
    from torch.func import functional_call

    def _rows(data):
        inputs, labels = data
        # LiSSA's collate function casts every tensor of a batch to float.
        labels = labels.long()
        if inputs.dim() == 1:
            return inputs.unsqueeze(0), labels.unsqueeze(0)
        return inputs, labels

    def loss(params, data):
        inputs, labels = _rows(data)
        return F.cross_entropy(functional_call(model, params, (inputs,)), labels)

    def margin(params, data):
        inputs, labels = _rows(data)
        logits = functional_call(model, params, (inputs,))
        right = logits.gather(1, labels.reshape(-1, 1)).squeeze(1)
        rest = logits.scatter(1, labels.reshape(-1, 1), float("-inf")).logsumexp(1)
        return (right - rest).sum()

    def correct_probability(params, data):
        inputs, labels = _rows(data)
        logits = functional_call(model, params, (inputs,))
        return torch.exp(-F.cross_entropy(logits, labels))

    return loss, margin, correct_probability


def _auto_damping(checkpoints, x, y) -> float:
    """0.1 x the mean eigenvalue of the mean-loss empirical Fisher, averaged over checkpoints.

    The rule of gradsketch's ``lambda_reg="auto"`` and Kronfluence's default
    damping, put on the scale of dattri's mean-loss Hessian: trace / p from
    per-example gradients, ``mean_i |g_i|² / p``.
    """
    from torch.func import functional_call, grad, vmap

    model = build(0)
    values = []
    for ckpt in checkpoints:
        params = {k: v.detach() for k, v in ckpt.items()}

        def one(p, xi, yi):
            logits = functional_call(model, p, (xi.unsqueeze(0),))
            return F.cross_entropy(logits, yi.unsqueeze(0))

        grads = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
        flat = torch.cat([g.reshape(len(x), -1) for g in grads.values()], dim=1)
        values.append(float(flat.pow(2).sum(1).mean()) / flat.shape[1])
    return 0.1 * float(np.mean(values))


def run_dattri(checkpoints, x, y, xt, yt, method: str, damping: float) -> np.ndarray:
    """One dattri attributor on the protocol; ``[n_train, n_targets]``, positive = helps.

    Every attributor gets the training loss (cross-entropy) for the training
    side and the margin as the measured quantity, and dattri's own
    checkpoint ensemble (its mean over checkpoints; TRAK's ensemble formula;
    TracIn with weight ``1/C`` per checkpoint), except EK-FAC, which dattri
    fits on one checkpoint only: it is run per checkpoint and averaged.

    Signs: the influence-function attributors return ``g_trainᵀ H⁻¹ ∇margin``
    and TracIn ``g_train · ∇margin`` (both positive when upweighting the
    training example *lowers* the measurement, dattri's convention for a
    loss), so they are negated; dattri's TRAK differentiates the margin on
    both sides and already scores helpful examples positive.
    """
    from dattri.algorithm import (
        IFAttributorArnoldi,
        IFAttributorCG,
        IFAttributorDataInf,
        IFAttributorEKFAC,
        IFAttributorExplicit,
        IFAttributorLiSSA,
        TracInAttributor,
        TRAKAttributor,
    )
    from dattri.task import AttributionTask
    from torch.utils.data import DataLoader, TensorDataset

    model = build(0).eval()
    loss, margin, correct_probability = _dattri_functions(model)
    ckpts = [{k: v.clone() for k, v in c.items()} for c in checkpoints]
    train_ds, test_ds = TensorDataset(x, y), TensorDataset(xt, yt)
    # One batch each: dattri's IF attributors rebuild the inverse-HVP per (train, test) batch.
    train_loader = DataLoader(train_ds, batch_size=N_TRAIN, shuffle=False)
    test_loader = DataLoader(test_ds, batch_size=N_TARGETS, shuffle=False)

    def task(ckpt_list, target=margin):
        return AttributionTask(
            loss_func=loss, model=model, checkpoints=ckpt_list, target_func=target
        )

    if method == "trak":
        trak_task = AttributionTask(loss_func=margin, model=model, checkpoints=ckpts)
        attributor = TRAKAttributor(
            trak_task,
            correct_probability_func=correct_probability,
            projector_kwargs={"proj_dim": 512, "device": "cpu"},
            device="cpu",
            regularization=0.0,
        )
        attributor.cache(train_loader)
        with torch.no_grad():
            return attributor.attribute(test_loader).detach().double().numpy()
    if method == "tracin":
        weights = torch.full((len(ckpts),), 1.0 / len(ckpts))
        attributor = TracInAttributor(
            task(ckpts),
            weight_list=weights,
            normalized_grad=False,
            projector_kwargs={"proj_dim": 512, "device": "cpu"},
            device="cpu",
        )
        return -attributor.attribute(train_loader, test_loader).detach().double().numpy()
    if method == "if-ekfac":
        total = np.zeros((N_TRAIN, N_TARGETS))
        for ckpt in ckpts:
            # The Fisher factors come from the task's target function (dattri's
            # design); fitted on the loss, then the margin task is swapped in.
            attributor = IFAttributorEKFAC(task([ckpt], target=loss), device="cpu", damping=damping)
            attributor.cache(train_loader)
            attributor.task = task([ckpt])
            total += -attributor.attribute(train_loader, test_loader).detach().double().numpy()
        return total / len(ckpts)
    constructors = {
        "if-explicit": lambda t: IFAttributorExplicit(t, device="cpu", regularization=damping),
        "if-cg": lambda t: IFAttributorCG(t, device="cpu", max_iter=20, regularization=damping),
        "if-lissa": lambda t: IFAttributorLiSSA(
            t, device="cpu", batch_size=100, recursion_depth=200, damping=damping, scaling=50.0
        ),
        "if-datainf": lambda t: IFAttributorDataInf(t, device="cpu", regularization=damping),
        "if-arnoldi": lambda t: IFAttributorArnoldi(
            t, device="cpu", proj_dim=100, max_iter=100, regularization=damping
        ),
    }
    attributor = constructors[method](task(ckpts))
    attributor.cache(train_loader)
    return -attributor.attribute(train_loader, test_loader).detach().double().numpy()


def dattri_rows(
    checkpoints, x, y, xt, yt, masks, outputs, lds_models: int, only: list[str]
) -> None:
    """dattri's CPU attributors side by side with the rows above: one JSON line each.

    Same checkpoints, targets, measurement (the margin) and sign (positive =
    helps the target) as the other rows; LDS against the same retrained
    models, wall time of fit + score (the damping estimate included), and the
    top-5 same-label share. Without dattri one line says so; an attributor
    that raises gets a line with dattri's exact error instead of scores.
    Damping: :func:`_auto_damping` for the influence functions; TRAK
    (undamped, as dattri's default) and TracIn project to 512 dimensions.
    """
    from gradsketch.attribution import linear_datamodeling_score
    from gradsketch.demos import top_share_same_label

    names = [f"dattri {m}" for m in DATTRI_METHODS]
    names = [n for n in names if not only or any(o in n for o in only)]
    if not names:
        return
    try:
        import dattri.algorithm  # noqa: F401
    except ImportError as err:
        emit({"bench": "influence", "method": "dattri", "skipped": f"dattri is missing: {err}"})
        return
    version = importlib.metadata.version("dattri")
    logging.getLogger("dattri").setLevel(logging.ERROR)
    for name in names:
        method = name.removeprefix("dattri ")
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                curvature = method.startswith("if-")
                damping = _auto_damping(checkpoints, x, y) if curvature else 0.0
                scores = run_dattri(checkpoints, x, y, xt, yt, method, damping)
            except Exception as err:  # the row records dattri's failure as it is
                emit(
                    {
                        "bench": "influence",
                        "method": name,
                        "dattri": version,
                        "error": f"{type(err).__name__}: {err}",
                        "seconds": time.perf_counter() - start,
                    }
                )
                continue
        seconds = time.perf_counter() - start
        record: dict[str, Any] = {
            "bench": "influence",
            "method": name,
            "checkpoints": len(checkpoints),
            "seconds": seconds,
            "lds_models": lds_models,
            "dattri": version,
            "options": {"damping": damping} if curvature else {"proj_dim": 512},
        }
        if not np.isfinite(scores).all():
            record["error"] = f"{int((~np.isfinite(scores)).sum())} non-finite scores"
            # dattri's own diagnosis of the failure, if it gave one.
            record["warnings"] = sorted({f"{w.category.__name__}: {w.message}" for w in caught})
        else:
            record["lds"] = linear_datamodeling_score(scores, masks, outputs)
            record["top5_same_label"] = top_share_same_label(scores, y, yt, 5)
        emit(record)


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


def _lm_rows(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
    score_targets(traker, states, [_lm_rows(query_ids)], "lm")
    return np.asarray(traker.finalize_scores("lm"))


def lm_batches(ids: torch.Tensor, batch_size: int) -> list[tuple[torch.Tensor, ...]]:
    """``language_modeling`` batches of ``batch_size`` chunks."""
    return [_lm_rows(ids[i : i + batch_size]) for i in range(0, int(ids.shape[0]), batch_size)]


def _lm_loss(model: nn.Module, batch) -> torch.Tensor:
    """``[B]`` summed next-token loss of each chunk."""
    ids = batch[0]
    logits = model(input_ids=ids).logits[:, :-1]
    return F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").sum(1)


def _lm_log_likelihood(model: nn.Module, batch) -> torch.Tensor:
    return -_lm_loss(model, batch)


def run_lm_bif(models, train_ids, query_ids, s: Any, tmp: str, **kwargs: Any) -> np.ndarray:
    from gradsketch.slt import bayesian_influence

    scores = bayesian_influence(
        models[0],
        (train_ids,),
        (query_ids,),
        _lm_loss,
        query_fn=_lm_log_likelihood,
        checkpoints=[m.state_dict() for m in models],
        progress=False,
        **kwargs,
    )
    return scores.float().numpy()


def lm_kronfluence(
    models, train_ids, query_ids, tmp: str, strategy: str, dampings: tuple[float | None, ...]
) -> dict[float | None, np.ndarray]:
    """Kronfluence's ``strategy`` on the LM (Conv1D made Linear), per damping.

    The measurement is the query's summed loss and the training loss the
    summed loss (sampled labels for its true Fisher, ``bench_lm``'s task),
    so a positive score raises the query's log-likelihood: no sign change.
    """
    from bench_lm import _kronfluence_task, _Rows, conv1d_to_linear

    return kronfluence_ensemble(
        models,
        _kronfluence_task(),
        _Rows(train_ids),
        _Rows(query_ids),
        tmp,
        strategy=strategy,
        dampings=dampings,
        prepare=lambda model: conv1d_to_linear(copy.deepcopy(model)),
        train_batch=32,
    )


def run_lm_kronfluence(models, train_ids, query_ids, s: Any, tmp: str, strategy: str):
    """:func:`lm_kronfluence` at Kronfluence's default damping, averaged over checkpoints."""
    damping = KRONFLUENCE_DEFAULT_DAMPING
    return lm_kronfluence(models, train_ids, query_ids, tmp, strategy, (damping,))[damping]


def run_lm_dattri(models, train_ids, query_ids, s: Any, tmp: str, method: str) -> np.ndarray:
    """dattri 0.3.0's TracIn or DataInf on the LM: summed loss per chunk, its negation measured.

    Both sides differentiate the chunk's summed next-token loss
    (``functional_call`` on the HF model, as dattri's tasks expect); the
    score is negated so that positive raises the query's log-likelihood.
    """
    from dattri.algorithm.influence_function import IFAttributorDataInf
    from dattri.algorithm.tracin import TracInAttributor
    from dattri.task import AttributionTask
    from torch.func import functional_call
    from torch.utils.data import DataLoader, TensorDataset

    model = copy.deepcopy(models[0]).eval()

    def loss(params, data):
        (ids,) = data
        ids = ids.unsqueeze(0) if ids.dim() == 1 else ids
        logits = functional_call(model, params, (), {"input_ids": ids}).logits[:, :-1]
        return F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="sum")

    ckpts = [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in models]
    task = AttributionTask(loss_func=loss, model=model, checkpoints=ckpts)
    train_loader = DataLoader(TensorDataset(train_ids), batch_size=64, shuffle=False)
    query_loader = DataLoader(TensorDataset(query_ids), batch_size=64, shuffle=False)
    if method == "tracin":
        attributor = TracInAttributor(
            task,
            weight_list=torch.full((len(ckpts),), 1.0 / len(ckpts)),
            normalized_grad=False,
            projector_kwargs={"proj_dim": 512, "device": "cpu"},
            device="cpu",
        )
    else:
        attributor = IFAttributorDataInf(task=task, device="cpu", regularization=1e-3)
        attributor.cache(train_loader)
    return -attributor.attribute(train_loader, query_loader).detach().double().numpy()


def gpt2_methods(c: int) -> dict[str, tuple[Any, slice, dict[str, Any]]]:
    """Method name -> (runner, checkpoints used, options)."""
    one, every = slice(0, 1), slice(0, c)
    # Of (lr, nbeta, localization) = (1e-4, 100, 100) and (3e-4, 30, 30) on checkpoint 0
    # with 2 x 50 draws: LDS -0.03 in 113 s and 0.16 in 78 s (load ~7). Opt-in (--only bif).
    bif = dict(
        num_chains=2,
        num_draws=50,
        lr=3e-4,
        nbeta=30.0,
        localization=30.0,
        batch_size=32,
        eval_batch_size=128,
    )
    return {
        "gradsketch trak k=512 (1 ckpt)": (run_lm_trak, one, {}),
        f"gradsketch trak k=512 ({c} ckpts)": (run_lm_trak, every, {}),
        "gradsketch identity": (run_lm_influence, every, {"method": "identity"}),
        "gradsketch kfac": (run_lm_influence, every, {"method": "kfac", "lambda_reg": "auto"}),
        "gradsketch ekfac": (run_lm_influence, every, {"method": "ekfac", "lambda_reg": "auto"}),
        "gradsketch ekfac (1 ckpt)": (
            run_lm_influence,
            one,
            {"method": "ekfac", "lambda_reg": "auto"},
        ),
        "gradsketch ekfac curvature=sampled": (
            run_lm_influence,
            every,
            {"method": "ekfac", "lambda_reg": "auto", "curvature": "sampled"},
        ),
        "gradsketch kfac curvature=sampled": (
            run_lm_influence,
            every,
            {"method": "kfac", "lambda_reg": "auto", "curvature": "sampled"},
        ),
        "gradsketch ekfac without lm_head": (
            run_lm_influence,
            every,
            {"method": "ekfac", "lambda_reg": "auto", "drop_lm_head": True},
        ),
        "gradsketch ekfac projected 32x32": (
            run_lm_influence,
            every,
            {"method": "ekfac", "lambda_reg": "auto", "projection": (32, 32)},
        ),
        "gradsketch kfac curvature=sampled (1 ckpt)": (
            run_lm_influence,
            one,
            {"method": "kfac", "lambda_reg": "auto", "curvature": "sampled"},
        ),
        "gradsketch ekfac curvature=sampled (1 ckpt)": (
            run_lm_influence,
            one,
            {"method": "ekfac", "lambda_reg": "auto", "curvature": "sampled"},
        ),
        "gradsketch kfac curvature=sampled projected 32x32": (
            run_lm_influence,
            every,
            {
                "method": "kfac",
                "lambda_reg": "auto",
                "curvature": "sampled",
                "projection": (32, 32),
            },
        ),
        "gradsketch ekfac curvature=sampled projected 32x32": (
            run_lm_influence,
            every,
            {
                "method": "ekfac",
                "lambda_reg": "auto",
                "curvature": "sampled",
                "projection": (32, 32),
            },
        ),
        "gradsketch bif (1 ckpt)": (run_lm_bif, one, bif),
        "dattri tracin": (run_lm_dattri, every, {"method": "tracin"}),
        "dattri if-datainf (1 ckpt)": (run_lm_dattri, one, {"method": "datainf"}),
        "kronfluence identity": (run_lm_kronfluence, every, {"strategy": "identity"}),
        "kronfluence kfac": (run_lm_kronfluence, every, {"strategy": "kfac"}),
        "kronfluence ekfac": (run_lm_kronfluence, every, {"strategy": "ekfac"}),
        "kronfluence identity (1 ckpt)": (run_lm_kronfluence, one, {"strategy": "identity"}),
        "kronfluence ekfac (1 ckpt)": (run_lm_kronfluence, one, {"strategy": "ekfac"}),
    }


def lm_pass_floor(models, train_ids, query_ids, batch_size: int = 64) -> float:
    """Seconds of one forward and backward of every training and query chunk per checkpoint.

    The least any gradient-based method here does (Kronfluence's and
    gradsketch's alike); no scores, so no LDS.
    """
    start = time.perf_counter()
    for model in models:
        work = copy.deepcopy(model)
        for ids in (train_ids, query_ids):
            for first in range(0, int(ids.shape[0]), batch_size):
                work.zero_grad(set_to_none=True)
                _lm_loss(work, (ids[first : first + batch_size],)).sum().backward()
    return time.perf_counter() - start


def gpt2_protocol(args: argparse.Namespace) -> None:
    """HF GPT-2 on standard-library chunks: LDS and fit+score time of every method."""
    from bench_lm import _split

    import gradsketch.attribution._lm  # noqa: F401  (registers "language_modeling")
    from gradsketch.attribution import linear_datamodeling_score
    from gradsketch.demos.lm import train_lm

    s = gpt2_settings(args.quick, args.lm_lds_models)
    train_ids, query_ids = _split(s)
    seconds, (masks, outputs, cached) = time_once(
        lambda: gpt2_ground_truth(s, train_ids, query_ids, args.cache_dir)
    )
    emit(
        {
            "bench": "influence_gpt2_ground_truth",
            "lds_models": s.lds_models,
            "cached": cached,
            "seconds": seconds,
        }
    )
    models = [train_lm(train_ids, s, seed=s.seed + 1 + c)[0] for c in range(args.checkpoints)]
    only = [m.strip() for m in args.only.split(",") if m.strip()]
    emit(
        {
            "bench": "influence_gpt2",
            "method": "floor: forward + backward of every chunk",
            "checkpoints": len(models),
            "seconds": lm_pass_floor(models, train_ids, query_ids),
            "loadavg_1min": os.getloadavg()[0],
        }
    )
    with tempfile.TemporaryDirectory() as tmp:
        for name, (fn, used, kwargs) in gpt2_methods(len(models)).items():
            if only and not any(o in name for o in only):
                continue
            if "bif" in name and not any("bif" in o for o in only):
                emit({"bench": "influence_gpt2", "method": name, "skipped": "opt-in: --only bif"})
                continue
            ckpts = models[used]
            try:
                seconds, scores = time_once(
                    lambda fn=fn, ckpts=ckpts, kwargs=kwargs: fn(
                        ckpts, train_ids, query_ids, s, tmp, **dict(kwargs)
                    )
                )
            except ImportError as err:
                emit({"bench": "influence_gpt2", "method": name, "skipped": str(err)})
                continue
            except Exception as err:  # a reference package failing on the model: say how
                if not name.startswith("dattri"):
                    raise
                emit({"bench": "influence_gpt2", "method": name, "error": repr(err)[:500]})
                continue
            emit(
                {
                    "bench": "influence_gpt2",
                    "method": name,
                    "checkpoints": len(ckpts),
                    "lds": linear_datamodeling_score(scores, masks, outputs),
                    "seconds": seconds,
                    "lds_models": s.lds_models,
                    "loadavg_1min": os.getloadavg()[0],
                    "options": {k: v for k, v in kwargs.items()},
                }
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="digits: 10 retrained models; GPT-2: 128 chunks, 16 queries, 6 models",
    )
    parser.add_argument("--lds-models", type=int, default=40)
    parser.add_argument("--checkpoints", type=int, default=3)
    parser.add_argument("--only", default="", help="comma-separated method names to run")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: on a loaded shared machine two threads spin-wait on each other "
        "and every tiny matmul of this protocol takes 5-10x longer)",
    )
    parser.add_argument(
        "--protocol", choices=("digits", "gpt2", "both"), default="both", help="which protocol"
    )
    parser.add_argument(
        "--lm-lds-models", type=int, default=20, help="GPT-2 models retrained on random halves"
    )
    parser.add_argument(
        "--cache-dir", default=None, help="folder caching the GPT-2 ground truth between runs"
    )
    args = parser.parse_args(argv)
    setup_torch(args.threads)
    # Imports are not part of any method's time.
    import gradsketch.slt  # noqa: F401  (bayesian_influence lives there)

    try:
        import kronfluence.analyzer  # noqa: F401
    except ImportError:
        pass
    logging.basicConfig(level=logging.ERROR)
    lds_models = 10 if args.quick else args.lds_models
    emit({"bench": "machine", **machine_info()})
    if args.protocol != "digits":
        gpt2_protocol(args)
    if args.protocol == "gpt2":
        return
    from gradsketch.attribution import linear_datamodeling_score
    from gradsketch.demos import top_share_same_label

    x, y, xt, yt = data()
    seconds, (masks, outputs) = time_once(lambda: ground_truth(x, y, xt, yt, lds_models))
    emit({"bench": "influence_ground_truth", "lds_models": lds_models, "seconds": seconds})
    checkpoints = []
    for seed in range(args.checkpoints):
        model = train(x, y, seed)
        checkpoints.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    c = len(checkpoints)
    # Chosen on one checkpoint and 10 retrained models from nbeta in {100, 300, 1000, 3000},
    # lr in {1e-4, 3e-4, 1e-3}, localization in {30, 100, 300, 1000}, 100 or 500 draws.
    bif = dict(
        num_chains=4, num_draws=500, lr=1e-3, nbeta=1000.0, localization=1000.0, batch_size=100
    )
    methods: dict[str, tuple[Any, list, dict[str, Any]]] = {
        "gradsketch trak k=512 (1 ckpt)": (run_traker, checkpoints[:1], {"proj_dim": 512}),
        f"gradsketch trak k=512 ({c} ckpts)": (run_traker, checkpoints, {"proj_dim": 512}),
        "gradsketch identity": (run_influence, checkpoints, {"method": "identity"}),
        "gradsketch kfac": (run_influence, checkpoints, {"method": "kfac"}),
        "gradsketch ekfac": (run_influence, checkpoints, {"method": "ekfac"}),
        "gradsketch ekfac (1 ckpt)": (run_influence, checkpoints[:1], {"method": "ekfac"}),
        "gradsketch kfac curvature=sampled": (
            run_influence,
            checkpoints,
            {"method": "kfac", "curvature": "sampled"},
        ),
        "gradsketch ekfac curvature=sampled": (
            run_influence,
            checkpoints,
            {"method": "ekfac", "curvature": "sampled"},
        ),
        "gradsketch kfac curvature=output": (
            run_influence,
            checkpoints,
            {"method": "kfac", "curvature": "output"},
        ),
        "gradsketch ekfac curvature=output": (
            run_influence,
            checkpoints,
            {"method": "ekfac", "curvature": "output"},
        ),
        "gradsketch ekfac projected 16x16": (
            run_influence,
            checkpoints,
            {"method": "ekfac", "projection": (16, 16)},
        ),
        "gradsketch bif": (run_bif, checkpoints, bif),
        "kronfluence identity": (run_kronfluence, checkpoints, {"strategy": "identity"}),
        "kronfluence kfac": (run_kronfluence, checkpoints, {"strategy": "kfac"}),
        "kronfluence ekfac": (run_kronfluence, checkpoints, {"strategy": "ekfac"}),
    }
    only = [m.strip() for m in args.only.split(",") if m.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        for name, (fn, ckpts, kwargs) in methods.items():
            if only and not any(o in name for o in only):
                continue
            try:
                seconds, scores = time_once(
                    lambda fn=fn, ckpts=ckpts, kwargs=kwargs: fn(ckpts, x, y, xt, yt, tmp, **kwargs)
                )
            except ImportError as err:
                emit({"bench": "influence", "method": name, "skipped": str(err)})
                continue
            lds = linear_datamodeling_score(scores, masks, outputs)
            # The main job's gallery criterion: top-5 proponents sharing the target's label.
            same = top_share_same_label(scores, y, yt, 5)
            emit(
                {
                    "bench": "influence",
                    "method": name,
                    "checkpoints": len(ckpts),
                    "lds": lds,
                    "top5_same_label": same,
                    "seconds": seconds,
                    "lds_models": lds_models,
                    "options": {k: v for k, v in kwargs.items()},
                }
            )
        dattri_rows(checkpoints, x, y, xt, yt, masks, outputs, lds_models, only)


if __name__ == "__main__":
    main()
