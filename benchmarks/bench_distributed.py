"""Every attribution method under torchrun: 2 ranks × 1 thread against 1 rank, one store.

TRAKer runs each method on the digits MLP (64-256-256-10, 85,002 parameters):
TRAK (its CPU default projector, CountSketchProjector, k = 2048), identity,
K-FAC and EK-FAC (per-layer rows projected to 16 × 16 per layer, LoGra; every
rank keeps them as one process does, each layer's ``[a, g]``: 96 floats per
row against 768 for the dense ``vec(g aᵀ)``), each featurizing the 1,438
training digits (batches of 64, chunks of 16 rows) and scoring 128 test
digits; and the replay (exact metagradients) on 256 of the training digits,
64 SGD steps, 8 queries. One rank runs in a plain process; ``--ranks`` ranks
run under ``torchrun`` (gloo on CPU; with ``--device cuda`` each rank uses
GPU ``LOCAL_RANK`` and NCCL), each doing its share in the same store:

* ``featurize`` = ``load_checkpoint`` + ``featurize_loader``: rank r featurizes
  its chunk shard of the rows (the replay: every rank keeps every row);
* ``finalize`` = ``finalize_features``: each rank's partial XᵀX / Kronecker
  factors / EK-FAC correction from its rows, summed with ``all_reduce`` (the
  replay: every rank trains the same run, which it must replay);
* ``score`` = ``start_scoring_checkpoint`` + ``score_loader`` +
  ``finalize_scores``: rank r computes its chunk shard of the target rows (the
  replay: reverses its share of the queries) and the score columns of its
  column shard, gathered with ``all_gather``.

Each phase is timed on every rank between two barriers (the slower rank
counts). Launches alternate 1 rank / W ranks for ``--rounds`` rounds, one
launch per method (so that each launch's peak memory is its method's); each
times ``--repeats`` passes after one warm-up pass, each pass in a fresh store;
reported times are medians over all passes. On CPU every rank is bound to
its own core (the measure of parallel efficiency; pass ``--unpinned`` to let
ranks float, as torchrun starts them). On a shared machine the wall clock
moves with the other processes' load, so the CPU seconds of the busiest rank
(``time.process_time``, single-threaded ranks) are reported beside it:
``cpu_speedup`` is the speed-up the same work reaches with one free core per
rank, and ``cpu_all_ranks_over_one`` (the ranks' CPU seconds summed, over one
rank's) is the work that sharding repeats (each rank reading every training
row at scoring, the replay's training run on every rank). Memory per rank:
peak RSS above the RSS before the first pass (``ru_maxrss``; on CUDA, the
peak of ``torch.cuda.max_memory_allocated``), the largest over ranks.

One JSON line per method and rank count, then one per method with the ratios.

    python benchmarks/bench_distributed.py                # CPU: 2 gloo ranks, 2 rounds x 2 repeats
    python benchmarks/bench_distributed.py --device cuda  # one GPU per rank, NCCL
    python benchmarks/bench_distributed.py --rounds 1 --repeats 1 --methods trak  # smoke test
    python benchmarks/bench_distributed.py --methods kfac,ekfac --copies 8  # 11,504 rows
    python benchmarks/bench_distributed.py --methods kfac,ekfac --hidden 2048 --exact --targets 8
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gradsketch.demos.protocols import emit, machine_info

METHODS = ("trak", "identity", "kfac", "ekfac", "replay")
PROJ_DIM = 2048
#: Per-layer methods: each layer's inputs and output gradients projected to 16 (LoGra).
LAYER_PROJECTION = (16, 16)
BATCH = 64
CHUNK_ROWS = 16
N_TARGETS = 128
#: The replay: training rows, queries, and its run.
N_REPLAY, M_REPLAY = 256, 8
REPLAY_STEPS, REPLAY_BATCH = 64, 32
PHASES = ("featurize", "finalize", "score")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def check_device(device: str, ranks: int) -> None:
    """Refuse ``--device cuda`` without CUDA, or with fewer GPUs than ranks, naming the fix."""
    if device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(
            "--device cuda: this machine has no CUDA device (torch.cuda.is_available() is "
            "False); run with --device cpu (gloo ranks), or on a machine with a GPU per rank."
        )
    gpus = torch.cuda.device_count()
    if gpus < ranks:
        raise SystemExit(
            f"--device cuda with --ranks {ranks}: NCCL needs one GPU per rank, this machine has "
            f"{gpus}; pass --ranks {gpus} or fewer (at least 2 to compare), or --device cpu."
        )


def _peak_bytes(device: Any) -> int:
    """Peak memory of this process so far: CUDA allocations, else ``ru_maxrss``."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


def _problem(
    method: str,
    device: Any,
    copies: int = 1,
    hidden: int = 256,
    exact: bool = False,
    targets: int = N_TARGETS,
) -> dict[str, Any]:
    """The model, its state, the loaders and the TRAKer arguments of ``method``.

    ``copies``: the training digits repeated that many times (more rows per rank);
    ``hidden``: the MLP's width; ``exact``: per-layer methods without projection
    (Kronecker factors as wide as the layers, each eigendecomposed on one rank);
    ``targets``: test digits scored.
    """
    from gradsketch.attribution import ReplaySettings
    from gradsketch.demos import build_mlp, load_digits_split, make_loader

    split = load_digits_split(seed=0)
    model = build_mlp(hidden=hidden, seed=0).to(device)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    if method == "replay":
        x, y = split.x_train[:N_REPLAY].to(device), split.y_train[:N_REPLAY].to(device)
        xq, yq = split.x_test[:M_REPLAY].to(device), split.y_test[:M_REPLAY].to(device)
        settings = ReplaySettings(
            optimizer="sgd",
            lr=0.05,
            momentum=0.9,
            num_steps=REPLAY_STEPS,
            batch_size=REPLAY_BATCH,
            seed=0,
        )
        return {
            "model": model,
            "state": state,
            "n": N_REPLAY,
            "m": M_REPLAY,
            "train": make_loader(x, y, batch_size=BATCH),
            # Queries in blocks of ceil(m / 2): each of 2 ranks reverses its share at once.
            "targets": make_loader(xq, yq, batch_size=-(-M_REPLAY // 2)),
            "kwargs": {"method": "replay", "replay": settings},
        }
    kwargs: dict[str, Any] = {"method": method, "chunk_rows": CHUNK_ROWS, "device": device}
    if method == "trak":
        kwargs["proj_dim"] = PROJ_DIM
    elif not exact:
        kwargs["projection"] = LAYER_PROJECTION
    x, y = split.x_train.repeat(copies, 1), split.y_train.repeat(copies)
    return {
        "model": model,
        "state": state,
        "n": len(x),
        "m": targets,
        "train": make_loader(x, y, batch_size=BATCH),
        "targets": make_loader(split.x_test[:targets], split.y_test[:targets], batch_size=BATCH),
        "kwargs": kwargs,
    }


def worker(
    out: Path, method: str, repeats: int, pin: bool, device_name: str, shape: dict[str, Any]
) -> None:
    """Time ``method``'s phases on this rank; rank 0 writes ``out`` (JSON).

    With ``pin`` the rank's process is bound to one core (its local rank),
    before any thread starts, so its helper threads (the store's writer,
    zarr's I/O loop, gloo) share that core instead of using a spare one.
    """
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if pin:
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[local % len(cores)]})
    import torch
    import torch.distributed as dist

    from gradsketch._distributed import init_from_env
    from gradsketch.attribution import TRAKer

    torch.set_num_threads(1)
    distributed = "RANK" in os.environ
    if distributed:
        init_from_env("nccl" if device_name == "cuda" else "gloo")
    device = torch.device("cuda", local) if device_name == "cuda" else torch.device("cpu")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if distributed:
            dist.barrier()

    problem = _problem(method, device, **shape)
    root = Path(tempfile.mkdtemp(prefix="bench_dist_")) if rank == 0 else None
    if distributed:
        box = [str(root)]
        dist.broadcast_object_list(box, src=0)
        root = Path(box[0])
    assert root is not None
    start_bytes = _peak_bytes(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        start_bytes = int(torch.cuda.memory_allocated(device))
    wall: dict[str, list[float]] = {p: [] for p in PHASES}
    cpu: dict[str, list[list[float]]] = {p: [] for p in PHASES}
    for i in range(repeats + 1):
        traker = TRAKer(
            problem["model"],
            "image_classification",
            problem["n"],
            save_dir=root / f"pass{i}",
            logging_level=logging.WARNING,
            progress=False,
            **problem["kwargs"],
        )
        times, cpus = {}, {}
        for phase in PHASES:
            sync()
            start, cpu_start = time.perf_counter(), time.process_time()
            if phase == "featurize":
                traker.load_checkpoint(problem["state"], model_id=0)
                traker.featurize_loader(problem["train"])
            elif phase == "finalize":
                traker.finalize_features()
            else:
                traker.start_scoring_checkpoint(
                    "q", problem["state"], model_id=0, num_targets=problem["m"]
                )
                traker.score_loader(problem["targets"])
                traker.finalize_scores("q")
            cpu_used = time.process_time() - cpu_start
            sync()
            times[phase], cpus[phase] = time.perf_counter() - start, cpu_used
        if i > 0:  # the first pass warms up vmap, the allocator and the sketch tables
            for phase in PHASES:
                per_rank = [cpus[phase]] * world
                if distributed:
                    dist.all_gather_object(per_rank, cpus[phase])
                wall[phase].append(times[phase])
                cpu[phase].append(per_rank)
    peak = _peak_bytes(device) - start_bytes
    peaks = [peak] * world
    if distributed:
        dist.all_gather_object(peaks, peak)
    if rank == 0:
        record = {"world": world, "rows": problem["n"], "targets": problem["m"]}
        out.write_text(json.dumps({**record, "wall": wall, "cpu": cpu, "peak_bytes": peaks}))
        shutil.rmtree(root, ignore_errors=True)
    if distributed:
        dist.destroy_process_group()


def launch(
    world: int, method: str, repeats: int, pin: bool, device: str, shape: dict[str, Any]
) -> dict[str, Any]:
    """Run :func:`worker` on ``world`` ranks (a plain process for 1) and read rank 0's JSON."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        script = [
            str(Path(__file__).resolve()),
            "--worker",
            str(out),
            "--methods",
            method,
            "--repeats",
            str(repeats),
            "--device",
            device,
            "--copies",
            str(shape["copies"]),
            "--hidden",
            str(shape["hidden"]),
            "--targets",
            str(shape["targets"]),
        ]
        if shape["exact"]:
            script.append("--exact")
        if pin:
            script.append("--pin")
        if world == 1:
            cmd = [sys.executable, *script]
        else:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                str(world),
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(_free_port()),
                *script,
            ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(
                f"{method}, {world}-rank run failed:\n{(proc.stdout + proc.stderr)[-4000:]}"
            )
        return json.loads(out.read_text())


def measure(
    method: str,
    ranks: int,
    rounds: int,
    repeats: int,
    pin: bool,
    device: str,
    shape: dict[str, Any],
) -> None:
    """Alternate 1-rank and ``ranks``-rank launches; emit one line per rank count and the ratios."""
    worlds = (1, ranks)
    wall: dict[int, dict[str, list[float]]] = {w: {p: [] for p in PHASES} for w in worlds}
    busiest: dict[int, dict[str, list[float]]] = {w: {p: [] for p in PHASES} for w in worlds}
    summed: dict[int, list[float]] = {w: [] for w in worlds}
    peaks: dict[int, list[int]] = {w: [] for w in worlds}
    size = {}
    for _ in range(rounds):
        for world in worlds:
            result = launch(world, method, repeats, pin, device, shape)
            size = {"rows": result["rows"], "targets": result["targets"]}
            for phase in PHASES:
                wall[world][phase] += result["wall"][phase]
                busiest[world][phase] += [max(r) for r in result["cpu"][phase]]
            n_pass = len(result["cpu"]["featurize"])
            summed[world] += [sum(sum(result["cpu"][p][i]) for p in PHASES) for i in range(n_pass)]
            peaks[world].append(max(result["peak_bytes"]))
    med = statistics.median
    cores = "cuda" if device == "cuda" else ("one core per rank" if pin else "unpinned")
    info = machine_info()
    total = {w: med([sum(x) for x in zip(*(busiest[w][p] for p in PHASES))]) for w in worlds}
    total_wall = {w: med([sum(x) for x in zip(*(wall[w][p] for p in PHASES))]) for w in worlds}
    for world in worlds:
        emit(
            {
                "bench": "distributed_attribution",
                "method": method,
                "device": device,
                "ranks": world,
                "threads_per_rank": 1,
                "cores": cores,
                **size,
                "hidden": shape["hidden"],
                "projection": "exact" if shape["exact"] else LAYER_PROJECTION,
                **{f"{p}_s": med(wall[world][p]) for p in PHASES},
                **{f"{p}_cpu_s_busiest_rank": med(busiest[world][p]) for p in PHASES},
                "total_cpu_s_busiest_rank": total[world],
                "total_cpu_s_all_ranks": med(summed[world]),
                "peak_mb_per_rank": max(peaks[world]) / 2**20,
                "passes": len(wall[world]["featurize"]),
                "cpu_count": info["cpu_count"],
                "load_avg_1min": os.getloadavg()[0],
            }
        )
    one, many = worlds
    emit(
        {
            "bench": "distributed_attribution_scaling",
            "method": method,
            "device": device,
            "ranks": many,
            "cores": cores,
            **{f"{p}_cpu_speedup": med(busiest[one][p]) / med(busiest[many][p]) for p in PHASES},
            "cpu_speedup": total[one] / total[many],
            "wall_speedup": total_wall[one] / total_wall[many],
            "cpu_all_ranks_over_one": med(summed[many]) / med(summed[one]),
            "peak_mb_per_rank_over_one": max(peaks[many]) / max(peaks[one]),
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2, help="ranks to compare with one rank")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--methods", default=",".join(METHODS), help=f"comma-separated, of {list(METHODS)}"
    )
    parser.add_argument(
        "--copies", type=int, default=1, help="repeat the training digits (not the replay's)"
    )
    parser.add_argument("--hidden", type=int, default=256, help="the MLP's hidden width")
    parser.add_argument("--targets", type=int, default=N_TARGETS, help="test digits scored")
    parser.add_argument(
        "--exact", action="store_true", help="per-layer methods without projection (wide factors)"
    )
    parser.add_argument("--unpinned", action="store_true", help="also measure unpinned ranks")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--pin", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        parser.error(f"--methods: unknown {unknown}; choose from {list(METHODS)}")
    if args.ranks < 2:
        parser.error(f"--ranks must be at least 2 (to compare with one rank), got {args.ranks}")
    shape = {
        "copies": args.copies,
        "hidden": args.hidden,
        "exact": args.exact,
        "targets": args.targets,
    }
    if args.worker is not None:
        worker(args.worker, methods[0], args.repeats, args.pin, args.device, shape)
        return
    check_device(args.device, args.ranks)
    pins = [False] if args.device == "cuda" else ([True, False] if args.unpinned else [True])
    for pin in pins:
        for method in methods:
            measure(method, args.ranks, args.rounds, args.repeats, pin, args.device, shape)


if __name__ == "__main__":
    main()
