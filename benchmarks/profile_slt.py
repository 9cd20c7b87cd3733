"""Where a chain's time goes: gradsketch.slt.llc and devinterp 2.0.1's llc under cProfile.

Builds one of ``bench_slt.py``'s models, trains it briefly, then runs each
library's ``llc`` (1 chain, ``--draws`` draws, batch 32 x seq 65, the
``{"train": ...}`` observable as the benchmark) on ``--threads`` threads
under cProfile and prints one JSON line per library: total CPU seconds and
the cumulative seconds of the parts of a step (the model's forward calls,
autograd's backward, the sampler's step, the observables' evaluation, the
initial loss), and per draw the split of a draw's CPU time: the step
(forward, backward, sampler step), the observables' pass and the rest
(``other_ms_per_draw``: the store's writes, also those of gradsketch's
writer thread, which cProfile does not see but the process's CPU time
counts, with setup and per-draw Python; the initial loss is left out). With
``--store kept`` the ``{"train": ...}`` observable is 3 batches of 32 fixed
sequences, three times the step's rows, forward only: ``obs_gflop_per_draw``
(its floating-point operations, counted by ``torch.utils.flop_counter``, the
same for both libraries) over ``obs_ms_per_draw`` gives the rate each
library's pass reaches (``obs_gflops``), against ``step_gflop_per_draw``
(the 32 rows forward and backward).

Run: ``.venv/bin/python benchmarks/profile_slt.py --model llama [--draws 30]
[--chains 1] [--store kept|none]``.
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import pstats
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from _common import emit, machine_info, setup_torch
from bench_slt import MODELS, build_model, corpus, cpu_seconds, train_briefly

#: (part, substrings of ``file:function`` whose cumulative time it is; the first found wins).
PARTS = {
    "init_loss": ("_init_loss", "_write_init_loss"),
    "observables": ("_forward_rows", "compute_loss"),
    "backward": ("_engine_run_backward",),
    "sgld_step": ("_sgmcmc.py:step", "sampler.py:step", "sgld.py:step", "optimizer.py:wrapper"),
    "forward_all": ("module.py:_call_impl",),  # all module calls: split in _cumulative
}


def _cumulative(stats: pstats.Stats) -> dict[str, float]:
    """Cumulative seconds of each part (the outermost matching frame: cumtime counts once)."""
    table: Any = stats.stats  # type: ignore[attr-defined]
    out: dict[str, float] = {}
    for part, needles in PARTS.items():
        best = 0.0
        for (file, _line, fn), (_cc, _nc, _tt, ct, _callers) in table.items():
            key = f"{Path(file).name}:{fn}"
            if any(n in key for n in needles):
                best = max(best, ct)
        out[part] = best
    if "_init_loss" in {fn for _file, _line, fn in table}:
        # gradsketch's initial loss runs through the observables' _forward_rows too.
        out["observables"] -= out["init_loss"]
    # Every module call is under forward_all: what is left of it is the sampling steps' forward.
    out["train_forward"] = out.pop("forward_all") - out["observables"] - out["init_loss"]
    return out


def main() -> None:
    """Profile both libraries' ``llc`` on one model; print one JSON line each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="llama")
    parser.add_argument("--draws", type=int, default=30)
    parser.add_argument("--chains", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--train-epochs", type=int, default=1)
    parser.add_argument("--libs", nargs="+", default=["devinterp", "gradsketch"])
    parser.add_argument("--fast-path", default="auto")
    parser.add_argument(
        "--store", choices=["kept", "none"], default="kept", help="none: no output_path"
    )
    parser.add_argument("--top", type=int, default=0, help="also print the top tottime rows")
    args = parser.parse_args()
    setup_torch(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    from datasets import Dataset
    from devinterp.slt import llc as d_llc

    from gradsketch import slt

    ids = corpus(512, 65)
    train = Dataset.from_dict({"input_ids": ids.tolist()}).with_format("torch")
    model = build_model(args.model)
    train_briefly(model, ids, args.train_epochs)
    kw: dict[str, Any] = dict(
        lr=1e-4, n_beta=30.0, localization=100.0, num_chains=args.chains, num_draws=args.draws,
        batch_size=32, save_metrics=True,
    )  # fmt: skip
    draws = args.draws * args.chains
    flops = _gflop(model, ids)
    for lib in args.libs:
        fn = d_llc.llc if lib == "devinterp" else slt.llc
        extra = {"fast_path": args.fast_path} if lib == "gradsketch" else {}
        out = Path(tempfile.mkdtemp()) / "s.zarr"
        prof = cProfile.Profile(time.process_time)  # CPU seconds: the machine is shared
        cpu = cpu_seconds()
        prof.enable()
        if args.store == "kept":
            extra["output_path"] = out
        fn(model, train, {"train": train}, **kw, **extra)
        prof.disable()
        cpu = cpu_seconds() - cpu
        stats = pstats.Stats(prof)
        parts = _cumulative(stats)
        # Per draw (one step between draws): the observables' pass against the step itself.
        step = parts["train_forward"] + parts["backward"] + parts["sgld_step"]
        other = cpu - parts["init_loss"] - parts["observables"] - step
        per_draw = {
            "step_ms_per_draw": 1e3 * step / draws,
            "obs_ms_per_draw": 1e3 * parts["observables"] / draws,
            "other_ms_per_draw": 1e3 * other / draws,
            "obs_over_step": parts["observables"] / step if step else None,
            **flops,
            "obs_gflops": flops["obs_gflop_per_draw"] * draws / parts["observables"]
            if parts["observables"] > 1e-3 and args.store == "kept"
            else None,
        }
        emit({"bench": "profile_slt", "lib": lib, "model": args.model, "draws": args.draws,
              "chains": args.chains,
              "threads": args.threads, "store": args.store, "cpu_s": cpu, **parts, **per_draw,
              **machine_info()})  # fmt: skip
        if args.top:
            stats.sort_stats("tottime").print_stats(args.top)


def _gflop(model: Any, ids: Any) -> dict[str, float]:
    """GFLOP of one draw's observable pass (96 rows, forward) and of one step (32 rows, both ways).

    Counted on the model itself (``torch.utils.flop_counter``: matrix
    products and attention; element-wise work is not counted), so the same
    for both libraries.
    """
    import copy

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from gradsketch.slt import per_token_loss

    work = copy.deepcopy(model).train()
    with FlopCounterMode(display=False) as count, torch.no_grad():
        per_token_loss(work, ids[:96])
    obs = count.get_total_flops()
    with FlopCounterMode(display=False) as count:
        per_token_loss(work, ids[:32]).mean().backward()
    return {"obs_gflop_per_draw": obs / 1e9, "step_gflop_per_draw": count.get_total_flops() / 1e9}


if __name__ == "__main__":
    main()
