"""Worker threads for loops whose iterations release the GIL.

torch and numpy kernels release the GIL, so a few Python threads can keep
every core busy on independent parts of one operation (disjoint rows of an
output, disjoint entries of a parameter) without torch's own intra-op
parallelism, which many CPU kernels (``index_add_``, numpy's ``take``,
``normal_``) lack.

Executors are created per process: a child started by ``fork`` inherits the
parent's executor objects but not their threads, so each is rebuilt when the
process id changes.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

__all__ = ["background", "in_background", "run_parallel"]

T = TypeVar("T")

# (process id, size, executor)
_pool: tuple[int, int, ThreadPoolExecutor] | None = None
_ordered: tuple[int, ThreadPoolExecutor] | None = None
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


def background() -> ThreadPoolExecutor:
    """A one-thread executor of this process: tasks submitted to it run in order.

    For pipelines where the calling thread produces data and a second core
    reduces what is ready (see :class:`gradsketch.sampling.SGMCMC`). Tasks
    run with grad mode off.

    Example:
        >>> background().submit(lambda: 1 + 1).result()
        2
    """
    global _ordered
    with _lock:
        if _ordered is None or _ordered[0] != os.getpid():
            # Its torch ops keep torch's intra-op threads: measured on 2 cores,
            # a one-thread worker left the step slower (its index_add_ trails
            # the noise) than the contention of a second thread team costs.
            executor = ThreadPoolExecutor(
                1, thread_name_prefix="gradsketch-ordered", initializer=_mark_background
            )
            _ordered = (os.getpid(), executor)
        return _ordered[1]


def _mark_background() -> None:
    _worker.background = True
    torch.set_grad_enabled(False)


def in_background() -> bool:
    """Whether the calling thread is :func:`background`'s (which must not wait on itself)."""
    return getattr(_worker, "background", False)
