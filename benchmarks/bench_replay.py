"""Metagradients by replaying training (MAGIC) on the digits MLP: LDS and cost beside EK-FAC.

Run ``python benchmarks/bench_replay.py`` (``--quick`` for a smoke run at
small sizes). Prints one JSON line per measurement and a closing table.

The protocol is ``make demo``'s: the digits MLP (64-256-256-10) trained by
SGD (momentum 0.9, weight decay 5e-4, cosine learning rate from 0.05, batch
64) for ``--epochs`` epochs. The replayed run is exactly that loop
(:class:`~gradsketch.attribution.ReplayAttributor` with the demo's seed,
which fixes the same initialization and batch order as
``train_digits_model``). LDS over ``--lds-models`` random halves, in two
settings:

- (a) ``same-run``: MAGIC's setting. Each half is the replayed run itself
  with the left-out rows' weights set to 0 (same initialization, same batch
  order, batches keep their size): what the metagradient is exact for.
- (b) ``fresh-seeds``: the demo's protocol (``digits_lds_ground_truth``):
  each half trained from a fresh seed (initialization and order), how the
  other methods are judged. Beside the single run's metagradients, their
  average over ``--seeds`` replayed runs with different seeds.

TRAK (``lambda_reg=0``, ``proj_dim`` 512) and EK-FAC (``lambda_reg="auto"``)
score the replayed run's final model (one checkpoint) in the same run,
against the same ground truths (``--no-others`` skips them).

Cost: wall time of training (with checkpoints), and of the reverse pass per
query as the block of queries ``m`` grows (``--cost-m``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, machine_info, setup_torch

from gradsketch.attribution import ReplayAttributor, linear_datamodeling_score
from gradsketch.demos._attribution import (
    DemoSettings,
    attribute_digits,
    digits_lds_ground_truth,
)
from gradsketch.demos._digits import (
    TrainSettings,
    build_model,
    load_digits_split,
    replay_settings,
    train_digits_model,
)


@dataclass(frozen=True)
class Sizes:
    """Sizes of one benchmark run."""

    epochs: int = 20
    num_targets: int = 32
    lds_models: int = 30
    seeds: int = 3
    cost_m: tuple[int, ...] = (1, 8, 32)


#: ``--quick``: one epoch, a few targets and models, every step exercised.
QUICK = Sizes(epochs=1, num_targets=4, lds_models=4, seeds=2, cost_m=(1, 4))


def replay_run(split: Any, train: TrainSettings, seed: int, **kw: Any) -> ReplayAttributor:
    """The demo's training loop as a replayable run (same init, order and schedule)."""
    settings = replay_settings(split.n_train, train, seed=seed)
    return ReplayAttributor(
        build_model("mlp", seed=seed),
        "image_classification",
        (split.x_train, split.y_train),
        settings,
        **kw,
    )


def same_run_truth(
    run: ReplayAttributor, targets: tuple[torch.Tensor, ...], num_models: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Setting (a): the replayed run with random halves' complements weighted 0."""
    rng = np.random.default_rng(seed)
    n = run.n_train
    masks = np.zeros((num_models, n), dtype=bool)
    outputs = []
    for i in range(num_models):
        masks[i, rng.choice(n, size=round(n / 2), replace=False)] = True
        weights = torch.from_numpy(masks[i].astype(np.float32))
        outputs.append(run.outputs(targets, run.retrain(weights)).double().numpy())
    return masks, np.stack(outputs)


def lds(scores: Any, truth: tuple[np.ndarray, np.ndarray]) -> float:
    """Rounded LDS of ``scores`` against ``(masks, outputs)``."""
    return round(float(linear_datamodeling_score(np.asarray(scores), *truth)), 4)


def run(sizes: Sizes, *, others: bool = True, progress: bool = False) -> dict[str, Any]:
    """Every measurement of one benchmark run; returns the summary it also emits."""
    split = load_digits_split(seed=0)
    train = TrainSettings(epochs=sizes.epochs)
    targets = (split.x_test[: sizes.num_targets], split.y_test[: sizes.num_targets])
    base_seed = 0
    summary: dict[str, Any] = {"sizes": sizes.__dict__, "machine": machine_info()}

    runs, scores = [], []
    for k in range(sizes.seeds):
        r = replay_run(split, train, base_seed + k, progress=progress)
        t0 = time.perf_counter()
        r.train()
        t_train = time.perf_counter() - t0
        t0 = time.perf_counter()
        scores.append(r.score(targets).numpy())
        t_score = time.perf_counter() - t0
        runs.append(r)
        emit(
            {
                "bench": "replay",
                "part": "run",
                "seed": base_seed + k,
                "steps": r.settings.num_steps,
                "checkpoint_every": r.every,
                "train_s": t_train,
                "reverse_s": t_score,
                "queries": sizes.num_targets,
                "memory_bytes": r.memory_estimate(sizes.num_targets).total,
            }
        )
    run0 = runs[0]
    t0 = time.perf_counter()
    plain = run0.retrain()
    summary["plain_train_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    train_digits_model(split.x_train, split.y_train, seed=base_seed, settings=train)
    summary["torch_train_s"] = time.perf_counter() - t0
    assert all(torch.equal(plain[n], p) for n, p in run0._require_trained().items())

    truth_a = same_run_truth(run0, targets, sizes.lds_models, seed=10_000)
    demo = DemoSettings(
        num_targets=sizes.num_targets, lds_models=sizes.lds_models, train=train, seed=base_seed
    )
    truth_b = digits_lds_ground_truth(split, *targets, demo, progress=progress)
    methods: dict[str, np.ndarray] = {
        "replay": scores[0],
        f"replay-mean{sizes.seeds}": np.mean(scores, axis=0),
    }
    table: dict[str, dict[str, float]] = {}
    summary["lds"] = table

    def report(name: str, s: np.ndarray) -> None:
        table[name] = {"same-run": lds(s, truth_a), "fresh-seeds": lds(s, truth_b)}
        emit({"bench": "replay", "part": "lds", "method": name, **table[name]})

    for name, s in methods.items():
        report(name, s)
    if others:
        ckpt = [{k: v.detach().clone() for k, v in run0.load_final().state_dict().items()}]
        with tempfile.TemporaryDirectory() as tmp:
            for name, method, lam in (("trak", "trak", 0.0), ("ekfac", "ekfac", "auto")):
                t0 = time.perf_counter()
                try:
                    s, _ = attribute_digits(
                        ckpt,
                        split,
                        demo,
                        save_dir=Path(tmp) / name,
                        lambda_reg=lam,
                        progress=progress,
                        method=method,
                    )
                except Exception as exc:  # report the others' failure, keep the replay's
                    summary[f"{name}_error"] = repr(exc)
                    emit({"bench": "replay", "part": "lds", "method": name, "error": repr(exc)})
                    continue
                summary[f"{name}_s"] = time.perf_counter() - t0
                report(name, s)

    cost = {}
    for m in sizes.cost_m:
        q = (split.x_test[:m], split.y_test[:m])
        t0 = time.perf_counter()
        run0.metagradients(q)
        dt = time.perf_counter() - t0
        cost[m] = {
            "reverse_s": dt,
            "per_query_s": dt / m,
            "train_runs": dt / summary["plain_train_s"],
        }
        emit({"bench": "replay", "part": "cost", "m": m, **cost[m]})
    summary["cost"] = cost
    return summary


def format_table(summary: dict[str, Any]) -> str:
    """The closing table: LDS per method and setting, then cost per query."""
    lines = [f"{'method':<16}{'LDS same-run':>14}{'LDS fresh-seeds':>17}"]
    for name, row in summary["lds"].items():
        lines.append(f"{name:<16}{row['same-run']:>14.3f}{row['fresh-seeds']:>17.3f}")
    lines.append(
        f"one training run: {summary['plain_train_s']:.2f} s by the replay's functional loop, "
        f"{summary['torch_train_s']:.2f} s by the demo's torch loop (cost below in the former)"
    )
    for m, c in summary["cost"].items():
        lines.append(
            f"m={m:<4} reverse {c['reverse_s']:.2f} s, {c['per_query_s']:.3f} s/query, "
            f"{c['train_runs']:.1f} training runs"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--num-targets", type=int, default=None)
    parser.add_argument("--lds-models", type=int, default=None)
    parser.add_argument("--seeds", type=int, default=None, help="replayed runs averaged in (b)")
    parser.add_argument(
        "--cost-m", type=int, nargs="+", default=None, help="query blocks timed for cost"
    )
    parser.add_argument("--no-others", action="store_true", help="skip TRAK and EK-FAC")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--progress", action="store_true")
    args = parser.parse_args(argv)
    setup_torch(args.threads)
    sizes = QUICK if args.quick else Sizes()
    over = {
        "epochs": args.epochs,
        "num_targets": args.num_targets,
        "lds_models": args.lds_models,
        "seeds": args.seeds,
        "cost_m": None if args.cost_m is None else tuple(args.cost_m),
    }
    sizes = Sizes(**{**sizes.__dict__, **{k: v for k, v in over.items() if v is not None}})
    summary = run(sizes, others=not args.no_others, progress=args.progress)
    print(format_table(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
