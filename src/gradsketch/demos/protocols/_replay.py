"""The replay benchmark's protocols: data, a replayable run, retrains and their ground truths.

Three protocols (:data:`PROTOCOLS`), each a :class:`Protocol` built by
:func:`digits_protocol` or :func:`lm_protocol` at the :class:`Sizes` of one
run (:data:`SIZES`: full and ``--quick``):

- ``digits``: ``make demo``'s MLP (64-256-256-10) trained by SGD with
  momentum; the query output is the classification margin.
- ``lm``: ``make demo-lm``'s GPT-2 on 64-byte standard-library chunks, AdamW;
  the query output is the summed log-likelihood of a held-out chunk.
- ``lm-finetune``: the same GPT-2 as a fine-tune of a model pretrained on
  other chunks (MAGIC's setting): a fresh seed changes the batch order only.

The replayed run is exactly the protocol's torch loop. Ground truths come in
two settings: the replayed run with a random subset's complement weighted 0
(:func:`same_run_truth`, what the metagradient is exact for), and the torch
loop retrained on each subset from a fresh seed (``Protocol.fresh_truth``,
how the other methods are judged). ``benchmarks/bench_replay.py`` measures
them (:mod:`gradsketch.demos.protocols._replay_parts`); the tests check the
protocols themselves.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor, nn

from gradsketch.attribution import (
    LanguageModelingModelOutput,
    ReplayAttributor,
    ReplaySettings,
    linear_datamodeling_score,
)

PROTOCOLS = ("digits", "lm", "lm-finetune")
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
        # The protocols' GPT-2 (``gradsketch.demos.lm.build_lm``), called as the
        # ``language_modeling`` task calls it: without a KV cache.
        out = torch.func.functional_call(
            model,
            (weights, buffers),
            args=(),
            kwargs={"input_ids": ids[None], "attention_mask": mask[None], "use_cache": False},
        )
        logits = out.logits
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
        # The figures in RESULTS were measured with each batch's loss divided by
        # the whole batch (`subset_loss="full_batch"`), so the protocols keep it.
        settings = dataclasses.replace(
            self.settings(seed), linearize_at=linearize_at, subset_loss="full_batch"
        )
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
        cast(Any, model).set_attn_implementation("eager")
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
