"""Timing helpers shared by every benchmark: medians, peak memory, JSON lines.

Each benchmark prints one JSON object per line (``emit``), so results can be
collected with ``python benchmarks/bench_x.py > results.jsonl`` and compared
across machines. Timings are medians of repeated runs after warm-up calls,
because the machines these run on are shared and noisy.
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

#: Moved to ``gradsketch.demos.protocols`` (one JSON line per measurement), which the
#: benchmarks import them from; still served here to scripts that import them from
#: ``_common``. Looked up on first use, so that the isolated child below
#: (``--worker``) measures its target without gradsketch loaded.
_SHARED = ("cpu_model", "emit", "machine_info", "setup_torch", "time_once")


def __getattr__(name: str) -> Any:
    if name in _SHARED:
        from gradsketch.demos import protocols

        return getattr(protocols, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def median_time(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeats`` calls.

    Args:
        fn: the work to time; its result is discarded.
        repeats: timed calls (at least 1).
        warmup: untimed calls first (allocator, caches, lazy tables).

    Returns:
        The median of the timed calls, in seconds.
    """
    if repeats < 1:
        raise ValueError(f"`repeats` must be >= 1, got {repeats!r}.")
    for _ in range(max(0, warmup)):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved_medians(
    fns: dict[str, Callable[[], Any]], repeats: int, warmup: int = 1
) -> dict[str, float]:
    """Median wall time of each function, timed round-robin so load swings hit all alike."""
    if repeats < 1:
        raise ValueError(f"`repeats` must be >= 1, got {repeats!r}.")
    for fn in fns.values():
        for _ in range(max(0, warmup)):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in samples.items()}


def run_isolated(callable_path: str, *args: Any, timeout: float = 1800.0) -> dict[str, Any]:
    """Run ``module:function(*args)`` in a fresh interpreter; report its peak RSS.

    The child returns a JSON-serialisable result on its last stdout line; its
    peak resident set size comes from ``resource.getrusage(RUSAGE_CHILDREN)``
    read in a dedicated parent process, so the number covers that child only
    (not this process nor earlier children).

    Args:
        callable_path: ``"package.module:function"`` importable from the
            child (``benchmarks/`` is put on its ``sys.path``).
        *args: JSON-serialisable positional arguments.
        timeout: seconds before the child is killed.

    Returns:
        ``{"result": <function's return value>, "peak_rss_mb": float,
        "wall_s": float}``.
    """
    payload = json.dumps({"target": callable_path, "args": list(args)})
    bench_dir = os.path.dirname(os.path.abspath(__file__))
    # A middle process runs the worker so that RUSAGE_CHILDREN sees exactly
    # one child: this benchmark's earlier children would otherwise raise the
    # maximum (ru_maxrss of children is a max over all waited-for children).
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--measure", payload],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=os.getcwd(),
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([bench_dir, os.environ.get("PYTHONPATH", "")]),
        },
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"isolated run of {callable_path} failed (exit {proc.returncode}):\n"
            f"{proc.stderr[-4000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _measure(payload: str) -> None:
    spec = json.loads(payload)
    start = time.perf_counter()
    child = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--worker", payload],
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.perf_counter() - start
    if child.returncode != 0:
        sys.stderr.write(child.stderr)
        raise SystemExit(child.returncode)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    # ru_maxrss is KiB on Linux, bytes on macOS.
    scale = 1 / 1024 if sys.platform != "darwin" else 1 / (1024 * 1024)
    result = json.loads(child.stdout.strip().splitlines()[-1])
    out = {"result": result, "peak_rss_mb": usage.ru_maxrss * scale, "wall_s": wall}
    del spec
    print(json.dumps(out))


def _worker(payload: str) -> None:
    spec = json.loads(payload)
    module_name, _, func_name = spec["target"].partition(":")
    func = getattr(importlib.import_module(module_name), func_name)
    result = func(*spec["args"])
    print(json.dumps(result))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--measure":
        _measure(sys.argv[2])
    elif len(sys.argv) == 3 and sys.argv[1] == "--worker":
        _worker(sys.argv[2])
    else:
        raise SystemExit("usage: _common.py (--measure|--worker) JSON (internal)")
