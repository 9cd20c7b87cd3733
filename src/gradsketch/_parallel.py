"""Worker threads for loops whose iterations release the GIL.

torch and numpy kernels release the GIL, so a few Python threads can keep
every core busy on independent parts of one operation (disjoint rows of an
output, disjoint entries of a parameter) without torch's own intra-op
parallelism, which many CPU kernels (``index_add_``, numpy's ``take``,
``normal_``) lack.

Executors are created per process: a child started by ``fork`` inherits the
parent's executor objects but not their threads, so each is rebuilt when the
process id changes.

The workers keep torch's intra-op threads, so a part's own large ops still
run on several cores. A thread that has run a multi-threaded torch op keeps
an OpenMP team of its own, which makes every later parallel op of the
process pay for waking it; the sampler, whose steps are many small ops,
therefore uses no worker thread.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

__all__ = ["run_parallel"]

T = TypeVar("T")

# (process id, size, executor)
_pool: tuple[int, int, ThreadPoolExecutor] | None = None
_lock = threading.Lock()
_worker = threading.local()  # .active is set on the pool's threads


def run_parallel(fn: Callable[[T], object], parts: Sequence[T]) -> None:
    """Call ``fn(part)`` for every part on ``torch.get_num_threads()`` worker threads.

    The parts must touch disjoint data. ``fn`` runs with the caller's grad
    mode (thread-local in torch). With one thread or one part, or when called
    from a worker of the pool (nested use), the calls run in turn on the
    calling thread. The first exception raised by ``fn`` is re-raised.

    Example:
        >>> seen = []
        >>> run_parallel(lambda part: seen.append(part.start), [slice(0, 2), slice(2, 4)])
        >>> sorted(seen)
        [0, 2]
    """
    global _pool
    threads = torch.get_num_threads()
    if threads < 2 or len(parts) < 2 or getattr(_worker, "active", False):
        for part in parts:
            fn(part)
        return
    with _lock:
        if _pool is None or _pool[:2] != (os.getpid(), threads):
            if _pool is not None and _pool[0] == os.getpid():
                _pool[2].shutdown(wait=False)
            executor = ThreadPoolExecutor(threads, thread_name_prefix="gradsketch")
            _pool = (os.getpid(), threads, executor)
        executor = _pool[2]
    grad_enabled = torch.is_grad_enabled()  # thread-local: carry it to the workers

    def call(part: T) -> object:
        _worker.active = True
        with torch.set_grad_enabled(grad_enabled):
            return fn(part)

    for _ in executor.map(call, parts):
        pass
