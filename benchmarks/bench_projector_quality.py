"""Projector quality on trained language models: how well inner products survive projection.

For each of three tiny causal LMs built from transformers configs (GPT-2,
Llama, Qwen2: 2 layers, width 64, byte vocabulary of 256, sequence 32),
trained for a few hundred AdamW steps on standard-library chunks (the LM
demo's corpus, :mod:`gradsketch.demos._lm_corpus`) so that the loss has
clearly dropped:

1. exact float64 per-example gradients ``G`` of the ``language_modeling``
   output (summed per-token log-odds) of ``num_train`` training chunks and
   ``num_queries`` held-out query chunks, from
   :class:`~gradsketch.attribution.HookGradientComputer` on a float64 copy
   of the model (checked against autograd on the summed batch output);
2. for every projector a gradient computer can default to, at each ``k``
   and for each projector seed, the projected features ``P G`` and the
   Pearson correlation, over all train x query pairs, between the exact
   inner products ``G_train G_queryᵀ`` and the projected ones
   ``(P G_train)(P G_query)ᵀ`` (scale-free, so TRAK's ``1/sqrt(d)`` does
   not matter);
3. TRAK-score agreement: Pearson between the scores
   ``X (XᵀX + λI)⁻¹ Tᵀ ⊙ Q`` from the projected features and the same
   scores from the exact gradients. Every feature set gets the same damping
   relative to its own scale, ``λ = 0.1 · trace(XᵀX) / n`` (a tenth of the
   mean eigenvalue of its ``[n, n]`` Gram matrix), so that only the
   projection differs (``lambda_reg="auto"`` divides by ``k`` instead and
   would damp each ``k`` differently). Up to ``k = 512`` the scores come
   from :func:`gradsketch.attribution.trak_scores`; above it, and for the
   exact gradients, through the Gram matrix
   (``X (XᵀX + λI)⁻¹ = (XXᵀ + λI)⁻¹ X``, the same scores: the tests check
   it), since with ``n = 256`` rows the ``[k, k]`` inverse only costs time
   (~50 s at ``k = 4096`` on a loaded 2-core machine);
4. featurization time: seconds to featurize the ``num_train`` rows in
   batches of ``batch`` through ``gc.project(batch, projector, model_id)``
   on the float32 model, as :class:`~gradsketch.attribution.TRAKer` does
   (per-example gradients plus projection; the factorized projector never
   forms the per-example gradients of Linear / Conv1D layers); the median of
   ``repeats`` interleaved runs after a warm-up, in wall time (``seconds``)
   and in this process's CPU time (``cpu_seconds``, steadier when other
   work shares the cores). One intra-op thread by default (``--threads``):
   on a 2-core machine that other sessions load, two OpenMP threads spin
   against the other work and a 40-step training took 40 s instead of 1.7 s.

Projectors: ``FactorizedProjector.from_budget(model, k)`` (the default of
the hook computer on CPU, whose layout gives at most ``k`` features: the
row's ``features``), ``CountSketchProjector`` (the default elsewhere on
CPU), ``SparseProjector`` with ``nnz = 4`` and the dense
``BasicProjector`` with Rademacher entries (the entries of TRAK's CUDA
default), plus a ``CountSketchProjector`` at ``reference_k`` as a check
that the measurement itself is sound (its correlation must be near 1).
The dense projector regenerates its ``d x k`` matrix on every call: at
``k = 4096`` that is ~50 s per 256 rows and ~30 s per seed for the float64
projection, so by default it runs only up to ``dense_max_k = 512``
(``--dense-max-k 4096`` adds it; above 512 it is then timed once, without
warm-up, and ``timing_repeats`` says so).

One JSON line per model x projector x k: ``model``, ``projector``, ``k``,
``features``, ``pearson_mean`` / ``_min`` / ``_max`` over the seeds,
``pearson_query_mean`` (the per-query correlations across training rows,
averaged), ``score_pearson_*``, ``seconds`` and ``cpu_seconds``, the
training losses, the load average and ``cpu``.

    python benchmarks/bench_projector_quality.py            # ~3 minutes, 1 thread
    python benchmarks/bench_projector_quality.py --quick    # smoke run, < 1 minute
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from gradsketch.attribution import HookGradientComputer, trak_scores
from gradsketch.attribution._modelout import resolve_task
from gradsketch.demos._lm_corpus import load_corpus, split_chunks
from gradsketch.demos.protocols import cpu_model, emit, setup_torch
from gradsketch.sketch import (
    BasicProjector,
    CountSketchProjector,
    FactorizedProjector,
    SparseProjector,
)

MODELS = ("gpt2", "llama", "qwen2")
FACTORIZED = "FactorizedProjector.from_budget"
COUNTSKETCH = "CountSketchProjector"
SPARSE_NNZ = 4
SPARSE = f"SparseProjector(nnz={SPARSE_NNZ})"
DENSE = "BasicProjector(rademacher)"
PROJECTORS = (FACTORIZED, COUNTSKETCH, SPARSE, DENSE)
#: The dense projector above this k is timed once (it regenerates d * k entries per call).
DENSE_REPEAT_MAX_K = 512
#: Feature sets up to this k are scored with trak_scores (a [k, k] inverse); larger ones
#: through the [n, n] Gram matrix, which gives the same scores.
TRAK_SCORES_MAX_K = 512


@dataclass(frozen=True)
class Settings:
    """What one run measures (the defaults are the full run)."""

    models: tuple[str, ...] = MODELS
    layers: int = 2
    width: int = 64
    heads: int = 4
    seq: int = 32
    steps: int = 300
    train_batch: int = 32
    lr: float = 3e-3
    num_train: int = 256
    num_queries: int = 32
    ks: tuple[int, ...] = (512, 4096)
    seeds: tuple[int, ...] = (0, 1, 2)
    reference_k: int = 16384
    batch: int = 32
    repeats: int = 3
    dense_max_k: int = 512
    data_seed: int = 0
    threads: int = 1


QUICK = {
    "steps": 40,
    "num_train": 64,
    "num_queries": 8,
    "ks": (512,),
    "seeds": (0, 1),
    "repeats": 1,
}


def log(message: str) -> None:
    """Progress on stderr (stdout carries only the JSON lines)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- models and training ---------------------------------------------------------------
def build_model(arch: str, s: Settings, seed: int) -> nn.Module:
    """A freshly initialised tiny causal LM over the 256 byte values, without dropout."""
    torch.manual_seed(seed)
    common = {"vocab_size": 256, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    if arch == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(
            n_positions=s.seq,
            n_embd=s.width,
            n_layer=s.layers,
            n_head=s.heads,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **common,
        )
        return GPT2LMHeadModel(cfg)
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            hidden_size=s.width,
            intermediate_size=4 * s.width,
            num_hidden_layers=s.layers,
            num_attention_heads=s.heads,
            num_key_value_heads=s.heads,
            max_position_embeddings=s.seq,
            **common,
        )
        return LlamaForCausalLM(cfg)
    if arch == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        cfg = Qwen2Config(
            hidden_size=s.width,
            intermediate_size=4 * s.width,
            num_hidden_layers=s.layers,
            num_attention_heads=s.heads,
            num_key_value_heads=max(1, s.heads // 2),
            max_position_embeddings=s.seq,
            **common,
        )
        return Qwen2ForCausalLM(cfg)
    raise ValueError(f"unknown model {arch!r}; choose from {MODELS}.")


def next_token_loss(model: nn.Module, ids: Tensor) -> Tensor:
    """Mean cross-entropy of each next byte."""
    logits = model(input_ids=ids).logits
    return nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
    )


def train_model(model: nn.Module, ids: Tensor, s: Settings, seed: int) -> dict[str, float]:
    """AdamW on random batches of ``ids``, learning rate decaying linearly to 0; eval mode after.

    Returns:
        The first step's loss, the mean loss of the first and of the last 10 % of the
        steps, and the seconds taken.
    """
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 - step / s.steps)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    start = time.perf_counter()
    for _ in range(s.steps):
        rows = torch.randint(0, ids.shape[0], (s.train_batch,), generator=gen)
        loss = next_token_loss(model, ids[rows])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.detach().item())
    model.eval()
    tail = max(1, s.steps // 10)
    return {
        "loss_first_step": losses[0],
        "loss_initial": float(np.mean(losses[:tail])),
        "loss_final": float(np.mean(losses[-tail:])),
        "train_seconds": time.perf_counter() - start,
    }


# -- gradients and projections ----------------------------------------------------------
def batches_of(ids: Tensor, size: int, task: Any) -> list[tuple[Tensor, ...]]:
    """Canonical ``language_modeling`` batches (ids, mask, labels) of ``size`` rows."""
    return [task.as_batch((ids[i : i + size],)) for i in range(0, ids.shape[0], size)]


def exact_gradients(gc: HookGradientComputer, batches: Sequence[tuple[Tensor, ...]]) -> Tensor:
    """``[rows, d]`` per-example gradients, flattened in ``named_parameters`` order."""
    rows = []
    for batch in batches:
        grads = gc.compute_per_sample_grad(batch)
        rows.append(torch.cat([g.reshape(g.shape[0], -1) for g in grads.values()], dim=1))
    return torch.cat(rows)


def autograd_check(model: nn.Module, task: Any, batch: tuple[Tensor, ...], g: Tensor) -> float:
    """Relative error of the summed per-example gradients against autograd's batch gradient."""
    params = [p for _, p in model.named_parameters()]
    out = task.get_batch_output(model, *batch).sum()
    ref = torch.autograd.grad(out, params)
    ref_flat = torch.cat([r.reshape(-1) for r in ref])
    return float((g.sum(0) - ref_flat).norm() / ref_flat.norm())


def make_projector(name: str, model: nn.Module, d: int, k: int, seed: int) -> Any:
    """The projector ``name`` of size ``k`` (an upper bound for the factorized one)."""
    if name == FACTORIZED:
        return FactorizedProjector.from_budget(model, k, seed=seed, device="cpu")
    if name == COUNTSKETCH:
        return CountSketchProjector(d, k, seed, "cpu")
    if name == SPARSE:
        return SparseProjector(d, k, seed, SPARSE_NNZ, "cpu")
    if name == DENSE:
        return BasicProjector(d, k, seed, "rademacher", "cpu", block_size=min(k, 512))
    raise ValueError(f"unknown projector {name!r}")


def project_rows(
    projector: Any,
    gc: HookGradientComputer,
    batches: Sequence[tuple[Tensor, ...]],
    grads: Tensor,
) -> Tensor:
    """Projected features of every row.

    The factorized map goes through the hooks (its fast path); the others project ``grads``.
    """
    if isinstance(projector, FactorizedProjector):
        return torch.cat([gc.project(b, projector, 0) for b in batches])
    return projector.project(grads, model_id=0)


def interleaved_times(
    fns: dict[str, Callable[[], Any]], repeats: int, warmup: int
) -> dict[str, tuple[float, float]]:
    """Median wall and process CPU seconds of each function, timed round-robin.

    CPU time is the steadier of the two when other work shares the cores (it
    counts this process's threads only, spin-waiting included).
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            wall0, cpu0 = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - wall0)
            cpu[name].append(time.process_time() - cpu0)
    return {name: (statistics.median(wall[name]), statistics.median(cpu[name])) for name in fns}


def pearson(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson correlation of the flattened arrays."""
    return float(np.corrcoef(np.ravel(a), np.ravel(b))[0, 1])


def query_pearson(exact: np.ndarray, approx: np.ndarray) -> float:
    """Mean over queries (columns) of the correlation across training rows."""
    return float(np.mean([pearson(exact[:, j], approx[:, j]) for j in range(exact.shape[1])]))


def damping(x: np.ndarray) -> float:
    """``0.1 * trace(XᵀX) / n``: a tenth of the mean eigenvalue of the Gram matrix."""
    return 0.1 * float(np.sum(x * x)) / x.shape[0]


def gram_scores(x: np.ndarray, t: np.ndarray, q: np.ndarray, lam: float) -> np.ndarray:
    """``X (XᵀX + λI)⁻¹ Tᵀ ⊙ Q`` as ``(XXᵀ + λI)⁻¹ X Tᵀ ⊙ Q``, in float64."""
    gram = x @ x.T + lam * np.eye(x.shape[0])
    return np.linalg.solve(gram, x @ t.T) * q.reshape(-1, 1)


def scores_of(x: np.ndarray, t: np.ndarray, q: np.ndarray) -> np.ndarray:
    """TRAK scores of one feature set with the scale-matched damping (see the module docs)."""
    lam = damping(x)
    if x.shape[1] <= TRAK_SCORES_MAX_K:
        return np.asarray(trak_scores(x, t, q, lambda_reg=lam), dtype=np.float64)
    return gram_scores(x, t, q, lam)


# -- one model ----------------------------------------------------------------------------
def measure_model(arch: str, s: Settings, corpus: Any, emit_row: Callable[[dict], None]) -> None:
    """Train one model, then emit a row per projector and k."""
    train_idx, query_idx = split_chunks(len(corpus), s.num_train, s.num_queries, seed=s.data_seed)
    pool = np.setdiff1d(np.arange(len(corpus)), query_idx)
    model = build_model(arch, s, seed=s.data_seed)
    train_info = train_model(model, corpus.token_ids(pool), s, seed=s.data_seed)
    log(
        f"{arch}: trained {s.steps} steps in {train_info['train_seconds']:.1f} s, loss "
        f"{train_info['loss_initial']:.3f} -> {train_info['loss_final']:.3f}"
    )

    task = resolve_task("language_modeling")
    model64 = copy.deepcopy(model).double()
    d = sum(p.numel() for p in model.parameters())
    gc64 = HookGradientComputer(model64, task, d, torch.float64, "cpu")
    train_b = batches_of(corpus.token_ids(train_idx), s.batch, task)
    query_b = batches_of(corpus.token_ids(query_idx), s.batch, task)
    all_b = train_b + query_b
    grads = exact_gradients(gc64, all_b)
    check = autograd_check(model64, task, train_b[0], grads[: train_b[0][0].shape[0]])
    q = gc64.compute_loss_grad(task.as_batch((corpus.token_ids(train_idx),))).numpy().ravel()
    n = s.num_train
    g = grads.numpy()
    exact_ip = g[:n] @ g[n:].T
    exact_scores = gram_scores(
        g[:n] / math.sqrt(d), g[n:] / math.sqrt(d), q, damping(g[:n] / math.sqrt(d))
    )

    gc32 = HookGradientComputer(model, task, d, torch.float32, "cpu")

    def featurize(projector: Any) -> Callable[[], None]:
        def run() -> None:
            for b in train_b:
                gc32.project(b, projector, 0)

        return run

    plan = [(k, [p for p in PROJECTORS if p != DENSE or k <= s.dense_max_k]) for k in s.ks]
    plan.append((s.reference_k, [COUNTSKETCH]))
    for k, names in plan:
        timing = {name: make_projector(name, model, d, k, s.seeds[0]) for name in names}
        slow = {name for name in names if name == DENSE and k > DENSE_REPEAT_MAX_K}
        seconds = interleaved_times(
            {name: featurize(p) for name, p in timing.items() if name not in slow},
            repeats=s.repeats,
            warmup=1,
        )
        for name in slow:
            seconds |= interleaved_times({name: featurize(timing[name])}, repeats=1, warmup=0)
        del timing
        log(f"{arch}: k={k} timed " + ", ".join(f"{p} {t[0]:.2f} s" for p, t in seconds.items()))
        for name in names:
            stats: dict[str, list[float]] = {"ip": [], "query": [], "score": []}
            features = 0
            consistency = None
            for seed in s.seeds:
                projector = make_projector(name, model64, d, k, seed)
                features = int(projector.proj_dim)
                phi = project_rows(projector, gc64, all_b, grads).numpy()
                if name == FACTORIZED and seed == s.seeds[0]:
                    # The hooks' fast path against the same map on the exact gradients.
                    generic = projector.project(grads, model_id=0).numpy()
                    consistency = float(np.abs(phi - generic).max() / np.abs(generic).max())
                x, t = phi[:n] / math.sqrt(d), phi[n:] / math.sqrt(d)
                approx_ip = phi[:n] @ phi[n:].T
                stats["ip"].append(pearson(exact_ip, approx_ip))
                stats["query"].append(query_pearson(exact_ip, approx_ip))
                stats["score"].append(pearson(exact_scores, scores_of(x, t, q)))
            row = {
                "model": arch,
                "projector": name,
                "k": k,
                "features": features,
                "pearson_mean": float(np.mean(stats["ip"])),
                "pearson_min": float(np.min(stats["ip"])),
                "pearson_max": float(np.max(stats["ip"])),
                "pearson_query_mean": float(np.mean(stats["query"])),
                "score_pearson_mean": float(np.mean(stats["score"])),
                "score_pearson_min": float(np.min(stats["score"])),
                "score_pearson_max": float(np.max(stats["score"])),
                "seeds": len(s.seeds),
                "seconds": seconds[name][0],
                "cpu_seconds": seconds[name][1],
                "timing_repeats": 1 if name in slow else s.repeats,
                "rows_timed": s.num_train,
                "batch": s.batch,
                "threads": torch.get_num_threads(),
                "grad_dim": d,
                "num_queries": s.num_queries,
                "autograd_rel_err": check,
                **train_info,
                "load": os.getloadavg()[0],
                "cpu": cpu_model(),
            }
            if consistency is not None:
                row["hooks_vs_generic_rel_diff"] = consistency
            emit_row(row)


def parse_args(argv: Sequence[str] | None) -> Settings:
    """Command-line options over :class:`Settings` (``--quick`` first, then explicit options)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run, < 1 minute")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=None)
    parser.add_argument("--ks", nargs="+", type=int, default=None, help="sketch sizes")
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="projector seeds")
    for name in (
        "layers", "width", "heads", "seq", "steps", "num_train", "num_queries",
        "reference_k", "batch", "repeats", "dense_max_k", "threads",
    ):  # fmt: skip
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    args = parser.parse_args(argv)
    s = replace(Settings(), **QUICK) if args.quick else Settings()
    explicit = {
        key: (tuple(value) if isinstance(value, list) else value)
        for key, value in vars(args).items()
        if key != "quick" and value is not None
    }
    return replace(s, **explicit)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Run the benchmark; print and return the rows."""
    s = parse_args(argv)
    setup_torch(s.threads)
    corpus = load_corpus(chunk_len=s.seq)
    rows: list[dict[str, Any]] = []

    def emit_row(row: dict[str, Any]) -> None:
        rows.append(row)
        emit(row)

    for arch in s.models:
        measure_model(arch, s, corpus, emit_row)
    return rows


if __name__ == "__main__":
    main()
