"""LM benchmark: featurization throughput and LDS, side by side with dattri and Kronfluence.

**Throughput** (``--part throughput``), in tokens per second, on two causal
LMs built from configs (byte vocabulary of 257, random init, no dropout):

* ``tiny``: the LM demo's model (2 layers, width 64, sequence 64, batch 32);
* ``gpt2-small-shape``: GPT-2 small's shape (12 layers, width 768, 12
  heads, sequence 128, batch 4; the vocabulary stays 257, so ~85M weights).

Methods, each in a fresh process (``_common.run_isolated``) so its peak
resident memory is its own (the model and a batch included):

* ``forward+backward``: one forward of the batch, the summed token loss,
  ``backward()`` into ``.grad`` (what a training step pays);
* ``gradsketch hooks+factorized``: TRAK features of the batch
  (``language_modeling`` task, :class:`HookGradientComputer` with
  ``FactorizedProjector.from_budget`` of ``proj_dim`` 2048) plus Q;
* ``dattri vmap grads``: dattri's per-example gradient function
  (``AttributionTask.get_grad_loss_func``: ``vmap`` of ``grad`` over
  ``functional_call``), full gradients, no projection;
* ``kronfluence identity scores``: Kronfluence's per-example gradient path
  (its tracked ``nn.Linear`` hooks; GPT-2's ``Conv1D`` converted to
  ``nn.Linear`` first) timed as ``compute_pairwise_scores`` of the batch
  against one query with the identity strategy (no curvature).

A method that fails on a model is reported with its error, not dropped.

**LDS** (``--part lds``), the LM demo's protocol at benchmark size: one
model trained on ``num_train`` standard-library chunks, ``lds_models``
models retrained on random halves, the measurement each query chunk's
summed log-likelihood; gradsketch TRAK (one checkpoint) against
Kronfluence's ``identity`` and ``ekfac`` strategies on the same model, the
same training chunks and the same ground truth. Kronfluence's measurement
is the query's summed token loss (its convention: a positive score means
the training chunk lowers the query's loss, i.e. raises its
log-likelihood), so its scores enter the LDS unchanged.

    python benchmarks/bench_lm.py                  # both parts
    python benchmarks/bench_lm.py --quick          # tiny model only, smaller LDS
    python benchmarks/bench_lm.py --part lds --arch llama
    python benchmarks/bench_lm.py --part lds --from-demo demo_lm_out   # the demo's own LDS

With ``--from-demo`` the LDS part reuses a finished demo run: its first
checkpoint, its ground truth (``lds_truth.npz``) and its ensemble scores,
so the comparison is on exactly the demo's protocol without retraining.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import torch
from _common import median_time, run_isolated
from torch import Tensor, nn

from gradsketch.demos.protocols import emit, machine_info, setup_torch
from gradsketch.demos.protocols.influence import (
    TokenRows,
    conv1d_to_linear,
    kronfluence_lm_task,
    lm_split,
    token_loss,
)

PROJ_DIM = 2048
TARGET_RATIO = 1.5

#: name -> (layers, width, heads, sequence, batch)
SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    "tiny": (2, 64, 2, 64, 32),
    "gpt2-small-shape": (12, 768, 12, 128, 4),
}
METHODS = (
    "forward+backward",
    "gradsketch hooks+factorized",
    "dattri vmap grads",
    "kronfluence identity scores",
)


def _build(arch: str, shape: str) -> tuple[nn.Module, Tensor]:
    from gradsketch.demos.lm import LMDemoSettings, build_lm

    layers, width, heads, seq, batch = SHAPES[shape]
    settings = LMDemoSettings(arch=arch, n_layer=layers, width=width, n_head=heads, chunk_len=seq)
    model = build_lm(settings, seed=0).eval()
    ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(0))
    return model, ids


def _kronfluence_scores(
    model: nn.Module,
    train_ids: Tensor,
    query_ids: Tensor,
    strategy: str,
    workdir: str,
    batch_size: int,
) -> np.ndarray:
    """``[n_train, n_query]`` Kronfluence scores of ``strategy`` on a Linear-only ``model`` copy."""
    import copy
    import logging

    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.utils.dataset import DataLoaderKwargs

    task = kronfluence_lm_task()
    kf_model = prepare_model(conv1d_to_linear(copy.deepcopy(model)).eval(), task)
    analyzer = Analyzer(
        analysis_name="bench_lm",
        model=kf_model,
        task=task,
        cpu=True,
        disable_tqdm=True,
        output_dir=workdir,
        log_level=logging.WARNING,
    )
    analyzer.set_dataloader_kwargs(DataLoaderKwargs(num_workers=0))
    analyzer.fit_all_factors(
        factors_name=strategy,
        dataset=TokenRows(train_ids),
        per_device_batch_size=batch_size,
        factor_args=FactorArguments(strategy=strategy),
        overwrite_output_dir=True,
    )
    analyzer.compute_pairwise_scores(
        scores_name=f"{strategy}_scores",
        factors_name=strategy,
        query_dataset=TokenRows(query_ids),
        train_dataset=TokenRows(train_ids),
        per_device_query_batch_size=len(query_ids),
        per_device_train_batch_size=batch_size,
        score_args=ScoreArguments(),
        overwrite_output_dir=True,
    )
    scores = analyzer.load_pairwise_scores(f"{strategy}_scores")
    assert scores is not None
    return scores["all_modules"].float().numpy().T


# -- throughput ----------------------------------------------------------------------
def throughput_worker(arch: str, shape: str, method: str, repeats: int) -> dict[str, Any]:
    """Median seconds of ``method`` on one batch of ``shape`` (run in a fresh process)."""
    setup_torch(int(os.environ.get("BENCH_THREADS", "1")))
    import logging

    import gradsketch.attribution._lm as lm_task
    from gradsketch.attribution import HookGradientComputer
    from gradsketch.sketch import FactorizedProjector

    model, ids = _build(arch, shape)
    batch = lm_task.LanguageModelingModelOutput.as_batch((ids,))
    proj_dim = 0
    if method == "forward+backward":

        def fn() -> None:
            model.zero_grad(set_to_none=True)
            token_loss(model(input_ids=ids).logits, ids).sum().backward()

    elif method == "gradsketch hooks+factorized":
        task = lm_task.LanguageModelingModelOutput()
        hooks = HookGradientComputer(model, task)
        projector = FactorizedProjector.from_budget(model, PROJ_DIM, seed=0)
        proj_dim = int(projector.proj_dim)

        def fn() -> None:
            hooks.project(batch, projector, 0)
            hooks.compute_loss_grad(batch)

    elif method == "dattri vmap grads":
        from dattri.task import AttributionTask

        def loss(params: dict[str, Tensor], data: Tensor) -> Tensor:
            x = data.unsqueeze(0)
            out = torch.func.functional_call(model, params, args=(), kwargs={"input_ids": x})
            return token_loss(out.logits, x).sum()

        dtask = AttributionTask(loss_func=loss, model=model, checkpoints=model.state_dict())
        grad_fn = dtask.get_grad_loss_func(in_dims=(None, 0))
        flat = dtask.get_param(ckpt_idx=0)[0]

        def fn() -> None:
            grad_fn(flat, ids)

    elif method == "kronfluence identity scores":
        logging.getLogger("kronfluence").setLevel(logging.WARNING)
        workdir = tempfile.mkdtemp(prefix="bench_lm_kf_")

        def fn() -> None:
            _kronfluence_scores(model, ids, ids[:1], "identity", workdir, int(ids.shape[0]))

    else:
        raise ValueError(f"`method` must be one of {METHODS}, got {method!r}.")
    seconds = median_time(fn, repeats=repeats, warmup=1)
    return {"seconds": seconds, "proj_dim": proj_dim}


def throughput(arch: str, shapes: list[str], repeats: int, methods: list[str]) -> None:
    for shape in shapes:
        layers, width, _, seq, batch = SHAPES[shape]
        results: dict[str, dict[str, Any]] = {}
        for method in methods:
            load = os.getloadavg()
            try:
                out = run_isolated(
                    "bench_lm:throughput_worker", arch, shape, method, repeats, timeout=900
                )
                results[method] = {
                    "median_s": out["result"]["seconds"],
                    "proj_dim": out["result"]["proj_dim"],
                    "peak_rss_mb": out["peak_rss_mb"],
                }
            except Exception as err:  # a reference path that cannot run this model
                last = str(err).strip().splitlines()[-1:] or ["?"]
                results[method] = {"error": last[0][:300]}
            results[method]["loadavg_1min_before"] = round(load[0], 2)
        base = results.get("forward+backward", {}).get("median_s")
        for method, res in results.items():
            record: dict[str, Any] = {
                "bench": "lm_featurize",
                "arch": arch,
                "shape": shape,
                "layers": layers,
                "width": width,
                "seq": seq,
                "batch": batch,
                "method": method,
                "repeats": repeats,
                **res,
            }
            if "median_s" in res:
                record["tokens_per_s"] = batch * seq / res["median_s"]
                if base:
                    record["x_forward_backward"] = res["median_s"] / base
            if method.startswith("gradsketch") and "x_forward_backward" in record:
                record["target_x_forward_backward"] = TARGET_RATIO
                record["target_met"] = record["x_forward_backward"] <= TARGET_RATIO
            emit(record)


# -- LDS -----------------------------------------------------------------------------
def _compare(
    s: Any,
    model: nn.Module,
    train_ids: Tensor,
    query_ids: Tensor,
    masks: np.ndarray,
    outputs: np.ndarray,
    common: dict[str, Any],
    extra: dict[str, np.ndarray],
) -> None:
    """LDS of gradsketch TRAK (one checkpoint), ``extra`` scores and Kronfluence's strategies."""
    from gradsketch.attribution import linear_datamodeling_score
    from gradsketch.demos.lm import attribute

    for method, scores in extra.items():
        emit({**common, "method": method, "lds": linear_datamodeling_score(scores, masks, outputs)})
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        scores, _, record = attribute(
            [model], train_ids, query_ids, s, Path(tmp) / "trak", per_token=False
        )
        seconds = time.perf_counter() - start
        emit(
            {
                **common,
                "method": "gradsketch TRAK (hooks+factorized, 1 checkpoint)",
                "proj_dim": record["proj_dim"],
                "lds": linear_datamodeling_score(scores, masks, outputs),
                "seconds": seconds,
            }
        )
        for strategy in ("identity", "ekfac"):
            start = time.perf_counter()
            try:
                kf = _kronfluence_scores(
                    model, train_ids, query_ids, strategy, str(Path(tmp) / "kf"), 32
                )
            except Exception as err:  # reported, not dropped
                emit({**common, "method": f"kronfluence {strategy}", "error": str(err)[:300]})
                continue
            seconds = time.perf_counter() - start
            value = linear_datamodeling_score(kf, masks, outputs)
            emit({**common, "method": f"kronfluence {strategy}", "lds": value, "seconds": seconds})


def lds(arch: str, num_train: int, num_queries: int, lds_models: int, epochs: int) -> None:
    """Train one model and its LDS ground truth here, then compare the methods on them."""
    from gradsketch.demos.lm import LMDemoSettings, lds_truth, train_lm

    s = LMDemoSettings(
        arch=arch,
        num_train=num_train,
        num_queries=num_queries,
        epochs=epochs,
        lds_models=lds_models,
        num_checkpoints=1,
        # Below n, so that ΦᵀΦ is invertible without damping.
        proj_dim=min(512, num_train // 2),
    )
    train_ids, query_ids = lm_split(s)
    start = time.perf_counter()
    model, _ = train_lm(train_ids, s, seed=s.seed + 1)
    train_s = time.perf_counter() - start
    start = time.perf_counter()
    truth = lds_truth(s, train_ids, query_ids)
    common = {
        "bench": "lm_lds",
        "source": "trained here",
        "arch": arch,
        "num_train": num_train,
        "num_queries": num_queries,
        "lds_models": lds_models,
        "epochs": epochs,
        "measurement": "summed log-likelihood of the query chunk",
        "train_s": train_s,
        "ground_truth_s": time.perf_counter() - start,
    }
    _compare(s, model, train_ids, query_ids, truth.subset_masks, truth.target_outputs, common, {})


def lds_from_demo(demo_dir: str) -> None:
    """Compare the methods on the LM demo's first checkpoint and LDS ground truth."""
    from gradsketch.demos.lm import LMDemoSettings, build_lm

    folder = Path(demo_dir)
    summary = json.loads((folder / "summary.json").read_text())
    fields = {**summary["settings"], "modules": tuple(summary["settings"]["modules"])}
    s = LMDemoSettings(**fields)
    train_ids, query_ids = lm_split(s)
    model = build_lm(s, seed=0)
    model.load_state_dict(torch.load(folder / "model_0.pt", weights_only=True))
    model.eval()
    truth = np.load(folder / "lds_truth.npz")
    common = {
        "bench": "lm_lds",
        "source": f"LM demo run in {demo_dir}",
        "arch": s.arch,
        "num_train": s.num_train,
        "num_queries": s.num_queries,
        "lds_models": s.lds_models,
        "epochs": s.epochs,
        "measurement": summary["lds_protocol"]["measurement"],
    }
    extra = {
        f"gradsketch TRAK (demo, {s.num_checkpoints} checkpoints)": np.load(folder / "scores.npy")
    }
    _compare(s, model, train_ids, query_ids, truth["masks"], truth["outputs"], common, extra)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", choices=("throughput", "lds", "both"), default="both")
    parser.add_argument("--arch", default="gpt2", help="gpt2, llama or gpt_neox")
    parser.add_argument("--quick", action="store_true", help="tiny shape only, small LDS")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shape", choices=list(SHAPES), action="append", help="repeatable")
    parser.add_argument("--method", choices=METHODS, action="append", help="repeatable")
    parser.add_argument(
        "--from-demo", metavar="DIR", help="LDS on a finished LM demo run (its model and truth)"
    )
    args = parser.parse_args()
    setup_torch(1)
    emit({"bench": "lm", "machine": machine_info()})
    if args.part in ("throughput", "both"):
        shapes = args.shape or (["tiny"] if args.quick else list(SHAPES))
        methods = args.method or list(METHODS)
        throughput(args.arch, shapes, 1 if args.quick else args.repeats, methods)
    if args.part in ("lds", "both"):
        if args.from_demo:
            lds_from_demo(args.from_demo)
        elif args.quick:
            lds(args.arch, num_train=128, num_queries=8, lds_models=6, epochs=2)
        else:
            lds(args.arch, num_train=512, num_queries=16, lds_models=16, epochs=3)


if __name__ == "__main__":
    main()
