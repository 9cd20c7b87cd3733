"""Metagradients by replaying training (MAGIC): LDS and cost beside EK-FAC, TRAK and bergson.

Run ``python benchmarks/bench_replay.py`` (``--quick`` for a smoke run at
small sizes; ``--protocol lm`` for the language-model protocol; ``--part
bergson`` for the side-by-side with bergson's MAGIC). Prints one JSON line per
measurement and a closing table.

Protocols (``--protocol``):

- ``digits``: ``make demo``'s. The digits MLP (64-256-256-10) trained by SGD
  (momentum 0.9, weight decay 5e-4, cosine learning rate from 0.05, batch 64)
  for ``--epochs`` epochs; query output the classification margin.
- ``lm``: ``make demo-lm``'s. Its GPT-2 (2 layers, width 64, 2 heads, eager
  attention) on 64-byte chunks of standard-library files, AdamW (lr 1e-3
  decaying linearly to 0, weight decay 0.01, batch 8); query output the
  summed log-likelihood of a held-out chunk, the quantity the demo's LDS
  measures (a ``language_modeling`` task whose output is that sum).
- ``lm-finetune``: the same GPT-2, rows, queries and loop as a fine-tune,
  MAGIC's setting: the model first trains on ``--pretrain-chunks`` other
  chunks of the corpus (``--pretrain-epochs`` epochs of the demo's AdamW at
  ``lr=1e-3``), then every run (the replayed one, every retrain, the model the
  other methods score) starts from those weights and trains on the
  protocol's rows at ``--lr`` (1e-4 by default, a tenth of the pretraining
  rate). A fresh seed there changes the batch order only.

Either way the replayed run is exactly the protocol's torch loop
(:class:`~gradsketch.attribution.ReplayAttributor` with the protocol's seed
fixes the same initialization and batch order). LDS over ``--lds-models``
random halves (100 by default: on the digits 30, the demo's number, resolve
the LDS to about ±0.01; on the GPT-2 trained from scratch 20 halves scored
the replay 0.82 where 1,200 others gave 0.72), in two settings:

- (a) ``same-run``: MAGIC's setting. Each half is the replayed run itself
  with the left-out rows' weights set to 0 (same initialization, same batch
  order, batches keep their size): what the metagradient is exact for.
- (b) ``fresh-seeds``: the demo's protocol: each half trained by the torch
  loop from a fresh seed (initialization and order), how the other methods
  are judged. Beside the single run's metagradients, their average over
  ``--seeds`` replayed runs with different seeds.

The metagradients are taken at ``w = a·1`` for each ``--linearize-at`` value
``a`` (0.5, the centre of random halves, 0.25 and 1.0, the ordinary run, by
default); the averages over seeds use the first. Two more averages of one
run's metagradients: over the points ``--mean-of`` (0.25 and 0.5), and over
``--bases`` random halves' 0/1 masks given as per-row ``linearize_at`` (drawn
apart from the evaluation's halves); and a mean over ``--seed-bases`` runs, each
with a fresh seed and its own random half's mask, aimed at setting (b). The
other methods, TRAK, identity, K-FAC and EK-FAC (:data:`OTHER_METHODS`;
``lambda_reg=0`` for TRAK and identity on digits, ``"auto"`` otherwise),
score the ordinary run's final model (one checkpoint) in the same run,
against the same ground truths, each timed on its own (``--no-others`` skips them).
Every LDS comes with a bootstrap 95 % interval over the retrains, and each
replay row with its paired difference to the best other method of each
setting (:func:`~gradsketch.attribution.linear_datamodeling_interval`).

Ceiling (``--part ceiling``): how high any linear attribution can score. In
each setting a ridge datamodel fitted to ``--fit-models`` other retrains on
random halves, scored beside the replay (at the first ``--linearize-at``)
on the evaluation's halves and on halves held out of the fit; and the seed
noise of setting (b): ``--seed-pairs`` halves each trained from two fresh
seeds, whose outputs' correlation bounds every predictor's.

Removal (``--part removal``): the same-run LDS when the retrains keep a
fraction ``α`` of the rows (``--keep``, default 0.5, 0.9, 0.99), the run
linearized at ``w = α·1``: how far from ``w = 1`` the metagradient stays
linear.

Cost (``--part cost``): wall and process CPU time of training (with
checkpoints), and of the reverse pass per query as the block of queries ``m``
grows (``--cost-m``), in units of one plain training run. ``--device cuda``
trains the replays (and bergson, below) on the GPU; the rows follow the model.

bergson (``--part bergson``, needs ``pip install --no-deps bergson==2.5.1``
and its light dependencies, see ``requirements-refs.txt``): bergson's MAGIC
trainer (``bergson.magic.Trainer``: a functional torchopt trainer that keeps
``√T`` checkpoints with ``torch.distributed.checkpoint`` and reverses one
query cotangent per backward) on the same model, data, batch order, per-step
learning rates and optimizer (torchopt's SGD / AdamW), the same weighted loss
``Σ w_i ℓ_i / |B|`` and, as its backward's seed, the gradient of the same
query output at its own final parameters. bergson runs its queries one per
backward (its per-query mode reuses the forward's checkpoints); gradsketch is
timed for one query and for a block of 16 in one reverse pass. Reported: wall
and CPU seconds of both, their ratio for 16 queries, the largest difference of
the two trainings' final parameters and the correlation of the two libraries'
metagradients for the same query.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, machine_info, setup_torch

from gradsketch.attribution import (
    ReplayAttributor,
    ReplaySettings,
    linear_datamodeling_interval,
    linear_datamodeling_score,
)
from gradsketch.attribution._lm import LanguageModelingModelOutput, _call_model

PROTOCOLS = ("digits", "lm", "lm-finetune")
PARTS = ("all", "lds", "cost", "bergson", "removal", "ops", "ceiling")
#: The other attribution methods scored beside the replay, each timed on its own.
OTHER_METHODS = ("trak", "identity", "kfac", "ekfac")


@dataclass(frozen=True)
class Sizes:
    """Sizes of one benchmark run (``num_train`` onwards: the language-model protocols only).

    ``pretrain_chunks`` > 0 makes the run a fine-tune of a model pretrained on
    that many other chunks; ``lr`` 0 keeps the demo's rate.
    """

    epochs: int = 20
    num_targets: int = 32
    lds_models: int = 30
    seeds: int = 3
    cost_m: tuple[int, ...] = (1, 8, 32)
    num_train: int = 0
    chunk_len: int = 64
    bergson_queries: int = 2
    warmup_steps: int = 0
    pretrain_chunks: int = 0
    pretrain_epochs: int = 3
    lr: float = 0.0


#: Full and ``--quick`` sizes of each protocol.
SIZES: dict[str, dict[bool, Sizes]] = {
    "digits": {
        False: Sizes(lds_models=100),
        True: Sizes(epochs=1, num_targets=4, lds_models=4, seeds=2, cost_m=(1, 4)),
    },
    "lm": {
        False: Sizes(
            epochs=2, num_targets=16, lds_models=100, seeds=2, cost_m=(1, 16), num_train=192
        ),
        True: Sizes(
            epochs=1,
            num_targets=4,
            lds_models=4,
            seeds=2,
            cost_m=(1, 4),
            num_train=64,
            chunk_len=32,
        ),
    },
}
SIZES["lm-finetune"] = {
    quick: dataclasses.replace(
        sizes, pretrain_chunks=128 if quick else 1024, pretrain_epochs=1 if quick else 3, lr=1e-4
    )
    for quick, sizes in SIZES["lm"].items()
}


def lds(scores: Any, truth: tuple[np.ndarray, np.ndarray]) -> float:
    """Rounded LDS of ``scores`` against ``(masks, outputs)``."""
    return round(float(linear_datamodeling_score(np.asarray(scores), *truth)), 4)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """``(wall seconds, process CPU seconds, result)`` of one call (CUDA work finished)."""
    _sync()
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    _sync()
    return time.perf_counter() - t0, time.process_time() - c0, out


# -- protocols ----------------------------------------------------------------------------
class SequenceLogLikelihood(LanguageModelingModelOutput):
    """``language_modeling`` with the output ``Σ_{t≥1} log p(x_t | x_<t)`` of the whole chunk.

    The demo's LDS measures this sum (``sequence_log_likelihood``); the
    training loss is the task's (mean next-token cross-entropy).
    """

    @staticmethod
    def get_output(
        model: nn.Module, weights: dict[str, Tensor], buffers: dict[str, Tensor], *example: Any
    ) -> Tensor:
        ids, mask, labels = example
        logits = _call_model(
            model, (weights, buffers), {"input_ids": ids[None], "attention_mask": mask[None]}
        )
        logp = logits[0, :-1].log_softmax(-1)
        return logp.gather(-1, labels[1:, None]).sum()


@dataclass
class Protocol:
    """One attribution protocol: its data, its replayable run and its ground truths."""

    name: str
    sizes: Sizes
    train_data: tuple[Tensor, ...]
    targets: tuple[Tensor, ...]
    task: Any
    build: Callable[[int], nn.Module]
    settings: Callable[[int], ReplaySettings]
    torch_train: Callable[[int], dict[str, Tensor]]
    fresh_truth: Callable[[bool], tuple[np.ndarray, np.ndarray]]
    #: ``others(final, save_dir, progress, method)``: one of :data:`OTHER_METHODS`' scores
    #: ``[n_train, n_targets]`` on the ordinary run's final model.
    others: Callable[[dict[str, Tensor], Path, bool, str], np.ndarray]
    per_example_loss: Callable[..., Tensor]
    #: ``fresh_train(rows, seed)``: the protocol's torch loop on ``rows`` from ``seed``;
    #: the queries' outputs ``[n_targets]`` (the ceiling part's datamodels and seed pairs).
    fresh_train: Callable[[np.ndarray, int], np.ndarray]
    base_seed: int = 0
    #: Where the replays (and bergson) train: the model goes there, the rows follow it.
    device: str = "cpu"

    @property
    def n_train(self) -> int:
        return int(self.train_data[0].shape[0])

    def run(self, seed: int, linearize_at: Any = 1.0, progress: bool = False) -> ReplayAttributor:
        settings = dataclasses.replace(self.settings(seed), linearize_at=linearize_at)
        return ReplayAttributor(
            self.build(seed).to(self.device),
            self.task,
            self.train_data,
            settings,
            progress=progress,
        )


def digits_protocol(sizes: Sizes) -> Protocol:
    """``make demo``'s digits MLP protocol."""
    from gradsketch.demos._attribution import (
        DemoSettings,
        attribute_digits,
        digits_lds_ground_truth,
        margins,
    )
    from gradsketch.demos._digits import (
        TrainSettings,
        build_model,
        load_digits_split,
        replay_settings,
        train_digits_model,
    )

    split = load_digits_split(seed=0)
    train = TrainSettings(epochs=sizes.epochs)
    targets = (split.x_test[: sizes.num_targets], split.y_test[: sizes.num_targets])
    demo = DemoSettings(
        num_targets=sizes.num_targets, lds_models=sizes.lds_models, train=train, seed=0
    )

    def torch_train(seed: int) -> dict[str, Tensor]:
        model = train_digits_model(split.x_train, split.y_train, seed=seed, settings=train)
        return {n: p.detach() for n, p in model.named_parameters()}

    def others(final: dict[str, Tensor], tmp: Path, progress: bool, name: str) -> np.ndarray:
        ckpt = [{k: v.clone() for k, v in final.items()}]
        scores, _ = attribute_digits(
            ckpt,
            split,
            demo,
            save_dir=tmp / name,
            lambda_reg=0.0 if name in ("trak", "identity") else "auto",
            progress=progress,
            method=name,
        )
        return np.asarray(scores)

    def loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        return nn.functional.cross_entropy(model(x), y, reduction="none")

    return Protocol(
        name="digits",
        sizes=sizes,
        train_data=(split.x_train, split.y_train),
        targets=targets,
        task="image_classification",
        build=lambda seed: build_model("mlp", seed=seed),
        settings=lambda seed: replay_settings(split.n_train, train, seed=seed),
        torch_train=torch_train,
        fresh_truth=lambda progress: digits_lds_ground_truth(
            split, *targets, demo, progress=progress
        ),
        others=others,
        per_example_loss=loss,
        fresh_train=lambda rows, seed: np.asarray(
            margins(
                train_digits_model(
                    split.x_train[torch.as_tensor(rows)],
                    split.y_train[torch.as_tensor(rows)],
                    seed=seed,
                    settings=train,
                ),
                *targets,
            )
        ),
    )


def lm_protocol(sizes: Sizes) -> Protocol:
    """``make demo-lm``'s GPT-2 protocol (eager attention: sdpa has no double backward).

    With ``sizes.pretrain_chunks``, the fine-tune of a model pretrained on
    other chunks of the corpus (``lm-finetune``).
    """
    from gradsketch.demos._lm_corpus import load_corpus, split_chunks
    from gradsketch.demos.lm import (
        LMDemoSettings,
        build_lm,
        lds_truth,
        lr_multiplier,
        sequence_log_likelihood,
        train_lm,
    )

    demo = LMDemoSettings()
    s = LMDemoSettings(
        lr=sizes.lr or demo.lr,
        num_train=sizes.num_train,
        num_queries=sizes.num_targets,
        chunk_len=sizes.chunk_len,
        epochs=sizes.epochs,
        lds_models=sizes.lds_models,
        proj_dim=512 if sizes.num_train >= 512 else 128,
        num_checkpoints=1,
        warmup_steps=sizes.warmup_steps,
    )
    corpus = load_corpus(s.modules, chunk_len=s.chunk_len)
    train_idx, query_idx = split_chunks(len(corpus), s.num_train, s.num_queries, seed=s.seed)
    train_ids, query_ids = corpus.token_ids(train_idx), corpus.token_ids(query_idx)
    base: dict[str, Tensor] | None = None
    if sizes.pretrain_chunks:
        rest = np.setdiff1d(np.arange(len(corpus)), np.concatenate([train_idx, query_idx]))
        pick = np.random.default_rng(s.seed + 7).choice(
            rest, size=min(sizes.pretrain_chunks, len(rest)), replace=False
        )
        pre = dataclasses.replace(
            s, lr=demo.lr, epochs=sizes.pretrain_epochs, warmup_steps=0, num_train=len(pick)
        )
        pretrained = train_lm(corpus.token_ids(np.sort(pick)), pre, seed=s.seed + 100)[0]
        base = {k: v.detach().clone() for k, v in pretrained.state_dict().items()}

    def lm_batch(ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return ids, torch.ones_like(ids), ids.clone()

    def build(seed: int) -> nn.Module:
        model = build_lm(s, seed=seed)
        if base is not None:
            model.load_state_dict(base)
        model.set_attn_implementation("eager")
        return model

    def settings(seed: int) -> ReplaySettings:
        steps = math.ceil(s.num_train / s.batch_size) * s.epochs
        return ReplaySettings(
            optimizer="adamw",
            lr=[s.lr * lr_multiplier(t, steps, s.warmup_steps) for t in range(steps)],
            num_steps=steps,
            batch_size=s.batch_size,
            weight_decay=s.weight_decay,
            seed=seed,
        )

    def torch_train(seed: int) -> dict[str, Tensor]:
        model = train_lm(train_ids, s, seed=seed, init_state=base)[0]
        return {n: p.detach() for n, p in model.named_parameters()}

    def fresh_truth(progress: bool) -> tuple[np.ndarray, np.ndarray]:
        truth = lds_truth(s, train_ids, query_ids, progress=progress, init_state=base)
        return truth.subset_masks, truth.target_outputs

    def others(final: dict[str, Tensor], tmp: Path, progress: bool, name: str) -> np.ndarray:
        import logging

        from gradsketch.attribution import HookGradientComputer, TRAKer

        model = build(s.seed + 1)
        model.load_state_dict(final, strict=False)
        traker = TRAKer(
            model,
            "language_modeling",
            s.num_train,
            save_dir=str(tmp / name),
            load_from_save_dir=False,
            device="cpu",
            gradient_computer=HookGradientComputer,
            proj_dim=s.proj_dim,
            projector_seed=s.seed,
            lambda_reg="auto",
            progress=progress,
            logging_level=logging.WARNING,
            method=name,
        )
        state = model.state_dict()
        traker.load_checkpoint(state, model_id=0)
        bs = s.featurize_batch_size
        for start in range(0, s.num_train, bs):
            batch = lm_batch(train_ids[start : start + bs])
            traker.featurize(batch, num_samples=int(batch[0].shape[0]))
        traker.finalize_features()
        traker.start_scoring_checkpoint("q", state, model_id=0, num_targets=s.num_queries)
        for start in range(0, s.num_queries, bs):
            batch = lm_batch(query_ids[start : start + bs])
            traker.score(batch, num_samples=int(batch[0].shape[0]))
        return np.asarray(traker.finalize_scores("q"))

    def loss(model: nn.Module, ids: Tensor, mask: Tensor, labels: Tensor) -> Tensor:
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        logp = logits.log_softmax(-1).gather(-1, labels[:, 1:, None]).squeeze(-1)
        return -logp.mean(1)

    return Protocol(
        name="lm-finetune" if base is not None else "lm",
        sizes=sizes,
        train_data=lm_batch(train_ids),
        targets=lm_batch(query_ids),
        task=SequenceLogLikelihood(),
        build=build,
        settings=settings,
        torch_train=torch_train,
        fresh_truth=fresh_truth,
        others=others,
        per_example_loss=loss,
        fresh_train=lambda rows, seed: sequence_log_likelihood(
            train_lm(train_ids[torch.as_tensor(rows)], s, seed=seed, init_state=base)[0], query_ids
        ),
        base_seed=s.seed + 1,
    )


# -- LDS ----------------------------------------------------------------------------------
def subset_mask(rng: np.random.Generator, n: int, keep: float = 0.5) -> np.ndarray:
    """``[n]`` bool mask of a random subset of ``round(keep · n)`` rows."""
    mask = np.zeros(n, dtype=bool)
    mask[rng.choice(n, size=round(keep * n), replace=False)] = True
    return mask


def same_run_truth(
    run: ReplayAttributor,
    targets: tuple[Tensor, ...],
    num_models: int,
    seed: int,
    keep: float = 0.5,
) -> tuple[np.ndarray, np.ndarray]:
    """Setting (a): the replayed run with random subsets' complements weighted 0.

    Each subset keeps ``round(keep · n)`` rows (halves by default).
    """
    rng = np.random.default_rng(seed)
    n = run.n_train
    masks = np.stack([subset_mask(rng, n, keep) for _ in range(num_models)])
    outputs = []
    for i in range(num_models):
        weights = torch.from_numpy(masks[i].astype(np.float32))
        outputs.append(run.outputs(targets, run.retrain(weights)).double().cpu().numpy())
    return masks, np.stack(outputs)


def run_lds(
    p: Protocol,
    linearize_at: tuple[float, ...],
    *,
    mean_of: tuple[float, ...] = (),
    bases: int = 0,
    seed_bases: int = 0,
    others: bool,
    progress: bool,
) -> dict[str, Any]:
    """LDS of the replay at each linearization point, its averages and the others.

    Averages: over ``sizes.seeds`` seeds at the first point; over the points
    ``mean_of`` (the same run's metagradients at each, averaged); over
    ``bases`` random halves' 0/1 masks as per-row ``linearize_at`` (drawn
    independently of the evaluation's halves); over ``seed_bases`` runs that
    each take a fresh seed and their own random half's mask.
    """
    sizes = p.sizes
    summary: dict[str, Any] = {}
    methods: dict[str, np.ndarray] = {}
    # CPU seconds of each method's scores: a replay's training and reverse pass (all
    # of its runs for an average), another method's featurizing and scoring.
    cpu: dict[str, float] = {}
    summary["cpu_s"] = cpu
    at_point: dict[float, tuple[np.ndarray, float]] = {}
    first: ReplayAttributor | None = None

    def metagradients(seed: int, at: Any, label: Any) -> tuple[np.ndarray, float]:
        """One replayed run's metagradients and its CPU seconds (training and reverse)."""
        nonlocal first
        r = p.run(seed, at, progress=progress)
        t_train, c_train, _ = timed(r.train)
        t_rev, c_rev, g = timed(lambda: r.metagradients(p.targets).cpu().numpy())
        first = r if first is None else first
        emit(
            {
                "bench": "replay",
                "protocol": p.name,
                "part": "run",
                "seed": seed,
                "linearize_at": label,
                "steps": r.settings.num_steps,
                "checkpoint_every": r.every,
                "train_s": t_train,
                "train_cpu_s": c_train,
                "reverse_s": t_rev,
                "reverse_cpu_s": c_rev,
                "queries": sizes.num_targets,
                "memory_bytes": r.memory_estimate(sizes.num_targets).total,
            }
        )
        return g, c_train + c_rev

    def add(name: str, runs: list[tuple[np.ndarray, float]]) -> None:
        """Method ``name``: the mean of ``runs``' metagradients, at the sum of their cost."""
        methods[name] = np.mean([g for g, _ in runs], axis=0)
        cpu[name] = sum(c for _, c in runs)

    for a in dict.fromkeys((*linearize_at, *mean_of)):
        runs = [
            metagradients(p.base_seed + k, a, a)
            for k in range(sizes.seeds if a == linearize_at[0] else 1)
        ]
        at_point[a] = runs[0]
        if a in linearize_at:
            add(f"replay@{a:g}", runs[:1])
        if len(runs) > 1:
            add(f"replay@{a:g}-mean{len(runs)}", runs)
    if mean_of:
        label = ",".join(f"{a:g}" for a in mean_of)
        add(f"replay@mean({label})", [at_point[a] for a in mean_of])

    def at_halves(count: int, draws: int, fresh_seeds: bool) -> list[tuple[np.ndarray, float]]:
        """``count`` runs, each at its own random half's 0/1 mask (drawn from ``draws``),
        from the base seed or, with ``fresh_seeds``, from a fresh seed each."""
        rng = np.random.default_rng(draws)
        runs = []
        for k in range(count):
            mask = subset_mask(rng, p.n_train).astype(np.float64)
            seed = p.base_seed + 1 + k if fresh_seeds else p.base_seed
            label = f"seed {k}, half {k}" if fresh_seeds else f"half {k}"
            runs.append(metagradients(seed, mask, label))
        return runs

    if bases:
        add(f"replay@halves-mean{bases}", at_halves(bases, 20_000, fresh_seeds=False))
    if seed_bases:
        add(
            f"replay@seeds-halves-mean{seed_bases}", at_halves(seed_bases, 30_000, fresh_seeds=True)
        )
    assert first is not None
    ordinary = first.retrain(torch.ones(first.n_train))
    reference = p.torch_train(p.base_seed)
    summary["replay_vs_torch_loop_max_abs"] = max(
        float((ordinary[n] - v).abs().max()) for n, v in reference.items()
    )
    emit(
        {
            "bench": "replay",
            "protocol": p.name,
            "part": "loop",
            "replay_vs_torch_loop_max_abs": summary["replay_vs_torch_loop_max_abs"],
        }
    )
    truth_a = same_run_truth(first, p.targets, sizes.lds_models, seed=10_000)
    _, _, truth_b = timed(lambda: p.fresh_truth(progress))
    table: dict[str, dict[str, Any]] = {}
    summary["lds"] = table
    scored: dict[str, np.ndarray] = {}
    truths = {"same-run": truth_a, "fresh-seeds": truth_b}

    def report(name: str, s: np.ndarray) -> None:
        scored[name] = s
        table[name] = {}
        for setting, truth in truths.items():
            est, low, high = linear_datamodeling_interval(s, *truth)
            table[name][setting] = round(est, 4)
            table[name][f"{setting}_ci95"] = [round(low, 4), round(high, 4)]
        emit({"bench": "replay", "protocol": p.name, "part": "lds", "method": name, **table[name]})

    for name, s in methods.items():
        report(name, s)
    if others:
        for name in OTHER_METHODS:
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    t, c, scores = timed(
                        lambda name=name: p.others(ordinary, Path(tmp), progress, name)
                    )
                except Exception as exc:  # report the failure, keep the other methods' rows
                    summary.setdefault("others_error", {})[name] = repr(exc)
                    emit(
                        {
                            "bench": "replay",
                            "protocol": p.name,
                            "part": "lds",
                            "method": name,
                            "error": repr(exc),
                        }
                    )
                    continue
            cpu[name] = c
            emit(
                {
                    "bench": "replay",
                    "protocol": p.name,
                    "part": "other-cost",
                    "method": name,
                    "s": t,
                    "cpu_s": c,
                    "queries": sizes.num_targets,
                    "models_scored": 1,
                }
            )
            report(name, scores)
        summary["lds_diff"] = compare_with_best_other(p.name, table, scored, truths)
    return summary


def compare_with_best_other(
    protocol: str,
    table: dict[str, dict[str, Any]],
    scored: dict[str, np.ndarray],
    truths: dict[str, tuple[np.ndarray, np.ndarray]],
) -> dict[str, dict[str, Any]]:
    """Each replay row minus the best other method, per setting, with a paired 95 % interval.

    The interval resamples the retrains (the queries kept): one that holds 0
    means these retrains do not tell the two apart.
    """
    diffs: dict[str, dict[str, Any]] = {}
    others = [m for m in OTHER_METHODS if m in scored]
    if not others:
        return diffs
    for setting, truth in truths.items():
        best = max(others, key=lambda m: table[m][setting])
        for name in scored:
            if name in OTHER_METHODS:
                continue
            est, low, high = linear_datamodeling_interval(
                scored[name], *truth, baseline_scores=scored[best]
            )
            row = {"minus": best, "diff": round(est, 4), "ci95": [round(low, 4), round(high, 4)]}
            diffs.setdefault(name, {})[setting] = row
            emit(
                {
                    "bench": "replay",
                    "protocol": protocol,
                    "part": "lds-diff",
                    "method": name,
                    "setting": setting,
                    **row,
                }
            )
    return diffs


def run_removal(p: Protocol, keeps: tuple[float, ...]) -> dict[str, float]:
    """Same-run LDS as the retrains keep more of the data: the metagradient's linear range.

    For each fraction ``α`` in ``keeps``: the run's metagradients at
    ``w = α·1`` against ``lds_models`` same-run retrains on random subsets of
    ``α·n`` rows (setting (a) with smaller removals than halves).
    """
    table: dict[str, float] = {}
    for keep in keeps:
        r = p.run(p.base_seed, keep)
        r.train()
        scores = r.metagradients(p.targets).cpu().numpy()
        truth = same_run_truth(r, p.targets, p.sizes.lds_models, seed=10_000, keep=keep)
        table[f"{keep:g}"] = lds(scores, truth)
        emit(
            {
                "bench": "replay",
                "protocol": p.name,
                "part": "removal",
                "keep": keep,
                "linearize_at": keep,
                "same-run": table[f"{keep:g}"],
            }
        )
    return table


def ridge_datamodel(masks: np.ndarray, outputs: np.ndarray) -> tuple[np.ndarray, float]:
    """A linear datamodel ``[n_train, n_targets]`` fitted to ``(masks, outputs)`` by ridge.

    The ridge ``λ`` is chosen from :data:`RIDGES` on the last fifth of the
    rows (fitted on the rest), then the model is refitted on all of them.
    Halves of one size leave the coefficients' common offset free (every
    mask sums to the same count); the ridge takes the smallest, which no
    LDS sees.
    """
    if len(masks) < 15:
        raise ValueError(
            f"a datamodel needs at least 15 retrains (its held-out fifth ranks 3), got "
            f"{len(masks)}; pass --fit-models 20 or more"
        )
    x, y = masks.astype(np.float64), outputs.astype(np.float64)

    def fit(x: np.ndarray, y: np.ndarray, lam: float) -> np.ndarray:
        xc, yc = x - x.mean(0), y - y.mean(0)
        beta: np.ndarray = np.linalg.solve(xc.T @ xc + lam * np.eye(x.shape[1]), xc.T @ yc)
        return beta

    (x_fit, y_fit), held = held_out_fifth(x, y)
    best = max(RIDGES, key=lambda lam: lds(fit(x_fit, y_fit, lam), held))
    return fit(x, y, best), best


def held_out_fifth(
    masks: np.ndarray, outputs: np.ndarray
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """``(masks, outputs)`` split into its first four fifths and its last fifth."""
    cut = len(masks) * 4 // 5
    return (masks[:cut], outputs[:cut]), (masks[cut:], outputs[cut:])


def seed_noise_bound(first: np.ndarray, second: np.ndarray) -> tuple[float, float]:
    """``(mean ρ, mean √ρ)`` over targets of two seeds' outputs ``[halves, n_targets]``.

    Write one seed's output on half ``S`` as ``f(S) + ε`` with ``ε`` the
    seed's part, independent across seeds, mean 0. Across halves the two
    seeds' outputs then have covariance ``Var f`` and correlation
    ``ρ = Var f / (Var f + Var ε)``. Any predictor ``p(S)`` of one seed's
    output has ``corr(p, f + ε) = corr(p, f) · √ρ ≤ √ρ``, the seed average
    ``f`` itself included. Negative ``ρ`` (noise) counts as 0.
    """
    rho = np.array([np.corrcoef(first[:, j], second[:, j])[0, 1] for j in range(first.shape[1])])
    return float(rho.mean()), float(np.sqrt(np.clip(rho, 0.0, 1.0)).mean())


#: Ridge strengths the ceiling's datamodels choose from.
RIDGES = (0.1, 1.0, 10.0, 100.0, 1000.0)


def run_ceiling(p: Protocol, linearize_at: float, fit_models: int, pairs: int) -> dict[str, Any]:
    """How high any linear attribution can score on the protocol, beside the replay.

    Per setting, a linear datamodel (:func:`ridge_datamodel`) fitted to
    ``fit_models`` retrains on random halves other than the evaluation's,
    scored on the evaluation's halves and on a fifth of its own halves held
    out of the fit: what ``fit_models`` retrains buy, the empirical ceiling of
    a linear method. Setting (a) retrains the replayed run with 0/1 weights;
    setting (b) trains fresh seeds by the protocol's torch loop. For (b) also
    the seed noise: ``pairs`` halves each trained from two fresh seeds, whose
    outputs' correlation ``ρ`` bounds every predictor's (Pearson) correlation
    with one seed's outputs by ``√ρ`` (:func:`seed_noise_bound`); the LDS is
    Spearman's, which the bound describes only roughly.
    """
    sizes = p.sizes
    r = p.run(p.base_seed, linearize_at)
    r.train()
    replay = r.metagradients(p.targets).cpu().numpy()
    rng = np.random.default_rng(40_000)

    def fresh(num: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        masks = np.stack([subset_mask(rng, p.n_train) for _ in range(num)])
        outs = [p.fresh_train(np.flatnonzero(mk), seed + i) for i, mk in enumerate(masks)]
        return masks, np.stack(outs)

    truths = {
        "same-run": (
            same_run_truth(r, p.targets, sizes.lds_models, seed=10_000),
            same_run_truth(r, p.targets, fit_models, seed=20_000),
        ),
        "fresh-seeds": (p.fresh_truth(False), fresh(fit_models, 50_000)),
    }
    summary: dict[str, Any] = {"linearize_at": linearize_at, "fit_models": fit_models}
    for setting, (evaluation, (masks, outputs)) in truths.items():
        beta, lam = ridge_datamodel(masks, outputs)
        fit, held = held_out_fifth(masks, outputs)
        own, _ = ridge_datamodel(*fit)
        row = {
            "replay": lds(replay, evaluation),
            "datamodel": lds(beta, evaluation),
            "ridge": lam,
            # On the fit set's held-out fifth, more halves than the evaluation's.
            "replay_held_out": lds(replay, held),
            "datamodel_held_out": lds(own, held),
        }
        summary[setting] = row
        emit({"bench": "replay", "protocol": p.name, "part": "ceiling", "setting": setting, **row})
    rng_pairs = np.random.default_rng(60_000)
    outs = np.zeros((2, pairs, sizes.num_targets))
    for h in range(pairs):
        rows = np.flatnonzero(subset_mask(rng_pairs, p.n_train))
        for k in range(2):
            outs[k, h] = p.fresh_train(rows, 70_000 + 2 * h + k)
    rho, bound = seed_noise_bound(outs[0], outs[1])
    noise = {"pairs": pairs, "seed_pair_pearson": round(rho, 4), "bound": round(bound, 4)}
    summary["seed_noise"] = noise
    emit({"bench": "replay", "protocol": p.name, "part": "ceiling", "setting": "noise", **noise})
    return summary


# -- cost ---------------------------------------------------------------------------------
def run_cost(p: Protocol, linearize_at: float) -> dict[str, Any]:
    """Wall and CPU time of one plain training run, and of the reverse pass per query block."""
    r = p.run(p.base_seed, linearize_at)
    t_train, _, _ = timed(r.train)
    t_plain, c_plain, _ = timed(r.retrain)
    # The protocol's own torch loop runs on the CPU: timed there only.
    t_torch = timed(lambda: p.torch_train(p.base_seed))[0] if p.device == "cpu" else None
    summary: dict[str, Any] = {
        "device": p.device,
        "steps": r.settings.num_steps,
        "train_with_checkpoints_s": t_train,
        "plain_train_s": t_plain,
        "plain_train_cpu_s": c_plain,
        "torch_train_s": t_torch,
    }
    cost = {}
    for m in p.sizes.cost_m:
        q = tuple(t[:m] for t in p.targets)
        dt, dc, _ = timed(lambda q=q: r.metagradients(q))
        cost[m] = {
            "reverse_s": dt,
            "reverse_cpu_s": dc,
            "per_query_s": dt / m,
            "train_runs": dt / t_plain,
            # The same in CPU seconds: on a loaded machine the wall ratio moves with the load.
            "train_runs_cpu": dc / c_plain,
        }
        emit({"bench": "replay", "protocol": p.name, "part": "cost", "m": m, **cost[m]})
    summary["cost"] = cost
    return summary


def run_ops(p: Protocol, linearize_at: float) -> dict[str, Any]:
    """Aten operations dispatched per step: training, and the reverse for each query block.

    A proxy for CUDA kernel launches, which bound small models on a GPU;
    views are counted too (they launch nothing but cost dispatch time).
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            self.ops += 1
            return func(*args, **(kwargs or {}))

    r = p.run(p.base_seed, linearize_at)
    steps = r.settings.num_steps
    with Count() as count:
        r.train()
    out: dict[str, Any] = {"train_ops_per_step": count.ops / steps}
    for m in p.sizes.cost_m:
        with Count() as count:
            r.metagradients(tuple(t[:m] for t in p.targets))
        out[f"reverse_ops_per_step_m{m}"] = count.ops / steps
        emit(
            {
                "bench": "replay",
                "protocol": p.name,
                "part": "ops",
                "m": m,
                "train_ops_per_step": out["train_ops_per_step"],
                "reverse_ops_per_step": count.ops / steps,
                "ratio": count.ops / steps / out["train_ops_per_step"],
            }
        )
    return out


# -- bergson ------------------------------------------------------------------------------
class _WeightedLoss(nn.Module):
    """``Σ w_i ℓ_i / |B|`` as a module bergson's trainer calls with one batch's keywords.

    The batch's first tensor travels as ``input_ids``: bergson divides micro-batch
    losses by a token count read from it, which is the same for every batch here.
    """

    def __init__(self, model: nn.Module, loss: Callable[..., Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, input_ids: Tensor, example_weight: Tensor, **rest: Tensor) -> Tensor:
        rows = (input_ids, *(rest[f"t{j}"] for j in range(1, len(rest) + 1)))
        losses = self.loss(self.model, *rows)
        return (example_weight * losses).sum() / input_ids.shape[0]


class _Stream:
    """The replay's batch order as the data stream bergson's ``Trainer`` iterates."""

    def __init__(self, data: tuple[Tensor, ...], order: list[Tensor], device: str) -> None:
        self.device = torch.device(device)
        self.data, self.order = tuple(t.to(self.device) for t in data), order
        self.weights = nn.Parameter(torch.ones(int(data[0].shape[0]), device=self.device))

    @property
    def requires_grad(self) -> bool:
        return self.weights.requires_grad

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        self.weights.requires_grad = value

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        idx = self.order[i]
        batch = {"input_ids": self.data[0][idx], "example_weight": self.weights[idx]}
        batch.update({f"t{j}": t[idx] for j, t in enumerate(self.data[1:], start=1)})
        return batch


def _untied(model: nn.Module) -> tuple[nn.Module, list[str]]:
    """``model`` with every tied parameter (GPT-2's ``lm_head.weight``) made a copy of its own.

    bergson's trainer keeps tied names as separate entries of its state, and
    the query gradient's ``functional_call`` refuses tied names given twice;
    both libraries then train the same untied model.
    """
    unique = {n for n, _ in model.named_parameters()}
    tied = [n for n, _ in model.named_parameters(remove_duplicate=False) if n not in unique]
    for name in tied:
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        setattr(module, leaf, nn.Parameter(getattr(module, leaf).detach().clone()))
    if tied and hasattr(model, "config"):
        model.config.tie_word_embeddings = False
    return model, tied


def run_bergson(p: Protocol, linearize_at: float) -> dict[str, Any]:
    """bergson's MAGIC and the replay on the same run: time per query, agreement."""
    import bergson
    import torchopt
    from bergson.magic import BackwardState, Trainer
    from torchopt.pytree import tree_iter

    model, untied = _untied(p.build(p.base_seed))
    model.to(p.device)
    settings = dataclasses.replace(p.settings(p.base_seed), linearize_at=linearize_at)
    r = ReplayAttributor(copy.deepcopy(model), p.task, p.train_data, settings, progress=False)
    s = r.settings
    t_train, c_train, _ = timed(r.train)
    lrs = torch.tensor(s.lr, dtype=torch.float32, device=p.device)

    def schedule(count: Any) -> Tensor:
        return lrs[count]

    if s.optimizer == "sgd":
        opt = torchopt.sgd(schedule, momentum=s.momentum, weight_decay=s.weight_decay)
    elif s.optimizer == "adamw":
        # bergson's default eps_root (1e-17, inside the square root): at 0 the reverse pass
        # through √v is 0 · ∞ for entries whose gradient is exactly 0 (unused embedding rows).
        opt = torchopt.adamw(
            schedule, betas=s.betas, eps=s.eps, eps_root=1e-17, weight_decay=s.weight_decay
        )
    else:
        raise ValueError(f"no torchopt counterpart for {s.optimizer!r} here")
    trainer, state = Trainer.initialize(
        _WeightedLoss(copy.deepcopy(model), p.per_example_loss), opt
    )
    stream = _Stream(p.train_data, r.order, p.device)
    stream.weights.data.fill_(linearize_at)
    m = p.sizes.bergson_queries
    queries = tuple(t[:m].to(p.device) for t in p.targets)
    task = r.task
    with tempfile.TemporaryDirectory() as tmp:
        tb_train, cb_train, state = timed(
            lambda: trainer.train(state, stream, save_dir=tmp, save_mode="sqrt")
        )
        final = {k.removeprefix("model."): v.detach().clone() for k, v in state.params.items()}
        ours = r._require_trained()
        params_diff = max(float((final[n] - ours[n]).abs().max()) for n in ours)
        zeros = [
            torch.zeros_like(b)
            for b in tree_iter(state.opt_state)
            if isinstance(b, torch.Tensor) and b.is_floating_point()
        ]
        theirs, tb, cb = [], 0.0, 0.0
        for j in range(m):
            example = tuple(t[j] for t in queries)

            def out(params: dict[str, Tensor], example: tuple[Tensor, ...] = example) -> Tensor:
                return task.get_output(model, params, r.buffers, *example)

            cot = torch.func.grad(out)(final)
            state.detach_()
            for k, v in final.items():
                state.params[f"model.{k}"].copy_(v)
            stream.weights.grad = None
            stream.requires_grad = True
            seed = BackwardState(
                {f"model.{k}": v for k, v in cot.items()},
                [z.clone() for z in zeros],
                torch.zeros_like(stream.weights),
            )
            dt, dc, bwd = timed(
                lambda seed=seed: trainer.backward(
                    tmp, stream, seed, state, cleanup=False, inplace=True, save_mode="sqrt"
                )
            )
            tb, cb = tb + dt, cb + dc
            theirs.append(bwd.weight_grads.detach().double().cpu())
    theirs_m = torch.stack(theirs, 1).numpy()
    r.metagradients(tuple(t[:1] for t in p.targets))  # warm-up, as bergson's first query
    t1, c1, g1 = timed(lambda: r.metagradients(tuple(t[:1] for t in p.targets)))
    q16 = tuple(t[:16] for t in p.targets)
    n16 = int(q16[0].shape[0])
    t16, c16, g16 = timed(lambda: r.metagradients(q16))
    ours_m = g16[:, :m].double().cpu().numpy()
    corr = [float(np.corrcoef(ours_m[:, j], theirs_m[:, j])[0, 1]) for j in range(m)]
    rel = float(np.abs(ours_m - theirs_m).max() / np.abs(theirs_m).max())
    per_query_b, per_query_bc = tb / m, cb / m
    record = {
        "device": p.device,
        "eps_root": 1e-17 if s.optimizer == "adamw" else None,
        "untied": untied,
        "bergson_version": bergson.__version__ if hasattr(bergson, "__version__") else "2.5.1",
        "steps": s.num_steps,
        "n_train": r.n_train,
        "parameters": sum(v.numel() for v in ours.values()),
        "linearize_at": linearize_at,
        "bergson_train_s": tb_train,
        "bergson_train_cpu_s": cb_train,
        "replay_train_s": t_train,
        "replay_train_cpu_s": c_train,
        "final_params_max_abs_diff": params_diff,
        "bergson_per_query_s": per_query_b,
        "bergson_per_query_cpu_s": per_query_bc,
        "replay_m1_s": t1,
        "replay_m1_cpu_s": c1,
        f"replay_m{n16}_s": t16,
        f"replay_m{n16}_cpu_s": c16,
        "ratio_m1": t1 / per_query_b,
        f"ratio_m{n16}": t16 / (n16 * per_query_b),
        f"ratio_m{n16}_cpu": c16 / (n16 * per_query_bc),
        "corr": corr,
        "max_rel_diff": rel,
        "agree_m1_vs_block": float((g1[:, 0] - g16[:, 0]).abs().max()),
    }
    emit({"bench": "replay", "protocol": p.name, "part": "bergson", **record})
    return record


# -- report -------------------------------------------------------------------------------
def _with_interval(value: float, interval: list[float]) -> str:
    """``0.470 [0.41, 0.52]``: a value and its 95 % interval."""
    return f"{value:.3f} [{interval[0]:.2f}, {interval[1]:.2f}]"


def format_table(summary: dict[str, Any]) -> str:
    """The closing table: LDS per method and setting, cost per query, bergson."""
    lines = [f"protocol {summary['protocol']}"]
    if "lds" in summary:
        cpu = summary.get("cpu_s", {})
        lines.append(
            f"{'method':<26}{'LDS same-run [95 %]':>24}{'LDS fresh-seeds [95 %]':>26}{'CPU s':>9}"
        )
        for name, row in summary["lds"].items():
            cost = f"{cpu[name]:>9.1f}" if name in cpu else f"{'':>9}"
            cells = "".join(
                f"{_with_interval(row[k], row[k + '_ci95']):>{w}}"
                for k, w in (("same-run", 24), ("fresh-seeds", 26))
            )
            lines.append(f"{name:<26}{cells}{cost}")
        for name, settings in summary.get("lds_diff", {}).items():
            for setting, d in settings.items():
                lines.append(
                    f"{name} minus {d['minus']}, {setting}: {_with_interval(d['diff'], d['ci95'])}"
                )
    if "removal" in summary:
        for keep, value in summary["removal"].items():
            lines.append(f"same-run LDS, subsets keeping {keep} of the rows: {value:.3f}")
    if "cost" in summary:
        c = summary["cost"]
        torch_loop = (
            "" if c["torch_train_s"] is None else f", {c['torch_train_s']:.2f} s by the torch loop"
        )
        lines.append(
            f"one training run ({c['steps']} steps) on {c['device']}: {c['plain_train_s']:.2f} s "
            f"by the replay's functional loop{torch_loop}"
        )
        for m, row in c["cost"].items():
            lines.append(
                f"m={m:<4} reverse {row['reverse_s']:.2f} s ({row['reverse_cpu_s']:.2f} CPU s), "
                f"{row['per_query_s']:.3f} s/query, {row['train_runs']:.1f} training runs "
                f"({row['train_runs_cpu']:.1f} by CPU time)"
            )
    if "ops" in summary:
        ops = summary["ops"]
        lines.append(f"aten ops per step: training {ops['train_ops_per_step']:.0f}")
        for key, value in ops.items():
            if key.startswith("reverse_ops_per_step_m"):
                m = key.removeprefix("reverse_ops_per_step_m")
                ratio = value / ops["train_ops_per_step"]
                lines.append(f"m={m:<4} reverse {value:.0f} ops per step ({ratio:.2f}x training)")
    if "ceiling" in summary:
        c = summary["ceiling"]
        for setting in ("same-run", "fresh-seeds"):
            row = c[setting]
            lines.append(
                f"{setting}: replay {row['replay']:.3f}, datamodel of {c['fit_models']} retrains "
                f"{row['datamodel']:.3f} (on held-out halves of the fit: replay "
                f"{row['replay_held_out']:.3f}, datamodel {row['datamodel_held_out']:.3f})"
            )
        n = c["seed_noise"]
        lines.append(
            f"two seeds of one half correlate {n['seed_pair_pearson']:.3f} over {n['pairs']} "
            f"halves: no predictor of one seed's outputs correlates above {n['bound']:.3f}"
        )
    if "bergson" in summary:
        b = summary["bergson"]
        n = next(k for k in b if k.startswith("ratio_m") and k != "ratio_m1" and "cpu" not in k)
        lines.append(
            f"bergson MAGIC {b['bergson_per_query_s']:.2f} s/query "
            f"({b['bergson_per_query_cpu_s']:.2f} CPU s); replay m=1 {b['replay_m1_s']:.2f} s, "
            f"{n.removeprefix('ratio_')} ratio {b[n]:.3f} (CPU {b[n + '_cpu']:.3f}); "
            f"corr {min(b['corr']):.6f}, params diff {b['final_params_max_abs_diff']:.2e}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--protocol", choices=PROTOCOLS, default="digits")
    parser.add_argument("--part", choices=PARTS, default="all", help="all: lds and cost")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--num-train", type=int, default=None, help="lm: training chunks")
    parser.add_argument("--num-targets", type=int, default=None)
    parser.add_argument("--lds-models", type=int, default=None)
    parser.add_argument("--seeds", type=int, default=None, help="replayed runs averaged in (b)")
    parser.add_argument(
        "--cost-m", type=int, nargs="+", default=None, help="query blocks timed for cost"
    )
    parser.add_argument(
        "--linearize-at",
        type=float,
        nargs="+",
        default=[0.5, 0.25, 1.0],
        help="data weights a at which runs are trained and reversed (first: the seed average)",
    )
    parser.add_argument(
        "--mean-of",
        type=float,
        nargs="*",
        default=[0.25, 0.5],
        help="points a whose metagradients are averaged (one run each)",
    )
    parser.add_argument(
        "--bases",
        type=int,
        default=4,
        help="random halves whose 0/1 masks (per-row linearize_at) are averaged; 0: none",
    )
    parser.add_argument(
        "--seed-bases",
        type=int,
        default=0,
        help="runs, each with a fresh seed and its own random half's 0/1 mask, averaged",
    )
    parser.add_argument(
        "--keep",
        type=float,
        nargs="+",
        default=[0.5, 0.9, 0.99],
        help="removal part: fractions of rows the same-run retrains keep",
    )
    parser.add_argument(
        "--fit-models", type=int, default=600, help="ceiling: retrains each datamodel fits"
    )
    parser.add_argument(
        "--seed-pairs", type=int, default=60, help="ceiling: halves trained from two seeds"
    )
    parser.add_argument("--bergson-queries", type=int, default=None)
    parser.add_argument(
        "--pretrain-chunks", type=int, default=None, help="lm-finetune: chunks pretrained on"
    )
    parser.add_argument("--pretrain-epochs", type=int, default=None, help="lm-finetune")
    parser.add_argument("--lr", type=float, default=None, help="lm protocols: the run's AdamW rate")
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="lm: linear learning-rate warmup steps before the decay (the demo's warmup_steps)",
    )
    parser.add_argument(
        "--no-others", action="store_true", help="skip the other methods (OTHER_METHODS)"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--device", default="cpu", help="where the replays and bergson train (cost, bergson)"
    )
    parser.add_argument("--progress", action="store_true")
    args = parser.parse_args(argv)
    lm_only = ("warmup_steps", "pretrain_chunks", "pretrain_epochs", "lr")
    given = [f"--{k.replace('_', '-')}" for k in lm_only if getattr(args, k) is not None]
    if given and args.protocol == "digits":
        parser.error(f"{', '.join(given)}: the language-model protocols only (digits runs SGD)")
    pretrain = [flag for flag in given if flag.startswith("--pretrain-")]
    if pretrain and args.protocol != "lm-finetune":
        parser.error(f"{', '.join(pretrain)}: --protocol lm-finetune only")
    if args.pretrain_chunks == 0 and args.protocol == "lm-finetune":
        parser.error(
            "--pretrain-chunks 0 is --protocol lm; lm-finetune needs chunks to pretrain on"
        )
    setup_torch(args.threads)
    sizes = SIZES[args.protocol][args.quick]
    over = {
        "epochs": args.epochs,
        "num_train": args.num_train,
        "num_targets": args.num_targets,
        "lds_models": args.lds_models,
        "seeds": args.seeds,
        "bergson_queries": args.bergson_queries,
        "cost_m": None if args.cost_m is None else tuple(args.cost_m),
        "warmup_steps": args.warmup_steps,
        "pretrain_chunks": args.pretrain_chunks,
        "pretrain_epochs": args.pretrain_epochs,
        "lr": args.lr,
    }
    sizes = dataclasses.replace(sizes, **{k: v for k, v in over.items() if v is not None})
    if max(sizes.cost_m) > sizes.num_targets:
        parser.error(
            f"--cost-m {max(sizes.cost_m)} exceeds the {sizes.num_targets} queries: a block "
            f"holds at most --num-targets queries; pass --num-targets {max(sizes.cost_m)}"
        )
    make = digits_protocol if args.protocol == "digits" else lm_protocol
    p = dataclasses.replace(make(sizes), device=args.device)
    at = tuple(args.linearize_at)
    summary: dict[str, Any] = {
        "protocol": p.name,
        "sizes": dataclasses.asdict(sizes),
        "linearize_at": at,
        "mean_of": args.mean_of,
        "bases": args.bases,
        "machine": machine_info(),
    }
    if args.part in ("all", "lds"):
        summary.update(
            run_lds(
                p,
                at,
                mean_of=tuple(args.mean_of),
                bases=args.bases,
                seed_bases=args.seed_bases,
                others=not args.no_others,
                progress=args.progress,
            )
        )
    if args.part in ("all", "cost"):
        summary["cost"] = run_cost(p, at[0])
    if args.part == "ops":
        summary["ops"] = run_ops(p, at[0])
    if args.part == "ceiling":
        summary["ceiling"] = run_ceiling(p, at[0], args.fit_models, args.seed_pairs)
    if args.part == "removal":
        summary["removal"] = run_removal(p, tuple(args.keep))
    if args.part == "bergson":
        summary["bergson"] = run_bergson(p, at[-1])
    print(format_table(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
