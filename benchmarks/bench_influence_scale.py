"""EK-FAC at model scale: gradsketch against Kronfluence 1.0.1, side by side in one run.

On causal LMs of growing shape (GPT-2 layout built from a config, byte vocabulary,
random init, no dropout; ``n`` training and ``m`` query sequences of random bytes),
each implementation fits EK-FAC on the training sequences and scores every query
against every training sequence, in a fresh process (``_common.run_isolated``) so
that its peak resident memory is its own:

* gradsketch: ``TRAKer(model, "language_modeling", method="ekfac",
  lambda_reg="auto", curvature="loss")``: featurize (per-layer gradients stored,
  Kronecker factors fitted in the same pass), finalize (eigendecompositions and
  the eigenvalue correction from the stored rows), score, finalize_scores;
* Kronfluence: ``fit_all_factors`` (``strategy="ekfac"``, empirical Fisher) and
  ``compute_pairwise_scores`` with ``damping_factor=None`` (its heuristic, a tenth
  of the mean eigenvalue per module; gradsketch's ``"auto"`` is run at the same
  fraction, 0.1, instead of its default 0.3), GPT-2's
  ``Conv1D`` converted to ``nn.Linear`` (Kronfluence does not track ``Conv1D``).

Both differentiate the summed next-token loss of each sequence (gradsketch's
features are the log-likelihood's gradient, so both scores are
``∇L_qᵀ (F + λ)⁻¹ ∇L_i``). Reported per shape: wall seconds of each, the ratio,
the Pearson correlation of the two score matrices, and both peak RSS figures.

gradsketch stores each training row's per-layer factors (each position's
inputs and output gradients, 76 MB per sequence at GPT-2 small's layers and 128
tokens) or, where narrower, its per-layer gradients (``sum_l d_out (d_in + 1)``
numbers, 340 MB per sequence there), so the stored rows grow with the model and
the sequence. ``--shape gpt2-small`` (1,000 sequences: 76 GB of rows) therefore
runs gradsketch with ``projection=(64, 64)`` per layer (LoGra), whose scores are
not Kronfluence's exact ones; ``--shape gpt2-small-64`` is GPT-2 small's layers
with 64 sequences, exact on both sides.

``--layers L [L ...]`` runs GPT-2's own layout instead (``--width`` 768,
``--heads`` 12, ``--vocab`` 50,257, random init, ``--documents`` training and
``--queries`` query documents of ``--seq`` random tokens), with both sides
restricted to the blocks' attention and MLP weights and biases (``c_attn``,
``attn.c_proj``, ``c_fc``, ``mlp.c_proj``: gradsketch's ``grad_wrt``,
Kronfluence's tracked modules), on ``--threads`` threads (1 by default: pin the
run with ``taskset -c 0``). Each line then also reports both sides' CPU seconds
per stage (gradsketch: featurize, finalize, score, finalize_scores; Kronfluence:
covariance, eigendecomposition, lambda, scores).

Run ``python benchmarks/bench_influence_scale.py`` (``--quick``: the tiny shape
only, few sequences; ``taskset -c 0 python benchmarks/bench_influence_scale.py
--layers 1 2 --documents 16`` for GPT-2's layout). Needs the ``bench`` extra
(Kronfluence).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import run_isolated

from gradsketch.demos.protocols import cpu_model, emit, machine_info, setup_torch

#: name -> (layers, width, heads, sequence length, training sequences, queries).
SHAPES: dict[str, tuple[int, int, int, int, int, int]] = {
    "tiny": (2, 64, 2, 64, 256, 16),
    "small": (4, 128, 4, 64, 128, 16),
    "gpt2-small": (12, 768, 12, 128, 1000, 16),
    # GPT-2 small's layers with fewer sequences: exact on both sides (76 MB of factored
    # rows per sequence), where the 1,000 sequences' rows do not fit the disk here.
    "gpt2-small-64": (12, 768, 12, 128, 64, 16),
}
QUICK = {"tiny": (2, 64, 2, 32, 32, 4)}
#: Per-layer projection of gradsketch on shapes whose exact rows do not fit a disk.
PROJECTED = {"gpt2-small": (64, 64)}


def _data(shape: tuple[int, ...]) -> tuple[Any, torch.Tensor, torch.Tensor]:
    from gradsketch.demos.lm import LMDemoSettings, build_lm

    layers, width, heads, seq, n, m = shape
    settings = LMDemoSettings(n_layer=layers, width=width, n_head=heads, chunk_len=seq)
    model = build_lm(settings, seed=0).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (n + m, seq), generator=gen)
    return model, ids[:n], ids[n:]


def gradsketch_worker(shape: list[int], out: str, projection: list[int] | None) -> dict:
    """Fit and score with gradsketch's EK-FAC; scores saved to ``out``."""
    import logging
    import time

    from gradsketch.attribution import TRAKer

    setup_torch()
    model, train, queries = _data(tuple(shape))
    start, cpu = time.perf_counter(), time.process_time()
    traker = TRAKer(
        model,
        "language_modeling",
        len(train),
        save_dir=tempfile.mkdtemp(dir=Path(out).parent),
        device="cpu",
        method="ekfac",
        lambda_reg="auto",
        damping_fraction=0.1,  # Kronfluence's heuristic: 0.1 x each module's mean eigenvalue
        curvature="loss",
        projection=None if projection is None else (projection[0], projection[1]),
        progress=False,
        logging_level=logging.WARNING,
    )
    traker.load_checkpoint(model.state_dict(), model_id=0)
    traker.featurize_loader([(train[i : i + 8],) for i in range(0, len(train), 8)])
    traker.finalize_features()
    fit = time.perf_counter() - start
    traker.start_scoring_checkpoint("q", model.state_dict(), model_id=0, num_targets=len(queries))
    traker.score_loader([(queries,)])
    np.save(out, np.asarray(traker.finalize_scores("q")))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"fit_s": fit, "total_s": wall, "cpu_s": cpu}


def _kronfluence_analyzer(model: torch.nn.Module, task: Any, out: str) -> Any:
    """Kronfluence's ``Analyzer`` on a copy of ``model`` (``Conv1D`` as ``Linear``), on CPU."""
    import copy
    import logging

    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.utils.dataset import DataLoaderKwargs

    from gradsketch.demos.protocols.influence import conv1d_to_linear

    wrapped = prepare_model(conv1d_to_linear(copy.deepcopy(model)).eval(), task)
    analyzer = Analyzer(
        "scale",
        wrapped,
        task,
        cpu=True,
        disable_tqdm=True,
        output_dir=str(Path(out).parent / "kronfluence"),
        log_level=logging.ERROR,
    )
    analyzer.set_dataloader_kwargs(DataLoaderKwargs(num_workers=0))
    return analyzer


def kronfluence_worker(shape: list[int], out: str) -> dict:
    """Fit and score with Kronfluence's EK-FAC (empirical Fisher, heuristic damping)."""
    import time

    from kronfluence.arguments import FactorArguments, ScoreArguments

    from gradsketch.demos.protocols.influence import (
        TokenRows,
        kronfluence_lm_task,
    )

    setup_torch()
    model, train, queries = _data(tuple(shape))
    start, cpu = time.perf_counter(), time.process_time()
    task = kronfluence_lm_task()
    analyzer = _kronfluence_analyzer(model, task, out)
    analyzer.fit_all_factors(
        "factors",
        TokenRows(train),
        per_device_batch_size=8,
        factor_args=FactorArguments(strategy="ekfac", use_empirical_fisher=True),
        overwrite_output_dir=True,
    )
    fit = time.perf_counter() - start
    analyzer.compute_pairwise_scores(
        "scores",
        "factors",
        TokenRows(queries),
        TokenRows(train),
        per_device_query_batch_size=len(queries),
        per_device_train_batch_size=8,
        score_args=ScoreArguments(damping_factor=None),
        overwrite_output_dir=True,
    )
    scores = analyzer.load_pairwise_scores("scores")["all_modules"].T.double().numpy()
    np.save(out, scores)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"fit_s": fit, "total_s": wall, "cpu_s": cpu}


def run(name: str, shape: tuple[int, ...]) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench_scale_"))
    projection = PROJECTED.get(name)
    # GPT-2 small's layers take hours on a few shared cores: no worker deadline there.
    timeout = 1800.0 if shape[1] < 768 else 6 * 3600.0
    ours = run_isolated(
        "bench_influence_scale:gradsketch_worker",
        list(shape),
        str(tmp / "gradsketch.npy"),
        None if projection is None else list(projection),
        timeout=timeout,
    )
    ref = run_isolated(
        "bench_influence_scale:kronfluence_worker",
        list(shape),
        str(tmp / "kf.npy"),
        timeout=timeout,
    )
    a = np.load(tmp / "gradsketch.npy").ravel().astype(np.float64)
    b = np.load(tmp / "kf.npy").ravel()
    layers, width, _, seq, n, m = shape
    emit(
        {
            "bench": "influence_scale",
            "shape": name,
            "layers": layers,
            "width": width,
            "seq": seq,
            "n_train": n,
            "n_query": m,
            "projection": projection,
            # Fit + score inside each worker (interpreter start and imports excluded).
            "gradsketch_s": round(ours["result"]["total_s"], 2),
            "kronfluence_s": round(ref["result"]["total_s"], 2),
            "ratio": round(ref["result"]["total_s"] / ours["result"]["total_s"], 2),
            # CPU seconds of each worker (all its threads): the figure to compare
            # when the machine is shared.
            "gradsketch_cpu_s": round(ours["result"]["cpu_s"], 1),
            "kronfluence_cpu_s": round(ref["result"]["cpu_s"], 1),
            "cpu_ratio": round(ref["result"]["cpu_s"] / ours["result"]["cpu_s"], 2),
            "gradsketch_fit_s": round(ours["result"]["fit_s"], 2),
            "kronfluence_fit_s": round(ref["result"]["fit_s"], 2),
            "pearson": round(float(np.corrcoef(a, b)[0, 1]), 5),
            "gradsketch_peak_rss_mb": round(ours["peak_rss_mb"]),
            "kronfluence_peak_rss_mb": round(ref["peak_rss_mb"]),
            "cpu": cpu_model(),
        }
    )


# -- GPT-2's own layout, the blocks' attention and MLP weights ---------------------------
#: The block modules both sides differentiate in ``--layers`` runs (weights and biases).
BLOCK_MODULES = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
#: ``--layers`` defaults: GPT-2 small's width, heads and vocabulary; 16 documents of 128.
MODEL_DEFAULTS = {"width": 768, "heads": 12, "vocab": 50_257, "seq": 128, "documents": 16}


def _gpt2(spec: dict[str, Any]) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """GPT-2 of ``spec``'s shape (random init, seed 0, no dropout) and its random documents."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=spec["layers"],
        n_embd=spec["width"],
        n_head=spec["heads"],
        vocab_size=spec["vocab"],
        n_positions=max(1024, spec["seq"]),
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    n, m = spec["documents"], spec["queries"]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec["vocab"], (n + m, spec["seq"]), generator=gen)
    return model, ids[:n], ids[n:]


def block_modules(model: torch.nn.Module) -> list[str]:
    """Names of the blocks' attention and MLP projections, in model order."""
    return [
        name
        for name, _ in model.named_modules()
        if ".h." in f".{name}" and name.endswith(BLOCK_MODULES)
    ]


class _Stages:
    """CPU seconds (all threads of this process) of consecutive stages."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.process_time()

    def mark(self, name: str) -> None:
        now = time.process_time()
        self.seconds[name] = round(now - self._last, 2)
        self._last = now


def gradsketch_model_worker(spec: dict[str, Any], out: str) -> dict:
    """gradsketch's exact EK-FAC on the blocks' weights; scores saved to ``out``."""
    import logging

    from gradsketch.attribution import TRAKer, _kfac

    setup_torch(spec["threads"])
    if not spec.get("low_rank", True):
        # Full float64 eigendecompositions of every factor (the path before eigh_low_rank).
        _kfac.LOW_RANK_MIN_WIDTH = 2**62
    model, train, queries = _gpt2(spec)
    params = {f"{name}.{kind}" for name in block_modules(model) for kind in ("weight", "bias")}
    grad_wrt = [name for name, _ in model.named_parameters() if name in params]
    stages = _Stages()
    traker = TRAKer(
        model,
        "language_modeling",
        len(train),
        save_dir=tempfile.mkdtemp(dir=Path(out).parent),
        device="cpu",
        method="ekfac",
        lambda_reg="auto",
        damping_fraction=spec["damping_fraction"],
        curvature="loss",
        grad_wrt=grad_wrt,
        progress=False,
        logging_level=logging.WARNING,
    )
    traker.load_checkpoint(model.state_dict(), model_id=0)
    batch = spec["batch"]
    traker.featurize_loader([(train[i : i + batch],) for i in range(0, len(train), batch)])
    stages.mark("featurize")
    traker.finalize_features()
    stages.mark("finalize")
    traker.start_scoring_checkpoint("q", model.state_dict(), model_id=0, num_targets=len(queries))
    traker.score_loader([(queries[i : i + batch],) for i in range(0, len(queries), batch)])
    stages.mark("score")
    scores = np.asarray(traker.finalize_scores("q"))
    stages.mark("finalize_scores")
    np.save(out, scores)
    return {"cpu_s": round(sum(stages.seconds.values()), 2), "stages": stages.seconds}


def kronfluence_model_worker(spec: dict[str, Any], out: str) -> dict:
    """Kronfluence's EK-FAC on the blocks' weights (empirical Fisher, heuristic damping)."""

    from kronfluence.arguments import FactorArguments, ScoreArguments

    from gradsketch.demos.protocols.influence import (
        TokenRows,
        kronfluence_lm_task,
    )

    setup_torch(spec["threads"])
    model, train, queries = _gpt2(spec)
    stages = _Stages()
    tracked = block_modules(model)
    base = type(kronfluence_lm_task())

    class BlockTask(base):  # type: ignore[misc, valid-type]
        def get_influence_tracked_modules(self) -> list[str]:
            return tracked

    task = BlockTask()
    analyzer = _kronfluence_analyzer(model, task, out)
    factor_args = FactorArguments(strategy="ekfac", use_empirical_fisher=True)
    batch = spec["batch"]
    common = {"factors_name": "factors", "factor_args": factor_args, "overwrite_output_dir": True}
    analyzer.fit_covariance_matrices(
        dataset=TokenRows(train), per_device_batch_size=batch, **common
    )
    stages.mark("covariance")
    analyzer.perform_eigendecomposition(**common)
    stages.mark("eigendecomposition")
    analyzer.fit_lambda_matrices(dataset=TokenRows(train), per_device_batch_size=batch, **common)
    stages.mark("lambda")
    analyzer.compute_pairwise_scores(
        "scores",
        "factors",
        TokenRows(queries),
        TokenRows(train),
        per_device_query_batch_size=len(queries),
        per_device_train_batch_size=batch,
        # Its heuristic is a tenth of each module's mean eigenvalue; other fractions are
        # not exposed, so gradsketch is run at 0.1 to match (``--damping-fraction``).
        score_args=ScoreArguments(damping_factor=None),
        overwrite_output_dir=True,
    )
    scores = analyzer.load_pairwise_scores("scores")["all_modules"].T.double().numpy()
    stages.mark("scores")
    np.save(out, scores)
    return {"cpu_s": round(sum(stages.seconds.values()), 2), "stages": stages.seconds}


def run_model(spec: dict[str, Any]) -> dict[str, Any]:
    """Both sides on GPT-2's layout ``spec`` in fresh processes; emits and returns the line."""
    tmp = Path(tempfile.mkdtemp(prefix="bench_scale_"))
    timeout = 6 * 3600.0
    ours = run_isolated(
        "bench_influence_scale:gradsketch_model_worker",
        spec,
        str(tmp / "gradsketch.npy"),
        timeout=timeout,
    )
    ref = run_isolated(
        "bench_influence_scale:kronfluence_model_worker",
        spec,
        str(tmp / "kf.npy"),
        timeout=timeout,
    )
    a = np.load(tmp / "gradsketch.npy").ravel().astype(np.float64)
    b = np.load(tmp / "kf.npy").ravel()
    full: dict[str, Any] = {}
    if spec.get("compare_full_eigh"):
        # gradsketch again with every factor's full eigh: the reduced bases' cost and scores.
        run = run_isolated(
            "bench_influence_scale:gradsketch_model_worker",
            {**spec, "low_rank": False},
            str(tmp / "gradsketch_full.npy"),
            timeout=timeout,
        )
        c = np.load(tmp / "gradsketch_full.npy").ravel().astype(np.float64)
        full = {
            "full_eigh_cpu_s": run["result"]["cpu_s"],
            "full_eigh_stages": run["result"]["stages"],
            "full_eigh_peak_rss_mb": round(run["peak_rss_mb"]),
            # Largest score change from the reduced bases, relative to the largest score.
            "low_rank_max_rel_diff": float(np.abs(a - c).max() / np.abs(c).max()),
            "low_rank_pearson": round(float(np.corrcoef(a, c)[0, 1]), 7),
        }
    row = {
        "bench": "influence_scale_gpt2",
        **{k: spec[k] for k in ("layers", "width", "vocab", "seq", "documents", "queries")},
        "damping_fraction": spec["damping_fraction"],
        "threads": spec["threads"],
        # CPU seconds inside each worker (all its threads; interpreter start, imports and
        # model construction excluded), per stage and in all.
        "gradsketch_cpu_s": ours["result"]["cpu_s"],
        "kronfluence_cpu_s": ref["result"]["cpu_s"],
        # gradsketch's share of Kronfluence's time (the target: <= 1/3).
        "cpu_share": round(ours["result"]["cpu_s"] / ref["result"]["cpu_s"], 3),
        "gradsketch_stages": ours["result"]["stages"],
        "kronfluence_stages": ref["result"]["stages"],
        "pearson": round(float(np.corrcoef(a, b)[0, 1]), 5),
        "gradsketch_peak_rss_mb": round(ours["peak_rss_mb"]),
        "kronfluence_peak_rss_mb": round(ref["peak_rss_mb"]),
        **full,
        "cpu": cpu_model(),
    }
    emit(row)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny shape, few sequences")
    parser.add_argument(
        "--shape", action="append", choices=sorted(SHAPES), help="shapes to run (repeatable)"
    )
    parser.add_argument(
        "--layers",
        type=int,
        nargs="+",
        help="GPT-2's layout with these block counts (the blocks' weights only), not --shape",
    )
    parser.add_argument("--width", type=int, default=MODEL_DEFAULTS["width"])
    parser.add_argument("--heads", type=int, default=MODEL_DEFAULTS["heads"])
    parser.add_argument("--vocab", type=int, default=MODEL_DEFAULTS["vocab"])
    parser.add_argument("--seq", type=int, default=MODEL_DEFAULTS["seq"], help="tokens/document")
    parser.add_argument("--documents", type=int, default=MODEL_DEFAULTS["documents"])
    parser.add_argument("--queries", type=int, default=4, help="query documents")
    parser.add_argument("--batch", type=int, default=8, help="documents per batch, both sides")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (--layers runs)")
    parser.add_argument(
        "--compare-full-eigh",
        action="store_true",
        help="also run gradsketch with full eigendecompositions of every factor (--layers runs)",
    )
    parser.add_argument(
        "--damping-fraction",
        type=float,
        default=0.1,
        help="gradsketch's fraction of each layer's mean eigenvalue (Kronfluence's: 0.1)",
    )
    args = parser.parse_args()
    emit({"bench": "machine", **machine_info()})
    if args.layers:
        for layers in args.layers:
            spec = {
                "layers": layers,
                **{k: getattr(args, k) for k in ("width", "heads", "vocab", "seq", "documents")},
                **{k: getattr(args, k) for k in ("queries", "batch", "threads")},
                "damping_fraction": args.damping_fraction,
                "compare_full_eigh": args.compare_full_eigh,
            }
            run_model(spec)
        return
    shapes = QUICK if args.quick else {s: SHAPES[s] for s in (args.shape or ["tiny", "small"])}
    for name, shape in shapes.items():
        run(name, shape)


if __name__ == "__main__":
    main()
