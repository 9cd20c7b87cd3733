"""gradsketch.slt vs devinterp.slt 2.0.1: llc, bif and susceptibilities end to end.

A tiny GPT-2 (2 layers, width 64, byte vocabulary) over the Python standard
library's own source files (``sysconfig.get_paths()["stdlib"]``: present on
every machine, nothing downloaded), cut into byte-level chunks. Both
libraries get identical arguments (``save_metrics=True``, fresh output
paths; with ``--store none`` ``llc`` gets no output path, as it is most
often called) and run in turn inside one loop, so both see the same machine load.
Both run with torch on ``--threads`` threads; gradsketch also samples
``--cores`` chains at once in worker processes (``cores=``, each worker on
``threads // cores`` threads; devinterp 2.0.1 has no such option and runs its
chains one after the other). With ``--workers cold`` (the default) every
gradsketch call is timed from a cold start: its workers are started inside
the timed call (a few seconds of imports each) and ended before it returns,
so their CPU time is counted too. With ``--workers kept`` they stay between
calls, as in a session that runs several estimates (only the first call
starts them; their CPU time is then not counted). Each task prints one JSON line:
median wall and CPU seconds of each (this process and its worker processes),
their ratios (devinterp / gradsketch), both estimates, threads, cores and
the CPU model.

Run: ``.venv/bin/python benchmarks/bench_slt.py [--repeats 3] [--draws 100]
[--chains 2] [--chunks 512] [--threads 2] [--cores 2] [--workers cold]
[--tasks llc bif susceptibilities] [--store kept|none]``.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sysconfig
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import emit, machine_info, setup_torch


def corpus(chunks: int, seq: int) -> torch.Tensor:
    """``[chunks, seq]`` byte tokens of the standard library's .py files, sorted and joined."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    need = chunks * seq
    data = bytearray()
    for f in files:
        data += f.read_bytes()
        if len(data) >= need:
            break
    return torch.tensor(list(data[:need]), dtype=torch.int64).view(chunks, seq)


def tiny_gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=128)
    return GPT2LMHeadModel(cfg)


def build_model(name: str) -> torch.nn.Module:
    """One of :data:`MODELS`, built in code (seed 0, byte vocabulary, untrained).

    ``gpt2``: 2 layers x 64, dropout 0.1 (GPT-2's default). The others have no
    dropout: ``llama`` (grouped-query attention, 4 heads over 2 key/value
    heads, SwiGLU, RMSNorm, rotary), ``pythia`` (GPT-NeoX), ``qwen2``, each 2
    layers x 64; ``gpt2-4x256``: GPT-2 with 4 layers x 256 and 4 heads.
    """
    import transformers as tf

    if name == "gpt2":
        return tiny_gpt2()
    torch.manual_seed(0)
    small = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256)
    small.update(intermediate_size=256, max_position_embeddings=128, tie_word_embeddings=False)
    if name == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(num_key_value_heads=2, **small))
    if name == "pythia":
        return tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**small))
    if name == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(num_key_value_heads=2, **small))
    if name == "gpt2-4x256":
        cfg = tf.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=256, n_positions=128)
        return tf.GPT2LMHeadModel(cfg)
    raise ValueError(f"`--model` must be one of {list(MODELS)}, got {name!r}.")


#: The models ``--model`` accepts (issue 30's families).
MODELS = ("gpt2", "llama", "pythia", "qwen2", "gpt2-4x256")


def cpu_seconds() -> float:
    """CPU time of this process and of its finished (waited-for) children."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def train_briefly(model: torch.nn.Module, ids: torch.Tensor, epochs: int, seed: int = 0) -> None:
    """A few AdamW epochs on ``ids`` so the chains start near a minimum, as the LLC assumes."""
    from torch.nn import functional as F

    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(ids.shape[0], generator=gen)
        for first in range(0, ids.shape[0], 32):
            batch = ids[order[first : first + 32]]
            logits = model(batch).logits[:, :-1]
            loss = F.cross_entropy(logits.transpose(1, 2), batch[:, 1:])
            opt.zero_grad()
            loss.backward()
            opt.step()


def timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    wall, cpu = time.perf_counter(), cpu_seconds()
    out = fn()
    return time.perf_counter() - wall, cpu_seconds() - cpu, out


def main() -> None:
    """Parse the options, run every task in turn for both libraries, print JSON lines."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--draws", type=int, default=100)
    parser.add_argument("--chains", type=int, default=2)
    parser.add_argument("--chunks", type=int, default=512)
    parser.add_argument("--seq", type=int, default=65)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cores", type=int, default=2, help="gradsketch's cores= (chains at once)")
    parser.add_argument("--workers", choices=["cold", "kept"], default="cold")
    parser.add_argument("--tasks", nargs="+", default=["llc", "bif", "susceptibilities"])
    parser.add_argument("--model", choices=MODELS, default="gpt2")
    parser.add_argument(
        "--store",
        choices=["kept", "none"],
        default="kept",
        help="kept: both libraries write to an output_path; none: llc as called without one "
        "(gradsketch then skips the observables, whose values nothing reads; devinterp "
        "evaluates them into its temporary store). bif and susceptibilities always keep one",
    )
    parser.add_argument(
        "--train-epochs",
        type=int,
        default=3,
        help="AdamW epochs on the chunks before sampling (0: the untrained model)",
    )
    args = parser.parse_args()
    setup_torch(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    from datasets import Dataset
    from devinterp.slt import bif as d_bif
    from devinterp.slt import llc as d_llc
    from devinterp.slt import susceptibilities as d_sus
    from devinterp.slt import weight_restrictions as d_wr

    from gradsketch import slt
    from gradsketch._processes import shutdown_workers

    ids = corpus(args.chunks, args.seq)
    train = Dataset.from_dict({"input_ids": ids.tolist()}).with_format("torch")
    probe = Dataset.from_dict({"input_ids": ids[: max(96, args.chunks // 8)].flip(1).tolist()})
    probe = probe.with_format("torch")
    model = build_model(args.model)
    train_briefly(model, ids, args.train_epochs)
    common: dict[str, Any] = dict(
        lr=1e-4,
        n_beta=30.0,
        localization=100.0,
        num_chains=args.chains,
        num_draws=args.draws,
        batch_size=32,
        save_metrics=True,
    )
    head = d_wr.create_param_masks(model, "l0h0")

    def cold(fn: Callable[[], Any]) -> Callable[[], Any]:
        def call() -> Any:
            try:
                return fn()
            finally:
                shutdown_workers()  # reaped: their CPU time counts; the next call starts cold

        return call

    def task_fns(task: str, lib: str, out: Path) -> Callable[[], Any]:
        fn = _task_fns(task, lib, out)
        return cold(fn) if lib == "gradsketch" and args.workers == "cold" else fn

    def _task_fns(task: str, lib: str, out: Path) -> Callable[[], Any]:
        # The sampling arguments are identical; gradsketch also gets cores=.
        kw: dict[str, Any] = dict(common)
        if task != "llc" or args.store == "kept":
            kw["output_path"] = out
        if lib == "gradsketch":
            kw["cores"] = args.cores
        if task == "llc":
            fn = slt.llc if lib == "gradsketch" else d_llc.llc
            return lambda: fn(model, train, {"train": train}, **kw)
        if task == "bif":
            fn = slt.bif if lib == "gradsketch" else d_bif.bif
            obs = {"train": train, "probe": probe}
            return lambda: fn(model, train, obs, bif_device="cpu", **kw)
        fn = slt.susceptibilities if lib == "gradsketch" else d_sus.susceptibilities
        obs = {"train": train, "probe": probe}
        wrs = {"full": None, "l0h0": head}
        return lambda: fn(model, train, obs, wrs, sampling_task="train", **kw)

    def spread(task: str, result: Any, out: Path) -> float | None:
        """Standard error of the estimate from its spread over chains.

        llc: the chains' LLCs. bif and susceptibilities: the same estimate
        computed from each chain's draws alone (gradsketch's ``compute_*``,
        which give devinterp's numbers on either store), read back from the
        stores under ``out``'s directory. With 2 chains each standard error
        has one degree of freedom, so |z| < 3 is a rough tolerance only.
        """
        if task == "llc":
            per_chain = np.asarray(result["llc_per_chain"].values, dtype=float)
        else:
            import xarray as xr

            stores = {
                p.stem.removeprefix("s_"): xr.open_datatree(str(p), engine="zarr").dataset
                for p in sorted(out.parent.glob("*.zarr"))
            }
            chains = next(iter(stores.values())).sizes["chain"]
            per_chain = np.asarray(
                [estimate(task, _per_chain_result(task, stores, c, slt)) for c in range(chains)],
                dtype=float,
            )
        if per_chain.size < 2:
            return None
        return float(per_chain.std(ddof=1) / np.sqrt(per_chain.size))

    def estimate(task: str, result: Any) -> float:
        if task == "llc":
            return float(result["llc_mean"])
        if task == "bif":
            return float(np.nanmean(result["influences"].values))
        return float(np.nanmean(result["susceptibilities"].dataset["sus"].values))

    info = machine_info()
    for task in args.tasks:
        times: dict[str, list[tuple[float, float]]] = {"gradsketch": [], "devinterp": []}
        estimates: dict[str, list[float]] = {"gradsketch": [], "devinterp": []}
        sems: dict[str, list[float | None]] = {"gradsketch": [], "devinterp": []}
        for _ in range(args.repeats):
            for lib in ("devinterp", "gradsketch"):
                tmp = Path(tempfile.mkdtemp())
                try:
                    wall, cpu, result = timed(task_fns(task, lib, tmp / "s.zarr"))
                    sems[lib].append(spread(task, result, tmp / "s.zarr"))
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
                times[lib].append((wall, cpu))
                estimates[lib].append(estimate(task, result))
        med = {
            lib: (
                statistics.median(t[0] for t in v),
                statistics.median(t[1] for t in v),
            )
            for lib, v in times.items()
        }
        emit(
            {
                "bench": "slt",
                "task": task,
                "model": args.model,
                "gradsketch_s": med["gradsketch"][0],
                "devinterp_s": med["devinterp"][0],
                "speedup": med["devinterp"][0] / med["gradsketch"][0],
                "gradsketch_cpu_s": med["gradsketch"][1],
                "devinterp_cpu_s": med["devinterp"][1],
                "cpu_speedup": med["devinterp"][1] / med["gradsketch"][1],
                "estimate_gradsketch": statistics.median(estimates["gradsketch"]),
                "estimate_devinterp": statistics.median(estimates["devinterp"]),
                # Last repeat: (gradsketch - devinterp) / sqrt(sem_g^2 + sem_d^2), the
                # standard errors from the spread over chains (see `spread`).
                "z": _z(estimates, sems),
                "train_epochs": args.train_epochs,
                "repeats": args.repeats,
                "threads": args.threads,
                "gradsketch_cores": args.cores,
                "workers": args.workers,
                "devinterp_cores": 1,
                "chains": args.chains,
                "draws": args.draws,
                "chunks": args.chunks,
                "seq": args.seq,
                "save_metrics": True,
                "store": args.store if task == "llc" else "kept",
                # The machine is shared: its 1, 5 and 15-minute load averages after the task.
                "load_avg": [round(x, 2) for x in os.getloadavg()],
                **info,
            }
        )


def _per_chain_result(task: str, stores: dict[str, Any], chain: int, slt: Any) -> Any:
    """``task``'s result from chain ``chain``'s draws alone (stores by restriction name)."""
    if task == "bif":
        return slt.compute_bif(next(iter(stores.values())).isel(chain=[chain]), device="cpu")
    one = {name: ds.isel(chain=[chain]) for name, ds in stores.items()}
    return slt.compute_susceptibilities(one, sampling_task="train")


def _z(estimates: dict[str, list[float]], sems: dict[str, list[float | None]]) -> float | None:
    sg, sd = sems["gradsketch"][-1], sems["devinterp"][-1]
    if sg is None or sd is None or not (sg > 0 or sd > 0):
        return None
    diff = estimates["gradsketch"][-1] - estimates["devinterp"][-1]
    return float(diff / np.hypot(sg, sd))


if __name__ == "__main__":
    main()
