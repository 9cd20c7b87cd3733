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
import dataclasses
import importlib.metadata
import logging
import os
import tempfile
import time
import warnings
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from gradsketch.demos.protocols import emit, machine_info, setup_torch, time_once
from gradsketch.demos.protocols.influence import (
    KRONFLUENCE_DEFAULT_DAMPING,
    N_TARGETS,
    N_TRAIN,
    build,
    data,
    digits_kronfluence,
    gpt2_ground_truth,
    gpt2_settings,
    ground_truth,
    lm_kronfluence,
    lm_loss,
    lm_split,
    run_bif,
    run_influence,
    run_lm_bif,
    run_lm_influence,
    run_lm_trak,
    run_traker,
    train,
)


# -- Kronfluence -------------------------------------------------------------------------
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
        # LoGra's cost against the exact rows (issue 49 item 4): k = 16 is the scale default.
        **{
            f"gradsketch ekfac projected {k}x{k}": (
                run_lm_influence,
                every,
                {"method": "ekfac", "lambda_reg": "auto", "projection": (k, k)},
            )
            for k in (16, 64)
        },
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
                lm_loss(work, (ids[first : first + batch_size],)).sum().backward()
    return time.perf_counter() - start


def _selects(option: str, name: str) -> bool:
    """``--only`` entry ``option`` picks ``name``: a part of it, or (``=name``) exactly it."""
    return option[1:] == name if option.startswith("=") else option in name


def gpt2_protocol(args: argparse.Namespace) -> None:
    """HF GPT-2 on standard-library chunks: LDS and fit+score time of every method."""

    import gradsketch.attribution._lm  # noqa: F401  (registers "language_modeling")
    from gradsketch.attribution import linear_datamodeling_interval, linear_datamodeling_score
    from gradsketch.demos.lm import train_lm

    s = gpt2_settings(args.quick, args.lm_lds_models)
    if args.quick and args.quick_lm_lds_models is not None:
        s = dataclasses.replace(s, lds_models=args.quick_lm_lds_models)
    train_ids, query_ids = lm_split(s)
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
    # Scores of the exact rows, kept for the paired LDS of each projection against them.
    exact: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (fn, used, kwargs) in gpt2_methods(len(models)).items():
            if only and not any(_selects(o, name) for o in only):
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
            row = {
                "bench": "influence_gpt2",
                "method": name,
                "checkpoints": len(ckpts),
                "lds": linear_datamodeling_score(scores, masks, outputs),
                "seconds": seconds,
                "lds_models": s.lds_models,
                "loadavg_1min": os.getloadavg()[0],
                "options": {k: v for k, v in kwargs.items()},
            }
            base_name = name.split(" projected ")[0]
            if " projected " not in name:
                exact[name] = scores
            elif base_name in exact:
                paired = linear_datamodeling_interval(
                    scores, masks, outputs, baseline_scores=exact[base_name]
                )
                row["paired_vs"] = base_name
                row["lds_minus_exact"] = list(paired)
            emit(row)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="digits: 10 retrained models; GPT-2: 128 chunks, 16 queries, 6 models",
    )
    parser.add_argument("--lds-models", type=int, default=40)
    parser.add_argument("--checkpoints", type=int, default=3)
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated parts of method names to run ('=name': exactly that method)",
    )
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
        "--quick-lm-lds-models",
        type=int,
        default=None,
        help="GPT-2 models retrained on random halves under --quick (default 6)",
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
