"""`make demo`'s attribution step: EK-FAC's time against TRAK's, in one process.

The issue's target is EK-FAC attribution at most 3x TRAK's in the main job.
This runs the demo's own :func:`gradsketch.demos._attribution.attribute_digits`
(featurize, finalize_features, score, finalize_scores; a fresh store each time)
on the demo's checkpoints (:func:`train_checkpoints` with the demo's settings:
the 64-256-256-10 MLP, 3 checkpoints, 100 targets, k = 512 for TRAK), once per
method and repeat, round-robin (TRAK, EK-FAC, TRAK, ...) so that load swings
hit both alike. Each JSON line gives a method's median wall and CPU seconds
(whole step and per phase) and the ratio EK-FAC / TRAK of the medians, with
the CPU and the load average: on a shared machine compare CPU seconds.

Run ``python benchmarks/bench_demo_attribution.py`` (``--threads``,
``--repeats``; ``--quick``: 1 checkpoint, 10 targets, 1 repeat).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from gradsketch.demos.protocols import emit, machine_info, setup_torch

METHODS = {"trak": 0.0, "ekfac": "auto"}  # the demo's lambda_reg per method


def run(threads: int, repeats: int, quick: bool) -> list[dict[str, Any]]:
    """Time the demo's attribution step per method; one record per method, then the ratio."""
    from gradsketch.demos._attribution import DemoSettings, attribute_digits, train_checkpoints
    from gradsketch.demos._digits import load_digits_split

    setup_torch(threads)
    settings = DemoSettings(num_checkpoints=1, num_targets=10) if quick else DemoSettings()
    split = load_digits_split(seed=settings.seed)
    checkpoints, _ = train_checkpoints(split, settings, progress=False)
    wall: dict[str, list[float]] = {m: [] for m in METHODS}
    cpu: dict[str, list[float]] = {m: [] for m in METHODS}
    phases: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
    with tempfile.TemporaryDirectory() as root:
        for _ in range(repeats):
            for method, damping in METHODS.items():
                start, start_cpu = time.perf_counter(), time.process_time()
                _, timings = attribute_digits(
                    checkpoints,
                    split,
                    settings,
                    save_dir=Path(root) / method,
                    lambda_reg=damping,
                    progress=False,
                    method=method,
                )
                wall[method].append(time.perf_counter() - start)
                cpu[method].append(time.process_time() - start_cpu)
                phases[method].append(timings)
    info = machine_info()
    records = []
    for method in METHODS:
        records.append(
            {
                "bench": "demo_attribution",
                "method": method,
                "threads": threads,
                "repeats": repeats,
                "wall_s": statistics.median(wall[method]),
                "cpu_s": statistics.median(cpu[method]),
                **{
                    f"{phase}_s": statistics.median(p[phase] for p in phases[method])
                    for phase in phases[method][0]
                },
                "load": os.getloadavg()[0],
                **info,
            }
        )
    trak, ekfac = records
    records.append(
        {
            "bench": "demo_attribution",
            "ratio": "ekfac / trak",
            "threads": threads,
            "wall_ratio": ekfac["wall_s"] / trak["wall_s"],
            "cpu_ratio": ekfac["cpu_s"] / trak["cpu_s"],
            "target": 3.0,
            "load": os.getloadavg()[0],
        }
    )
    return records


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    for record in run(args.threads, 1 if args.quick else args.repeats, args.quick):
        emit(record)


if __name__ == "__main__":
    main()
