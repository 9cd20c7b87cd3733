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

Run ``python benchmarks/bench_influence_scale.py`` (``--quick``: the tiny shape
only, few sequences). Needs the ``bench`` extra (Kronfluence).
"""

from __future__ import annotations

import argparse
import tempfile
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
        projection=None if projection is None else tuple(projection),
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


def kronfluence_worker(shape: list[int], out: str) -> dict:
    """Fit and score with Kronfluence's EK-FAC (empirical Fisher, heuristic damping)."""
    import copy
    import logging
    import time

    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.utils.dataset import DataLoaderKwargs

    from gradsketch.demos.protocols.influence import (
        TokenRows,
        conv1d_to_linear,
        kronfluence_lm_task,
    )

    setup_torch()
    model, train, queries = _data(tuple(shape))
    start, cpu = time.perf_counter(), time.process_time()
    task = kronfluence_lm_task()
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny shape, few sequences")
    parser.add_argument(
        "--shape", action="append", choices=sorted(SHAPES), help="shapes to run (repeatable)"
    )
    args = parser.parse_args()
    emit({"bench": "machine", **machine_info()})
    shapes = QUICK if args.quick else {s: SHAPES[s] for s in (args.shape or ["tiny", "small"])}
    for name, shape in shapes.items():
        run(name, shape)


if __name__ == "__main__":
    main()
