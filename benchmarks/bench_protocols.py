"""The protocol suite: every method's LDS per setup, rules chosen on half A, reported on half B.

Run ``python benchmarks/bench_protocols.py --half A`` to measure the
candidates the recommendations are chosen from, and ``--half B`` to report
them (``--quick``: the setups at test size, GPT-2 included, a smoke run). The setups, their
split and :data:`~gradsketch.demos.protocols.suite.RECOMMENDED` live in
:mod:`gradsketch.demos.protocols.suite`.

Per setup (``--setups``, default: the half's digits setups; name a GPT-2
setup to run it), one JSON line per figure:

- ``part: loop``: the replay's trained model against the torch loop's
  (largest entry-wise difference: the replay describes the run exactly);
- ``part: lds``: one method (a replay setting or another method's variant)
  with its LDS against ``--retrains`` same-initialization retrains and
  ``--retrains`` fresh-seed retrains on random halves, each with a bootstrap
  95 % interval, and its CPU seconds;
- ``part: paired``: per truth, each replay setting minus each other method,
  ``LDS(replay) − LDS(other)`` with a paired bootstrap 95 % interval (the
  retrains resampled once for both); ``best_other`` marks the other method
  with the highest LDS on that truth;
- ``part: ceiling``: ridge datamodels fitted to the first ``N`` of one
  sequence of same-initialization retrains on other halves, for each ``N`` of
  ``--ceiling-retrains`` (e.g. ``100,200,400,1000``) whose retrains fit
  ``--ceiling-cpu-s``, scored on the evaluation's same-init halves beside
  the recommended replay (its LDS, the paired replay − datamodel difference
  and whether issue 50's target holds:
  :func:`~gradsketch.demos.protocols.ceiling.verdict`).

``--part lds`` skips the ceiling, ``--part ceiling`` the fresh-seed truth and
the other methods. Same-init retrains of the digits setups are trained
``--side-by-side`` at a time (one ``vmap`` per step).

Half A scores every candidate (``REPLAY_CANDIDATES``, ``BLEND_CANDIDATES``,
``OTHER_CANDIDATES``); a blend's ``cpu_s`` is the blending alone, its parts
have their own rows; ``auto`` is ``linearize_at="auto"`` (chosen from
``suite.AUTO_RETRAINS`` validation retrains on ``suite.AUTO_QUERIES`` held-out
test digits; its row's ``auto`` field holds the choice, each candidate's
validation LDS and the CPU seconds, which its ``cpu_s`` includes);
half B scores the recommended replay setting per optimizer and the
recommended variant of each other method (``--all`` scores every candidate,
``--methods`` the named ones only). ``--queries N`` scores the first ``N``
queries of each setup (the reverse pass costs in proportion to them). One
thread per run (``--threads``); CPU seconds by ``time.process_time``.

The figures of the report were measured with, per half::

    python benchmarks/bench_protocols.py --half A --queries 25 --retrains 30 \
        --ceiling-retrains 0
    python benchmarks/bench_protocols.py --half B --queries 25 --retrains 30 \
        --ceiling-retrains 0 --methods kept_mean@1,full_batch@0.5,trak-auto,identity,kfac,ekfac

and the GPT-2 setups run with ``--setups A-gpt2-scratch`` / ``B-gpt2-finetune``.
The Adam rule (the replay over three checkpoints blended with K-FAC), chosen on
half A and then reported on half B::

    python benchmarks/bench_protocols.py --half A --queries 25 --retrains 30 \
        --ceiling-retrains 0 --setups A-mlp-adam-l2-fb-short,A-mlp-adam-l2-mb \
        --methods kept_mean@1,kept_mean@ckpt3,full_batch@0.5,kfac,ekfac,\
    z:kept_mean@1+kfac,z.25:kept_mean@1+kfac,z.75:kept_mean@1+kfac,\
    rank:kept_mean@1+kfac,z:kept_mean@ckpt3+kfac
    python benchmarks/bench_protocols.py --half B --queries 25 --retrains 30 \
        --ceiling-retrains 0 --setups B-mlp-adam-l2-fb-issue,B-cnn-adam-l2-mb \
        --methods z:kept_mean@ckpt3+kfac,kept_mean@1,kept_mean@ckpt3,\
    z:kept_mean@1+kfac,trak-auto,identity,kfac,ekfac
The ceiling and the paired intervals of half B::

    python benchmarks/bench_protocols.py --half B --queries 25 --retrains 30 \
        --methods kept_mean@1,kfac,ekfac --ceiling-retrains 100,200,400,1000 \
        --ceiling-cpu-s 700
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from gradsketch.demos.protocols import emit, setup_torch
from gradsketch.demos.protocols import suite as S
from gradsketch.demos.protocols.ceiling import ceiling_curve, paired


def cpu_timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """``(process CPU seconds, result)`` of one call."""
    c0 = time.process_time()
    out = fn()
    return time.process_time() - c0, out


def methods_of(
    setup: S.Setup, half: str, everything: bool, only: list[str]
) -> tuple[list[str], list[str]]:
    """The replay settings and other variants scored on ``setup``."""
    if only:
        return (
            [m for m in only if m in S.REPLAY_CANDIDATES or m in S.BLEND_CANDIDATES],
            [m for m in only if m in S.OTHER_CANDIDATES],
        )
    if half == "A" or everything:
        return [*S.REPLAY_CANDIDATES, *S.BLEND_CANDIDATES], list(S.OTHER_CANDIDATES)
    return [S.RECOMMENDED["replay"][setup.optimizer]], list(S.RECOMMENDED["others"])


def run_setup(setup: S.Setup, args: argparse.Namespace) -> None:
    base = {"bench": "protocols", "setup": setup.name, "half": setup.half}
    emit({**base, "part": "setup", **{k: v for k, v in vars(setup).items() if k != "name"}})
    run = S.SuiteRun(setup)
    c_train, _ = cpu_timed(lambda: run.truth_run)
    diff = S.max_abs_diff(run.truth_run.retrain(torch.ones(run.n_train)), run.torch_final())
    emit({**base, "part": "loop", "replay_vs_torch_loop_max_abs": diff, "train_cpu_s": c_train})
    masks = S.halves(run.n_train, args.retrains, 10_000)
    c_same, same = cpu_timed(
        lambda: S.same_init_retrains(run, masks, side_by_side=args.side_by_side)
    )
    truths = {"same_init": (masks, same)}
    truth_row = {**base, "part": "truth", "retrains": args.retrains, "same_init_cpu_s": c_same}
    if args.part != "ceiling":
        fresh_masks = S.halves(run.n_train, args.retrains, 30_000)
        c_fresh, fresh = cpu_timed(lambda: S.fresh_seed_retrains(run, fresh_masks, 50_000))
        truths["fresh_seed"] = (fresh_masks, fresh)
        truth_row["fresh_seed_cpu_s"] = c_fresh
    emit(truth_row)
    replays, others = methods_of(setup, args.half, args.all, args.methods)
    if args.part == "ceiling":  # the recommended replay only, beside the datamodel
        replays, others = replays[:1], []
    # Blends last: their parts are then scored (and timed) once, as their own rows.
    replays = sorted(replays, key=lambda label: label in S.BLEND_CANDIDATES)
    plain = [label for label in replays if label not in S.BLEND_CANDIDATES]
    blends = [label for label in replays if label in S.BLEND_CANDIDATES]
    jobs: list[tuple[str, str, Callable[[], np.ndarray]]] = [
        ("replay", label, functools.partial(S.replay_scores, run, label)) for label in plain
    ] + [("other", label, functools.partial(S.other_scores, run, label)) for label in others]
    jobs += [("replay", label, functools.partial(S.replay_scores, run, label)) for label in blends]
    scores: dict[str, np.ndarray] = {}
    for kind, label, fn in jobs:
        try:
            cpu, scores[label] = cpu_timed(fn)
        except Exception as exc:  # keep the other methods' rows
            emit({**base, "part": "lds", "method": label, "error": repr(exc)})
            continue
        row: dict[str, Any] = {**base, "part": "lds", "kind": kind, "method": label}
        if label in S.BLEND_CANDIDATES:
            replay, other, how, weight = S.BLEND_CANDIDATES[label]
            row["settings"] = {"replay": replay, "other": other, "how": how, "weight": weight}
        elif kind == "replay":
            at, loss = S.REPLAY_CANDIDATES[label]
            row["settings"] = {"linearize_at": at, "subset_loss": loss}
            if at == "auto" and run.auto is not None and run.auto.linearization is not None:
                choice = run.auto.linearization  # cpu_s below includes its retrains
                row["auto"] = {
                    "chosen": choice.label,
                    "validation_lds": choice.lds,
                    "skipped": sorted(choice.skipped),
                    "retrains": choice.retrains,
                    "retrain_cpu_s": choice.retrain_cpu_s,
                    "candidate_cpu_s": choice.candidate_cpu_s,
                }
        else:
            row["settings"] = S.OTHER_CANDIDATES[label][1]
        for name, truth in truths.items():
            row[name], row[f"{name}_ci95"] = S.lds_row(scores[label], truth)
        emit({**row, "cpu_s": cpu})
    emit_paired(base, scores, [r for r in replays if r in scores], truths)
    if args.ceiling_retrains and replays and replays[0] in scores:
        curve = ceiling_curve(
            run,
            truths["same_init"],
            args.ceiling_retrains,
            budget_cpu_s=args.ceiling_cpu_s,
            replay=scores[replays[0]],
            side_by_side=args.side_by_side,
        )
        for ceiling in curve:
            emit({**base, "part": "ceiling", "truth": "same_init", "replay": replays[0], **ceiling})


def emit_paired(
    base: dict[str, Any],
    scores: dict[str, np.ndarray],
    replays: list[str],
    truths: dict[str, tuple[np.ndarray, np.ndarray]],
) -> None:
    """Per truth, each replay setting against each other method: paired LDS difference.

    ``best_other`` marks the other method with the highest LDS on that truth
    (the one issue 50's target compares with).
    """
    others = [label for label in scores if label not in replays]
    for name, truth in truths.items():
        if not others:
            break
        lds = {label: S.lds_row(scores[label], truth)[0] for label in others}
        best = max(others, key=lambda label: lds[label])
        for replay in replays:
            for other in others:
                diff, interval = paired(scores[replay], scores[other], truth)
                emit(
                    {
                        **base,
                        "part": "paired",
                        "truth": name,
                        "replay": replay,
                        "other": other,
                        "best_other": other == best,
                        "replay_minus_other": diff,
                        "ci95": interval,
                    }
                )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--half", choices=S.HALVES, default="B")
    p.add_argument("--setups", default="", help="comma-separated names (default: the half's)")
    p.add_argument("--quick", action="store_true", help="the setups at test size")
    p.add_argument(
        "--retrains", type=int, default=None, help="evaluation halves per truth (40; quick: 8)"
    )
    p.add_argument(
        "--part",
        choices=("all", "lds", "ceiling"),
        default="all",
        help="lds: methods against both truths, paired; ceiling: the datamodel beside the "
        "recommended replay (same-init truth only); all: both",
    )
    p.add_argument(
        "--ceiling-retrains",
        default="200",
        help="comma-separated datamodel sizes N, fitted on one growing set of retrains (0: skip)",
    )
    p.add_argument(
        "--ceiling-cpu-s",
        type=float,
        default=600.0,
        help="CPU seconds the datamodel's retrains may take per setup; stops at the last N reached",
    )
    p.add_argument(
        "--side-by-side",
        type=int,
        default=40,
        help="same-init retrains trained at once (one vmap per step; digits setups)",
    )
    p.add_argument(
        "--queries", type=int, default=0, help="score the first N queries only (0: the setup's)"
    )
    p.add_argument("--all", action="store_true", help="score every candidate on half B too")
    p.add_argument("--methods", default="", help="comma-separated candidate labels only")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    sizes = [int(n) for n in args.ceiling_retrains.split(",") if n.strip()]
    args.ceiling_retrains = [] if sizes == [0] or args.part == "lds" else sizes
    known = [*S.REPLAY_CANDIDATES, *S.BLEND_CANDIDATES, *S.OTHER_CANDIDATES]
    unknown = set(args.methods) - set(known)
    if unknown:
        p.error(f"--methods {sorted(unknown)} are not candidates; choose from {known}")
    setup_torch(args.threads)
    if args.setups:
        chosen = [S.setup_named(n) for n in args.setups.split(",")]
    else:
        chosen = [s for s in S.SETUPS if s.half == args.half and not s.is_lm]
    if args.queries:
        chosen = [
            s if s.is_lm else dataclasses.replace(s, n_queries=min(s.n_queries, args.queries))
            for s in chosen
        ]
    if args.quick:
        chosen = [s.tiny() for s in chosen]
        args.ceiling_retrains = [20] if args.ceiling_retrains else []
    if args.retrains is None:
        args.retrains = 8 if args.quick else 40
    for setup in chosen:
        run_setup(setup, args)


if __name__ == "__main__":
    main()
