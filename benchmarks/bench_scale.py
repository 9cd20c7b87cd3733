"""TRAK featurize at model scale: CPU seconds and peak memory against the model's own pass.

A GPT-2-small-shaped model (``--family gpt2``: ``n_embd`` 768, 12 heads,
vocabulary 50,257) or a Pythia-160M-shaped one (``--family pythia``:
GPT-NeoX, 768 wide, vocabulary 50,304) is built from a config with
``--layers`` blocks (random init, eval mode), and ``--documents`` training
documents and ``--queries`` queries of ``--tokens`` random tokens are made.
In a fresh process per run (``_common.run_isolated``, so that the peak
resident memory is this run's own), on ``--threads`` threads:

1. the model's own forward + backward over the training documents (summed
   next-token cross-entropy, ``loss.backward()`` into the parameters' ``.grad``),
   timed in CPU seconds (``time.process_time``, all threads), the median of
   ``--repeats`` after one warm-up;
2. ``TRAKer(model, "language_modeling", ...)`` with the README's defaults
   (``--method trak``: ``proj_dim`` 2048, the default count-sketch projector)
   or with a per-layer factorized projector (``--method factorized``:
   ``FactorizedProjector.from_budget(model, 2048)``, LoGra-style), featurizing
   the documents twice (``featurize_loader`` on the first copy, *cold*: the
   projector's tables and the gradient computer's set-up included, then on a
   second copy, *warm*), finalizing and scoring the queries (``score_loader``).

``--method ekfac`` runs EK-FAC as the README's command line does
(``projection=(16, 16)``); ``--per-token`` scores the queries with
``per_token=True`` (each query becomes ``T`` rows of ``T`` tokens).

Each line reports the CPU seconds of every stage, the ratio of each
featurize to the forward + backward of the same documents measured in the
same process, the resident memory after the reference pass, each stage's own
peak (``peak_featurize_mb``, ``peak_finalize_mb``, ``peak_score_mb``: the
process's ``VmHWM``, reset before the stage) beside the plan's estimate of it
(``plan_*_mb``, :meth:`AttributionPlan.stage_bytes`; the score stage with
``--per-token`` only), the store's bytes per document on disk beside the
plan's, and the plan's seconds per document (from the cold first batch).

Run ``python benchmarks/bench_scale.py --layers 2 4 --threads 1 2``; the full
12-layer model needs about 12 GB free (``free -g``).
"""

from __future__ import annotations

import argparse
import itertools
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import run_isolated

from gradsketch.demos.protocols import emit

#: family -> (width, heads, vocabulary).
FAMILIES: dict[str, tuple[int, int, int]] = {
    "gpt2": (768, 12, 50_257),
    "pythia": (768, 12, 50_304),
}
METHODS = ("trak", "factorized", "ekfac")
PROJ_DIM = 2048


def _rss_mb() -> float:
    """Peak resident memory of this process so far, in MB (``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _reset_peak() -> None:
    """Reset this process's peak resident memory (``VmHWM``; Linux's ``clear_refs`` 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_mb() -> float:
    """``VmHWM``: the peak resident memory since the last :func:`_reset_peak`, in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _model(family: str, layers: int, tokens: int) -> Any:
    import torch
    import transformers

    width, heads, vocab = FAMILIES[family]
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(
            n_layer=layers,
            n_embd=width,
            n_head=heads,
            vocab_size=vocab,
            n_positions=max(1024, tokens),
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        return transformers.GPT2LMHeadModel(config).eval()
    config = transformers.GPTNeoXConfig(
        num_hidden_layers=layers,
        hidden_size=width,
        num_attention_heads=heads,
        intermediate_size=4 * width,
        vocab_size=vocab,
        max_position_embeddings=max(2048, tokens),
        rotary_pct=0.25,
        use_parallel_residual=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return transformers.GPTNeoXForCausalLM(config).eval()


def _folder_bytes(folder: str) -> int:
    """Bytes of the files under ``folder`` (the store, as written so far)."""
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())


def _plan_figures(plan: Any, stage: str) -> dict[str, Any]:
    """The plan's estimates for ``stage``: memory, store per document, seconds per document."""
    return {
        f"plan_{stage}_mb": plan.stage_bytes(stage) / 1e6,
        "plan_store_bytes_per_row": plan.store_bytes_per_row,
        "plan_seconds_per_row": plan.seconds_per_row,
    }


def worker(
    family: str,
    layers: int,
    documents: int,
    queries: int,
    tokens: int,
    method: str,
    threads: int,
    repeats: int,
    per_token: bool = False,
) -> dict[str, Any]:
    """One measured run (module docstring); returns the figures as a dict."""
    import logging

    import datasets
    import torch

    from gradsketch.attribution import HookGradientComputer, TRAKer
    from gradsketch.sketch import FactorizedProjector

    torch.set_num_threads(threads)
    model = _model(family, layers, tokens)
    vocab = FAMILIES[family][2]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2 * documents + queries, tokens), generator=gen)
    docs = ids[: 2 * documents]

    def forward_backward() -> None:
        model.zero_grad(set_to_none=True)
        out = model(input_ids=docs[:documents], labels=docs[:documents])
        out.loss.backward()
        model.zero_grad(set_to_none=True)

    forward_backward()
    ref_times = []
    for _ in range(repeats):
        start = time.process_time()
        forward_backward()
        ref_times.append(time.process_time() - start)
    ref = statistics.median(ref_times)
    rss_ref = _rss_mb()
    for p in model.parameters():
        p.grad = None

    extra: dict[str, Any] = {"proj_dim": PROJ_DIM}
    if method == "factorized":
        projector = FactorizedProjector.from_budget(model, PROJ_DIM, seed=0, device="cpu")
        extra["projector"] = projector
        extra["gradient_computer"] = HookGradientComputer
    elif method == "ekfac":
        # The README's command line: `gradsketch attribute --method ekfac --projection 16,16`.
        extra = {"method": "ekfac", "projection": (16, 16)}
    train = datasets.Dataset.from_dict({"input_ids": docs.tolist()})
    query_set = datasets.Dataset.from_dict({"input_ids": ids[2 * documents :].tolist()})
    with tempfile.TemporaryDirectory() as save_dir:
        _reset_peak()
        traker = TRAKer(
            model,
            "language_modeling",
            train_set_size=2 * documents,
            save_dir=save_dir,
            device="cpu",
            progress=False,
            logging_level=logging.ERROR,
            **extra,
        )
        traker.load_checkpoint(model.state_dict(), model_id=0)
        start = time.process_time()
        traker.featurize_loader(train.select(range(documents)), batch_size=documents)
        cold = time.process_time() - start
        rss_cold = _rss_mb()
        plan = traker.plan
        start = time.process_time()
        traker.featurize_loader(train.select(range(documents, 2 * documents)), batch_size=documents)
        warm = time.process_time() - start
        rss_warm = _rss_mb()
        peak_featurize = _peak_mb()
        traker.store.flush()
        stored = _folder_bytes(save_dir)
        _reset_peak()
        start = time.process_time()
        traker.finalize_features()
        finalize = time.process_time() - start
        peak_finalize = _peak_mb()
        final_plan = traker.plan
        _reset_peak()
        start = time.process_time()
        traker.start_scoring_checkpoint(
            "q", model.state_dict(), model_id=0, num_targets=queries, per_token=per_token
        )
        traker.score_loader(query_set, batch_size=queries)
        score_plan = traker.plan
        peak_score = _peak_mb()
        scores = traker.finalize_scores("q", per_token=per_token)
        score = time.process_time() - start
    return {
        "fwd_bwd_cpu_s": ref,
        "featurize_cold_cpu_s": cold,
        "featurize_warm_cpu_s": warm,
        "finalize_cpu_s": finalize,
        "score_cpu_s": score,
        "ratio_cold": cold / ref,
        "ratio_warm": warm / ref,
        "featurize_s_per_doc_warm": warm / documents,
        "rss_after_fwd_bwd_mb": rss_ref,
        "rss_after_cold_mb": rss_cold,
        "rss_after_warm_mb": rss_warm,
        "peak_featurize_mb": peak_featurize,
        "peak_finalize_mb": peak_finalize,
        "peak_score_mb": peak_score,
        "store_bytes_per_row": stored / (2 * documents),
        **_plan_figures(plan, "featurize"),
        **{k: v for k, v in _plan_figures(final_plan, "finalize").items() if "finalize" in k},
        **({"plan_score_mb": score_plan.stage_bytes("score") / 1e6} if per_token else {}),
        # Resetting VmHWM lowers what ru_maxrss reports at exit: the peak is the stages' maximum.
        "peak_stages_mb": max(rss_ref, peak_featurize, peak_finalize, peak_score),
        "scores_shape": list(scores.shape),
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="gpt2")
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--documents", type=int, default=16)
    parser.add_argument("--queries", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--method", choices=METHODS, nargs="+", default=list(METHODS[:2]))
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3, help="reference passes (median)")
    parser.add_argument(
        "--per-token", action="store_true", help="score the queries' tokens (per_token=True)"
    )
    args = parser.parse_args(argv)
    for layers, method, threads in itertools.product(args.layers, args.method, args.threads):
        run = run_isolated(
            "bench_scale:worker",
            args.family,
            layers,
            args.documents,
            args.queries,
            args.tokens,
            method,
            threads,
            args.repeats,
            args.per_token,
            timeout=7200.0,
        )
        emit(
            {
                "bench": "scale",
                "family": args.family,
                "layers": layers,
                "documents": args.documents,
                "tokens": args.tokens,
                "method": method,
                "threads": threads,
                "per_token": args.per_token,
                **run["result"],
                "peak_rss_mb": max(run["peak_rss_mb"], run["result"]["peak_stages_mb"]),
            }
        )


if __name__ == "__main__":
    sys.exit(main())
