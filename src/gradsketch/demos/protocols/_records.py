"""One JSON line per measurement, naming the machine it came from.

The benchmarks and the protocols they run print their figures with
:func:`emit`, so a run's output can be collected with ``python
benchmarks/bench_x.py > results.jsonl`` and every figure copied elsewhere
keeps its origin (:func:`cpu_model`, :func:`machine_info`).
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from typing import Any

#: Threads every benchmark pins torch to, so numbers compare across runs.
DEFAULT_THREADS = 2


def setup_torch(threads: int = DEFAULT_THREADS) -> None:
    """Pin torch's intra-op threads before anything is timed."""
    import torch

    torch.set_num_threads(threads)


def time_once(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Wall time of one call and its result."""
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def emit(record: dict[str, Any]) -> None:
    """Print ``record`` as one JSON line (floats rounded to 4 significant digits).

    Every line names the CPU it was measured on (``cpu``), so figures copied
    elsewhere keep their origin.

    Example:
        >>> emit({"bench": "demo", "seconds": 1.234567, "cpu": "x"})
        {"bench": "demo", "seconds": 1.235, "cpu": "x"}
    """
    record = {**record, "cpu": record.get("cpu", cpu_model())}
    print(json.dumps(_rounded(record), sort_keys=False), flush=True)


def cpu_model() -> str:
    """The CPU's model, family and widest vector extension, e.g. ``"AMD EPYC (25/17, avx2)"``."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model", "flags"):
                    info.setdefault(key, value.strip())
                if not line.strip():
                    break
    except OSError:
        return platform.processor() or platform.machine()
    flags = set(info.get("flags", "").split())
    isa = next((f for f in ("avx512f", "avx2", "avx", "sse4_2") if f in flags), "baseline")
    family = f"{info.get('cpu family', '?')}/{info.get('model', '?')}"
    return f"{info.get('model name', platform.machine())} ({family}, {isa})"


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_rounded(v) for v in value]
    return value


def machine_info() -> dict[str, Any]:
    """Where the numbers were measured."""
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
