"""Distributed featurization: 2 gloo ranks of 1 thread vs 1 rank of 1 thread.

TRAKer with its CPU default projector (CountSketchProjector, proj_dim 2048)
featurizes the 1,438 training digits through the digits MLP (85,002
parameters), batches of 64, chunks of 16 rows. One rank runs in a plain
process; two ranks run under ``torchrun --nproc_per_node 2`` (gloo), each
featurizing its own chunk-aligned half of the rows into the same store.

Timed on every rank between two barriers (so the slower rank counts):
``featurize`` = ``load_checkpoint`` + ``featurize_loader`` for all rows,
``finalize`` = ``finalize_features`` (per-rank XᵀX + ``all_reduce`` of the
``[2048, 2048]`` sum, 16 MiB). Process start-up and store creation are not
timed. Launches alternate 1 rank / 2 ranks for ``--rounds`` rounds so both
see the same background load; each launch times ``--repeats`` passes after
one warm-up pass; the reported time is the median over all passes.

Both configurations run twice: with every rank's process bound to its own
core (``cores: one core per rank``, the measure of parallel efficiency: a
"1 rank of 1 thread" baseline that lets the store's writer thread and zarr's
I/O loop run on the spare core uses more than one core), and unpinned, as
torchrun starts ranks by default.

Target: speed-up >= 1.7x (parallel efficiency >= 85%) on 2 cores. One JSON
line per configuration, then one with the ratios. On a shared machine the
wall-clock ratio moves with the other processes' load, so the CPU time of
the busiest rank (``time.process_time``; single-threaded ranks, no waits
inside featurization) is reported beside it: ``cpu_time_speedup`` is the
speed-up the same work would reach with one free core per rank, and it
includes any extra work or imbalance that sharding adds.

    python benchmarks/bench_distributed.py              # 3 rounds x 3 repeats
    python benchmarks/bench_distributed.py --rounds 1 --repeats 1   # smoke test
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gradsketch.demos.protocols import emit, machine_info

PROJ_DIM = 2048
BATCH = 64
CHUNK_ROWS = 16
TARGET_SPEEDUP = 1.7


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def worker(out: Path, repeats: int, pin: bool) -> None:
    """Time featurization on this rank; rank 0 writes ``out`` (JSON).

    With ``pin`` the rank's process is bound to one core (its local rank),
    before any thread starts, so its helper threads (the store's writer,
    zarr's I/O loop, gloo) share that core instead of using a spare one.
    """
    if pin:
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[int(os.environ.get("LOCAL_RANK", "0")) % len(cores)]})
    import torch
    import torch.distributed as dist

    from gradsketch.attribution import TRAKer
    from gradsketch.demos import build_mlp, load_digits_split, make_loader

    torch.set_num_threads(1)
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1

    def sync() -> None:
        if distributed:
            dist.barrier()

    split = load_digits_split(seed=0)
    loader = make_loader(split.x_train, split.y_train, batch_size=BATCH)
    model = build_mlp(seed=0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    root = Path(tempfile.mkdtemp(prefix="bench_dist_")) if rank == 0 else None
    if distributed:
        box = [str(root)]
        dist.broadcast_object_list(box, src=0)
        root = Path(box[0])
    assert root is not None
    featurize, finalize, cpu = [], [], []
    for i in range(repeats + 1):
        traker = TRAKer(
            model,
            "image_classification",
            split.n_train,
            save_dir=root / f"pass{i}",
            device="cpu",
            proj_dim=PROJ_DIM,
            chunk_rows=CHUNK_ROWS,
            logging_level=logging.WARNING,
            progress=False,
        )
        sync()
        start, cpu_start = time.perf_counter(), time.process_time()
        traker.load_checkpoint(state, model_id=0)
        traker.featurize_loader(loader)
        cpu_used = time.process_time() - cpu_start
        sync()
        middle = time.perf_counter()
        traker.finalize_features()
        sync()
        end = time.perf_counter()
        per_rank = [cpu_used] * world
        if distributed:
            dist.all_gather_object(per_rank, cpu_used)
        if i > 0:  # the first pass warms up vmap, the allocator and the sketch tables
            featurize.append(middle - start)
            finalize.append(end - middle)
            cpu.append(max(per_rank))  # the busiest rank decides
    if rank == 0:
        record = {"world": world, "rows": split.n_train}
        times = {"featurize": featurize, "finalize": finalize, "featurize_cpu": cpu}
        out.write_text(json.dumps({**record, **times}))
        shutil.rmtree(root, ignore_errors=True)
    if distributed:
        dist.destroy_process_group()


def launch(world: int, repeats: int, pin: bool) -> dict:
    """Run :func:`worker` on ``world`` ranks (plain process for 1) and read rank 0's JSON."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        script = [str(Path(__file__).resolve()), "--worker", str(out), "--repeats", str(repeats)]
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
            raise RuntimeError(f"{world}-rank run failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--pin", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.repeats, args.pin)
        return
    for pin in (True, False):
        measure(pin, args.rounds, args.repeats)


def measure(pin: bool, rounds: int, repeats: int) -> None:
    """Alternate 1-rank and 2-rank launches; emit one line per world size and the ratios."""
    times: dict[int, dict[str, list[float]]] = {
        w: {"featurize": [], "finalize": [], "featurize_cpu": []} for w in (1, 2)
    }
    rows = 0
    for _ in range(rounds):
        for world in (1, 2):
            result = launch(world, repeats, pin)
            rows = result["rows"]
            for key in ("featurize", "finalize", "featurize_cpu"):
                times[world][key] += result[key]
    info = machine_info()
    medians = {w: {k: statistics.median(v) for k, v in t.items()} for w, t in times.items()}
    cores = "one core per rank" if pin else "unpinned"
    for world in (1, 2):
        emit(
            {
                "bench": "distributed_featurize",
                "model": "digits_mlp",
                "projector": "CountSketchProjector",
                "proj_dim": PROJ_DIM,
                "ranks": world,
                "threads_per_rank": 1,
                "cores": cores,
                "rows": rows,
                "featurize_s": medians[world]["featurize"],
                "featurize_s_all": sorted(times[world]["featurize"]),
                "rows_per_s": rows / medians[world]["featurize"],
                "featurize_cpu_s_busiest_rank": medians[world]["featurize_cpu"],
                "finalize_s": medians[world]["finalize"],
                "passes": len(times[world]["featurize"]),
                "cpu_count": info["cpu_count"],
                "load_avg_1min": os.getloadavg()[0],
            }
        )
    speedup = medians[1]["featurize"] / medians[2]["featurize"]
    emit(
        {
            "bench": "distributed_featurize_scaling",
            "cores": cores,
            "speedup_2_vs_1": speedup,
            "efficiency": speedup / 2,
            "target_speedup": TARGET_SPEEDUP,
            "meets_target": speedup >= TARGET_SPEEDUP,
            "cpu_time_speedup_2_vs_1": medians[1]["featurize_cpu"] / medians[2]["featurize_cpu"],
            "finalize_speedup_2_vs_1": medians[1]["finalize"] / medians[2]["finalize"],
        }
    )


if __name__ == "__main__":
    main()
