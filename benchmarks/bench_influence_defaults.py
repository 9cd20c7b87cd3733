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
eigenvalue (0.3 is the library's ``"auto"``, chosen by this grid; the others are
``TRAKer(..., damping_fraction=f)``). Baselines:
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
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch

from gradsketch.demos.protocols import emit, machine_info, setup_torch, time_once
from gradsketch.demos.protocols.influence import (
    KRONFLUENCE_DEFAULT_DAMPING,
    LDS_MODELS,
    PROTOCOLS,
    QUIET,
    Protocol,
    build_protocol,
    featurize_all,
    protocol_sizes,
    score_targets,
)

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
KRONFLUENCE_DAMPINGS = (KRONFLUENCE_DEFAULT_DAMPING, None)
BENCH = "influence_defaults"


def open_traker(p: Protocol, save_dir: str, **kwargs: Any) -> Any:
    """A TRAKer on ``p``'s model and task with a store in ``save_dir`` (new or re-opened)."""
    from gradsketch.attribution import TRAKer

    return TRAKer(
        copy.deepcopy(p.model),
        p.task,
        p.num_train,
        save_dir=save_dir,
        device="cpu",
        logging_level=QUIET,
        progress=False,
        **kwargs,
    )


def fit(p: Protocol, save_dir: str, **kwargs: Any) -> Any:
    """Featurize and finalize every checkpoint, store the queries' features ("lds"); scores.

    The scores at the TRAKer's own damping are computed once here: that
    also writes everything the store holds for re-opened TRAKers.
    """
    traker = open_traker(p, save_dir, **kwargs)
    featurize_all(traker, p.checkpoints, p.train_batches)
    score_targets(traker, p.checkpoints, p.query_batches)
    return traker, np.array(traker.finalize_scores("lds"), dtype=np.float64)


def rescore(p: Protocol, save_dir: str, damping: float | str, fraction: float | None, **kwargs):
    """The stored experiment's ``[n, m]`` scores at another damping (features reused)."""
    if fraction is not None:  # "auto" at another fraction of each layer's mean eigenvalue
        kwargs = {**kwargs, "damping_fraction": float(fraction)}
    traker = open_traker(p, save_dir, lambda_reg=damping, **kwargs)
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
    import inspect

    from gradsketch.attribution import TRAKer

    return float(inspect.signature(TRAKer).parameters["damping_fraction"].default)


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
