"""One process-wide worker pool for loops whose iterations release the GIL.

torch and numpy kernels release the GIL, so a few Python threads can keep
every core busy on independent parts of one operation (disjoint rows of an
output, disjoint entries of a parameter) without torch's own intra-op
parallelism, which many CPU kernels (``index_add_``, numpy's ``take``) lack.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

__all__ = ["run_parallel"]

T = TypeVar("T")

_pool: tuple[int, ThreadPoolExecutor] | None = None
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
    if _pool is None or _pool[0] != threads:
        if _pool is not None:
            _pool[1].shutdown(wait=False)
        _pool = (threads, ThreadPoolExecutor(threads, thread_name_prefix="gradsketch"))
    grad_enabled = torch.is_grad_enabled()  # thread-local: carry it to the workers

    def call(part: T) -> object:
        _worker.active = True
        with torch.set_grad_enabled(grad_enabled):
            return fn(part)

    for _ in _pool[1].map(call, parts):
        pass
