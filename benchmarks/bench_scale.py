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

Each line reports the CPU seconds of every stage, the ratio of each
featurize to the forward + backward of the same documents measured in the
same process, the resident memory after the reference pass and the peak over
the whole run (``ru_maxrss``; the TRAK stages come after the reference, so a
peak above the first figure is theirs).

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
from typing import Any

from _common import run_isolated

from gradsketch.demos.protocols import emit

#: family -> (width, heads, vocabulary).
FAMILIES: dict[str, tuple[int, int, int]] = {
    "gpt2": (768, 12, 50_257),
    "pythia": (768, 12, 50_304),
}
METHODS = ("trak", "factorized")
PROJ_DIM = 2048


def _rss_mb() -> float:
    """Peak resident memory of this process so far, in MB (``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


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


def worker(
    family: str,
    layers: int,
    documents: int,
    queries: int,
    tokens: int,
    method: str,
    threads: int,
    repeats: int,
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

    extra: dict[str, Any] = {}
    if method == "factorized":
        projector = FactorizedProjector.from_budget(model, PROJ_DIM, seed=0, device="cpu")
        extra = {"projector": projector, "gradient_computer": HookGradientComputer}
    train = datasets.Dataset.from_dict({"input_ids": docs.tolist()})
    query_set = datasets.Dataset.from_dict({"input_ids": ids[2 * documents :].tolist()})
    with tempfile.TemporaryDirectory() as save_dir:
        traker = TRAKer(
            model,
            "language_modeling",
            train_set_size=2 * documents,
            save_dir=save_dir,
            device="cpu",
            proj_dim=PROJ_DIM,
            progress=False,
            logging_level=logging.ERROR,
            **extra,
        )
        traker.load_checkpoint(model.state_dict(), model_id=0)
        start = time.process_time()
        traker.featurize_loader(train.select(range(documents)), batch_size=documents)
        cold = time.process_time() - start
        rss_cold = _rss_mb()
        start = time.process_time()
        traker.featurize_loader(train.select(range(documents, 2 * documents)), batch_size=documents)
        warm = time.process_time() - start
        rss_warm = _rss_mb()
        start = time.process_time()
        traker.finalize_features()
        traker.start_scoring_checkpoint("q", model.state_dict(), model_id=0, num_targets=queries)
        traker.score_loader(query_set, batch_size=queries)
        scores = traker.finalize_scores("q")
        score = time.process_time() - start
    return {
        "fwd_bwd_cpu_s": ref,
        "featurize_cold_cpu_s": cold,
        "featurize_warm_cpu_s": warm,
        "score_cpu_s": score,
        "ratio_cold": cold / ref,
        "ratio_warm": warm / ref,
        "rss_after_fwd_bwd_mb": rss_ref,
        "rss_after_cold_mb": rss_cold,
        "rss_after_warm_mb": rss_warm,
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
    parser.add_argument("--method", choices=METHODS, nargs="+", default=list(METHODS))
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3, help="reference passes (median)")
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
                **run["result"],
                "peak_rss_mb": run["peak_rss_mb"],
            }
        )


if __name__ == "__main__":
    sys.exit(main())
