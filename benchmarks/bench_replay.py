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
import dataclasses
from typing import Any

from gradsketch.demos.protocols import machine_info, setup_torch
from gradsketch.demos.protocols.replay import (
    PROTOCOLS,
    SIZES,
    digits_protocol,
    format_table,
    lm_protocol,
    run_bergson,
    run_ceiling,
    run_cost,
    run_lds,
    run_ops,
    run_removal,
)

PARTS = ("all", "lds", "cost", "bergson", "removal", "ops", "ceiling")


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
