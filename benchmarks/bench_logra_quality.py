"""Inner products of per-layer projected rows (LoGra) against the exact per-layer gradients.

The issue (49, item 4): the per-layer projection's inner products are
preserved as :class:`~gradsketch.sketch.FactorizedProjector`'s docstring
promises (``E<P G_i, P G_j> = <G_i, G_j>``, variance as stated there), with
the error against the exact features measured at k = 16, 64 and 256 per
side. This script measures it on GPT-2 layouts through the rows that
``TRAKer(method=..., projection=(k, k))`` stores:
:class:`~gradsketch.attribution._kronecker_features.KroneckerFeaturizer`
with ``projection=(k, k)`` (each layer's inputs times ``P_inᵀ / sqrt(k)``,
output gradients times ``P_outᵀ / sqrt(k)``) against the same featurizer
with ``projection=None``, in float64.

Models: GPT-2 configs built in code with a byte vocabulary (256, so the
tied head is exact and cheap), 128-token chunks of the standard library's
source (the LM demo's corpus), trained ``steps`` AdamW steps so that the
gradients are those of a model that has learnt something:
``2x128`` (2 blocks, width 128) and ``1x768`` (one GPT-2-small block, width
768). Every Linear / ``Conv1D`` layer, the tied head included, is a factored
layer; sides larger than a layer's are capped at it (so k = 256 is exact on
the 128-wide layers' input side).

For ``n_train`` training and ``n_query`` query chunks, the exact and the
projected inner products ``K[i, j] = sum_layers <G_i, G_j>`` are formed
from each layer's token Gram matrices (``<G_i, G_j> = sum_{t,s} (a_it·a_js)
(g_it·g_js)``), never from the ``d_out x d_in`` gradients. Per ``k`` and
projection seed, one JSON line: ``rel_fro`` (``‖K_k - K‖_F / ‖K‖_F``),
``pearson`` over the ``n_train x n_query`` pairs, ``cos_rmse`` (the RMS of
``(K_k - K)[i, j] / (|G_i| |G_j|)``: the error in cosine units),
``median_rel`` (median over pairs of ``|K_k - K| / |K|``) and, where the
layers are small enough to form ``V Wᵀ`` (``--predict-max-width``), the RMS
``cos`` error the docstring's variance formula predicts (summed over layers,
which have independent factors), so measured and promised can be compared.
The seeds' mean of ``K_k`` against ``K`` (``bias_rel``) checks the
unbiasedness.

Run ``python benchmarks/bench_logra_quality.py`` (``--quick``: 2x128 only, 1 seed).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

F64 = torch.float64
CONFIGS = {"2x128": (2, 128, 4), "1x768": (1, 768, 12)}


def emit(row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)


def build(name: str, seed: int = 0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    n_layer, width, heads = CONFIGS[name]
    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=n_layer,
        n_embd=width,
        n_head=heads,
        vocab_size=256,
        n_positions=128,
        attn_pdrop=0.0,
        embd_pdrop=0.0,
        resid_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def train(model: nn.Module, ids: Tensor, steps: int, seed: int = 0) -> float:
    """``steps`` AdamW steps on random batches of 16 chunks; the last loss per token."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        x = ids[torch.randint(0, int(ids.shape[0]), (16,), generator=g)]
        logits = model(input_ids=x).logits[:, :-1]
        loss = nn.functional.cross_entropy(logits.transpose(1, 2), x[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    return float(loss.detach())


def parts(model: nn.Module, ids: Tensor, projection: tuple[int, int] | None, seed: int):
    """Per layer ``(a [B, T, k_in], g [B, T, k_out])`` of the stored rows, float64."""
    import gradsketch.attribution._lm  # noqa: F401  (registers "language_modeling")
    from gradsketch.attribution._kronecker_features import KroneckerFeaturizer
    from gradsketch.attribution._modelout import resolve_task

    featurizer = KroneckerFeaturizer(
        model,
        resolve_task("language_modeling"),
        grad_wrt=None,
        projection=projection,
        projection_seed=seed,
        curvature="loss",
        sample_seed=0,
        device=torch.device("cpu"),
        dtype=F64,
    )
    featurizer.set_model_id(0)
    out = []
    for first in range(0, int(ids.shape[0]), 8):
        x = ids[first : first + 8]
        got, _ = featurizer.layer_parts((x, torch.ones_like(x), x.clone()))
        out.append([(a.detach(), g.detach()) for a, g, _ in got])
    layers = [x.name for x in featurizer.layers]
    merged = [
        (torch.cat([b[i][0] for b in out]), torch.cat([b[i][1] for b in out]))
        for i in range(len(layers))
    ]
    return layers, merged


def gram(p: list[tuple[Tensor, Tensor]], rows: slice, cols: slice) -> Tensor:
    """``sum_layers <G_i, G_j>`` for ``i`` in ``rows``, ``j`` in ``cols`` from token Grams."""
    total = None
    for a, g in p:
        ga = torch.einsum("ntd,msd->nmts", a[rows], a[cols])
        gg = torch.einsum("ntd,msd->nmts", g[rows], g[cols])
        k = (ga * gg).sum((2, 3))
        total = k if total is None else total + k
    assert total is not None
    return total


def predicted_cos_rmse(
    p: list[tuple[Tensor, Tensor]], n_train: int, k: int, norms: Tensor
) -> float | None:
    """RMS over pairs of the formula's standard deviation, in cosine units (small layers only).

    A side whose ``k`` is not below its width is stored exact (no variance), as the rows are.
    """
    from gradsketch.sketch._factorized import kronecker_inner_product_variance

    var = torch.zeros(n_train, int(norms.shape[0]) - n_train, dtype=F64)
    for a, g in p:
        d_in, d_out = int(a.shape[-1]), int(g.shape[-1])
        mats = torch.einsum("nto,nti->noi", g, a)
        for i in range(n_train):
            for j in range(n_train, int(norms.shape[0])):
                var[i, j - n_train] += kronecker_inner_product_variance(
                    mats[i], mats[j], k_in=k if k < d_in else None, k_out=k if k < d_out else None
                )
    scale = norms[:n_train, None] * norms[None, n_train:]
    return float((var / scale**2).mean().sqrt())


def measure(name: str, args: argparse.Namespace, corpus: Any) -> None:
    from gradsketch.demos._lm_corpus import split_chunks

    train_idx, query_idx = split_chunks(len(corpus), args.n_train, args.n_query, seed=0)
    train_ids, query_ids = corpus.token_ids(train_idx), corpus.token_ids(query_idx)
    model = build(name)
    start = time.process_time()
    loss = train(model, corpus.token_ids(), args.steps)
    model = model.double()
    ids = torch.cat([train_ids, query_ids])
    n = args.n_train
    layers, exact_parts = parts(model, ids, None, 0)
    exact = gram(exact_parts, slice(0, n), slice(n, None))
    self_ip = torch.cat(
        [gram(exact_parts, slice(i, i + 1), slice(i, i + 1)).reshape(1) for i in range(len(ids))]
    )
    norms = self_ip.sqrt()
    widest = max(max(a.shape[-1], g.shape[-1]) for a, g in exact_parts)
    scale = norms[:n, None] * norms[None, n:]
    for k in args.ks:
        estimates = []
        for seed in args.seeds:
            _, proj_parts = parts(model, ids, (k, k), seed)
            est = gram(proj_parts, slice(0, n), slice(n, None))
            estimates.append(est)
            diff = est - exact
            emit(
                {
                    "bench": "logra_inner_products",
                    "model": name,
                    "layers": len(layers),
                    "k_per_side": k,
                    "seed": seed,
                    "rel_fro": float(diff.norm() / exact.norm()),
                    "pearson": float(np.corrcoef(est.flatten(), exact.flatten())[0, 1]),
                    "cos_rmse": float((diff / scale).pow(2).mean().sqrt()),
                    "median_rel": float((diff.abs() / exact.abs()).median()),
                    "pairs": int(exact.numel()),
                }
            )
        mean = torch.stack(estimates).mean(0)
        predicted = (
            predicted_cos_rmse(exact_parts, n, k, norms)
            if widest <= args.predict_max_width
            else None
        )
        emit(
            {
                "bench": "logra_inner_products_summary",
                "model": name,
                "k_per_side": k,
                "seeds": len(args.seeds),
                "bias_rel": float((mean - exact).norm() / exact.norm()),
                "predicted_cos_rmse": predicted,
                "train_loss_per_token": loss,
                "cpu_seconds_so_far": round(time.process_time() - start, 1),
            }
        )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2x128 only, one seed, k = 16")
    parser.add_argument("--models", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--ks", nargs="+", type=int, default=[16, 64, 256])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--n-train", type=int, default=32)
    parser.add_argument("--n-query", type=int, default=8)
    parser.add_argument("--steps", type=int, default=60, help="AdamW steps before measuring")
    parser.add_argument("--predict-max-width", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.seeds, args.ks, args.steps = ["2x128"], [0], [16], 10
    torch.set_num_threads(args.threads)
    from gradsketch.demos._lm_corpus import load_corpus
    from gradsketch.demos.protocols import machine_info

    emit({"bench": "machine", **machine_info()})
    corpus = load_corpus(chunk_len=128)
    for name in args.models:
        measure(name, args, corpus)


if __name__ == "__main__":
    main()
