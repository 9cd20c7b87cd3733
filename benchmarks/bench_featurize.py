"""Featurization benchmark: TRAK features of one batch, side by side with traker.

Two models: the digits MLP (64-256-256-10, 85,002 parameters, a batch of 256
digits) and a small transformer (4 pre-norm blocks, width 256, sequence 64,
vocabulary 1,000, synthetic tokens, a batch of 16, ~3.4M parameters). For
each, the median time (over repeats, after a warm-up) of:

* ``forward+backward``: a plain forward of the batch, the summed margin, and
  ``backward()`` into the parameters' ``.grad`` (the cost a training step pays);
* ``gradsketch hooks+FactorizedProjector``: :class:`HookGradientComputer.project`
  with a :class:`FactorizedProjector` (no per-example gradient of any
  Linear / Conv2d layer is formed) plus the out-to-loss terms Q;
* ``gradsketch vmap+CountSketchProjector``: ``torch.func`` per-example
  gradients projected by a count sketch, plus Q;
* ``traker vmap+BasicProjector``: traker's CPU default (its
  ``FunctionalGradientComputer`` and a normal ``BasicProjector``), plus Q.

Every method produces ``proj_dim``-wide features. Target: hooks +
FactorizedProjector <= 2x forward+backward. The gradsketch methods and the
plain step are timed round-robin (interleaved), so a load swing on a shared
machine hits them alike; each record carries ``os.getloadavg()`` before and
after. One JSON line per (model, method).

    python benchmarks/bench_featurize.py            # both models, 5 repeats
    python benchmarks/bench_featurize.py --quick    # 2 repeats, traker skipped on the transformer

Scaling over torch.distributed ranks is measured by `bench_distributed.py`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from _common import interleaved_medians, median_time
from torch import nn

from gradsketch.attribution import (
    FunctionalGradientComputer,
    HookGradientComputer,
    ImageClassificationModelOutput,
    TransformerClassifier,
)
from gradsketch.demos import build_mlp, load_digits_split
from gradsketch.demos.protocols import emit, machine_info, setup_torch
from gradsketch.sketch import CountSketchProjector, FactorizedProjector

PROJ_DIM = 2048
TARGET_RATIO = 2.0


def _margin_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    is_label = torch.arange(logits.shape[-1]) == labels.reshape(-1, 1)
    correct = (logits * is_label).sum(-1)
    return (correct - logits.masked_fill(is_label, float("-inf")).logsumexp(-1)).sum()


def _workloads(name: str) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], dict[str, int]]:
    torch.manual_seed(0)
    if name == "digits_mlp":
        split = load_digits_split(seed=0)
        batch = (split.x_train[:256], split.y_train[:256])
        return build_mlp(seed=0).eval(), batch, {"k_in": 26, "k_out": 26}
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 1000, (16, 64), generator=gen)
    labels = torch.randint(0, 10, (16,), generator=gen)
    return TransformerClassifier().eval(), (tokens, labels), {"k_in": 8, "k_out": 8}


def _methods(
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    dims: dict[str, int],
    with_traker: bool,
) -> dict[str, tuple[Callable[[], Any], int]]:
    task = ImageClassificationModelOutput()
    grad_dim = sum(p.numel() for p in model.parameters())

    def forward_backward() -> None:
        model.zero_grad(set_to_none=True)
        _margin_sum(model(batch[0]), batch[1]).backward()

    # Per-layer blocks of k_in * k_out; the rest block fills the width to PROJ_DIM.
    probe = FactorizedProjector.from_model(model, seed=0, rest_proj_dim=1, **dims)
    rest = PROJ_DIM - (probe.proj_dim - probe.rest_proj_dim)
    factorized = FactorizedProjector.from_model(model, seed=0, rest_proj_dim=max(rest, 1), **dims)
    hooks = HookGradientComputer(model, task)

    def hooks_factorized() -> None:
        hooks.project(batch, factorized, 0)
        hooks.compute_loss_grad(batch)

    vmap = FunctionalGradientComputer(model, task)
    sketch = CountSketchProjector(grad_dim, PROJ_DIM, 0, "cpu")

    def vmap_countsketch() -> None:
        sketch.project(vmap.compute_per_sample_grad(batch), 0)
        vmap.compute_loss_grad(batch)

    methods = {
        "forward+backward": (forward_backward, 0),
        "gradsketch hooks+FactorizedProjector": (hooks_factorized, factorized.proj_dim),
        "gradsketch vmap+CountSketchProjector": (vmap_countsketch, PROJ_DIM),
    }
    if with_traker:
        from trak.gradient_computers import FunctionalGradientComputer as TrakFunctional
        from trak.modelout_functions import ImageClassificationModelOutput as TrakOutput
        from trak.projectors import BasicProjector as TrakBasic
        from trak.projectors import ProjectionType

        trak_gc = TrakFunctional(model, TrakOutput(), grad_dim, torch.float32, "cpu")
        trak_proj = TrakBasic(
            grad_dim, PROJ_DIM, 0, ProjectionType.normal, "cpu", dtype=torch.float32
        )

        def traker_default() -> None:
            trak_proj.project(trak_gc.compute_per_sample_grad(batch), model_id=0)
            trak_gc.compute_loss_grad(batch)

        methods["traker vmap+BasicProjector"] = (traker_default, PROJ_DIM)
    return methods


def run(workload: str, repeats: int, with_traker: bool, traker_repeats: int) -> None:
    model, batch, dims = _workloads(workload)
    methods = _methods(model, batch, dims, with_traker)
    grad_dim = sum(p.numel() for p in model.parameters())
    load_before = os.getloadavg()
    # gradsketch methods and the plain step are interleaved (their ratio is
    # the target); traker is timed on its own, it can take minutes per batch.
    times = interleaved_medians(
        {name: fn for name, (fn, _) in methods.items() if not name.startswith("traker")}, repeats
    )
    if "traker vmap+BasicProjector" in methods:
        fn = methods["traker vmap+BasicProjector"][0]
        times["traker vmap+BasicProjector"] = median_time(fn, repeats=traker_repeats, warmup=1)
    load = [round(x, 2) for x in (*load_before, *os.getloadavg())]
    for name, (_, proj_dim) in methods.items():
        n = traker_repeats if name.startswith("traker") else repeats
        record: dict[str, Any] = {
            "bench": "featurize",
            "model": workload,
            "method": name,
            "batch": int(batch[0].shape[0]),
            "grad_dim": grad_dim,
            "proj_dim": proj_dim,
            "repeats": n,
            "median_s": times[name],
            "examples_per_s": batch[0].shape[0] / times[name],
            "x_forward_backward": times[name] / times["forward+backward"],
            "loadavg_1_5_15_before_after": load,
        }
        if name.startswith("gradsketch hooks"):
            record["target_x_forward_backward"] = TARGET_RATIO
            record["target_met"] = record["x_forward_backward"] <= TARGET_RATIO
        emit(record)
    if "traker vmap+BasicProjector" in times:
        hooks = times["gradsketch hooks+FactorizedProjector"]
        emit(
            {
                "bench": "featurize",
                "model": workload,
                "summary": "speedup of hooks+FactorizedProjector over traker's CPU default",
                "speedup_vs_traker": times["traker vmap+BasicProjector"] / hooks,
                "speedup_vs_vmap_countsketch": times["gradsketch vmap+CountSketchProjector"]
                / hooks,
            }
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="2 repeats; traker skipped on the transformer"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--models",
        nargs="+",
        default=["digits_mlp", "transformer"],
        choices=["digits_mlp", "transformer"],
    )
    parser.add_argument("--no-traker", action="store_true", help="skip the traker reference")
    args = parser.parse_args()
    setup_torch()
    emit({"bench": "featurize", "machine": machine_info()})
    repeats = 2 if args.quick else args.repeats
    for workload in args.models:
        # traker's BasicProjector regenerates a grad_dim x 2048 Gaussian matrix
        # per batch: ~7e9 entries for the transformer, minutes per batch, so it
        # gets one timed repeat there (and none with --quick).
        with_traker = not args.no_traker and not (args.quick and workload == "transformer")
        traker_repeats = repeats if workload == "digits_mlp" else 1
        # A digits step takes ~1 ms: ten times the rounds keep its median
        # stable against scheduler noise on a shared machine.
        rounds = 10 * repeats if workload == "digits_mlp" else repeats
        run(workload, rounds, with_traker, traker_repeats)


if __name__ == "__main__":
    main()
