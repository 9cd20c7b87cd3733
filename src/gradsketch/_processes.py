"""Independent jobs (SGMCMC chains) in spawned worker processes, in threads, or one by one.

(Threads within one operation: :mod:`gradsketch._parallel`.)

Both chain runners, :func:`gradsketch.sampling.estimate_learning_coeff` and
:func:`gradsketch.slt.sample`, hand their chains to :func:`run_jobs`:

* ``cores=1``: the jobs run here, one after the other, on torch's current
  thread count.
* ``cores=k > 1``: ``k`` workers started with the ``spawn`` method (safe with
  threads, CUDA and OpenMP, unlike ``fork``), each running torch on
  ``max(1, torch.get_num_threads() // k)`` threads (see
  :func:`worker_threads`), so the workers together use the threads the
  caller had.
* ``cores=k > 1, backend="threads"``: ``k`` threads of this process, for
  jobs that share no mutable state and draw no randomness from torch's
  global generators (the caller checks; :func:`gradsketch.slt.sample` does).
  They start at once and need no pickling; torch runs each job's operations
  on :func:`worker_threads` threads (call inside :func:`threads_for`) and
  releases the GIL inside them, so small models' chains scale with cores
  better than one chain on several intra-op threads does.

Starting a worker costs seconds (it imports torch, transformers, gradsketch),
often more than a short chain, so the workers are kept for the next call
with the same ``k`` and thread count, as joblib keeps its executor: a second
``sample`` (the next weight restriction of ``susceptibilities``, the next
model) starts at once. :func:`shutdown_workers` ends them (so does the
interpreter's exit, and a call with another ``k``). ``shared`` is pickled
once per call and unpickled once per worker and call; each job is pickled on
its own.

A job's arithmetic does not depend on which process runs it: a job gives the
same bits with ``cores=k`` as with ``cores=1`` when the caller runs torch on
``worker_threads(k)`` threads (CPU kernels may split reductions by thread
count, so only then is the comparison exact). Results come back as jobs
finish (not in submission order); a failing job's exception is raised here
after the jobs not yet started are cancelled.

Example:
    >>> list(run_jobs(_square, [1, 2, 3], cores=1, shared=10))
    [11, 14, 19]
"""

from __future__ import annotations

import contextlib
import itertools
import pickle
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from typing import Any, TypeVar

import torch
import torch.multiprocessing as torch_mp

from gradsketch._checks import positive_int

__all__ = [
    "BACKENDS",
    "check_cores",
    "run_jobs",
    "shutdown_workers",
    "start_workers",
    "threads_for",
    "worker_threads",
]

#: Where ``run_jobs`` runs jobs when ``cores > 1``.
BACKENDS = ("processes", "threads")

JobT = TypeVar("JobT")
SharedT = TypeVar("SharedT")
ResultT = TypeVar("ResultT")

#: In a worker: ``(call id, shared)`` of the latest call (older ones are dropped).
_SHARED: tuple[int, Any] | None = None
#: In the caller: ``((cores, threads), pool)`` of the kept workers.
_POOL: tuple[tuple[int, int], ProcessPoolExecutor] | None = None
_POOL_LOCK = threading.Lock()
_CALL_IDS = itertools.count()


def check_cores(cores: Any) -> int:
    """Validate a ``cores`` argument: a positive int.

    Example:
        >>> check_cores(2)
        2
        >>> check_cores(0)
        Traceback (most recent call last):
        ...
        ValueError: `cores` must be a positive integer, got 0; pass the number of worker processes running chains at once, e.g. cores=2 (cores=1 runs them in this process).
    """  # noqa: E501
    return int(
        positive_int(
            "cores",
            cores,
            fix=(
                "pass the number of worker processes running chains at once, e.g. cores=2 "
                "(cores=1 runs them in this process)"
            ),
        )
    )


def worker_threads(cores: int) -> int:
    """Torch threads of each of ``cores`` workers: ``max(1, torch.get_num_threads() // cores)``.

    Example:
        >>> worker_threads(10**6)
        1
    """
    return max(1, torch.get_num_threads() // cores)


@contextlib.contextmanager
def threads_for(cores: int) -> Iterator[int]:
    """Run the block on :func:`worker_threads` threads when ``cores > 1`` (else unchanged).

    Work done here before or after :func:`run_jobs` (an initial loss) then
    uses the workers' thread count, so ``cores=k`` still matches ``cores=1``
    run on ``worker_threads(k)`` threads bit for bit. Pass the yielded count
    on as ``run_jobs(..., threads=)``: inside the block
    ``torch.get_num_threads()`` is already the reduced count.

    Example:
        >>> with threads_for(1) as n:
        ...     n == torch.get_num_threads()
        True
    """
    before = torch.get_num_threads()
    threads = worker_threads(cores) if cores > 1 else before
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(before)


def _start_worker(threads: int) -> None:
    torch.set_num_threads(threads)


def _call_in_worker(fn: Callable[[Any, Any], Any], call: int, shared: bytes, job: Any) -> Any:
    global _SHARED
    if _SHARED is None or _SHARED[0] != call:
        _SHARED = None  # free the previous call's state first
        _SHARED = (call, pickle.loads(shared))
    return fn(_SHARED[1], job)


def _workers(cores: int, threads: int) -> ProcessPoolExecutor:
    """The kept pool of ``cores`` workers on ``threads`` threads (started when needed)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is not None and _POOL[0] != (cores, threads):
            _POOL[1].shutdown(wait=True, cancel_futures=True)
            _POOL = None
        if _POOL is None:
            pool = ProcessPoolExecutor(
                max_workers=cores,
                mp_context=torch_mp.get_context("spawn"),
                initializer=_start_worker,
                initargs=(threads,),
            )
            _POOL = ((cores, threads), pool)
        return _POOL[1]


def _ready() -> None:
    return None


def start_workers(cores: int, *, threads: int | None = None) -> None:
    """Start the workers of a coming ``run_jobs(cores=cores)`` now, without waiting.

    Their imports then overlap with the caller's own work (the initial loss).

    Example:
        >>> start_workers(1)  # nothing to start
    """
    cores = check_cores(cores)
    if cores == 1:
        return
    pool = _workers(cores, worker_threads(cores) if threads is None else threads)
    for _ in range(cores):
        pool.submit(_ready)


def shutdown_workers() -> None:
    """End the kept worker processes (the next ``cores > 1`` call starts new ones).

    Example:
        >>> shutdown_workers()
    """
    global _POOL
    with _POOL_LOCK:
        if _POOL is not None:
            _POOL[1].shutdown(wait=True, cancel_futures=True)
            _POOL = None


def _run_in_threads(
    fn: Callable[[SharedT, JobT], ResultT], jobs: Sequence[JobT], *, cores: int, shared: SharedT
) -> Iterator[ResultT]:
    # A fresh pool per call: each new thread takes torch's current thread count.
    with ThreadPoolExecutor(max_workers=cores, thread_name_prefix="gradsketch-job") as pool:
        futures = [pool.submit(fn, shared, job) for job in jobs]
        try:
            for future in as_completed(futures):
                yield future.result()
        finally:
            for future in futures:
                future.cancel()


def _square(shared: int, job: int) -> int:
    return shared + job * job


def run_jobs(
    fn: Callable[[SharedT, JobT], ResultT],
    jobs: Sequence[JobT],
    *,
    cores: int,
    shared: SharedT,
    threads: int | None = None,
    backend: str = "processes",
) -> Iterator[ResultT]:
    """Yield ``fn(shared, job)`` for every job, as each finishes.

    Args:
        fn: A module-level function (workers import it by name).
        jobs: Picklable jobs (with ``cores > 1``).
        cores: Jobs at once; 1 runs them here, one after the other.
        shared: State every job reads (the model, the data), sent to each
            worker once.
        threads: Torch threads of each worker process; default
            :func:`worker_threads` (threads use the caller's count).
        backend: ``"processes"`` or ``"threads"`` (module docstring).
    """
    cores = check_cores(cores)
    if backend not in BACKENDS:
        raise ValueError(f"`backend` must be one of {BACKENDS}, got {backend!r}.")
    if cores == 1 or len(jobs) <= 1:
        for job in jobs:
            yield fn(shared, job)
        return
    if backend == "threads":
        yield from _run_in_threads(fn, jobs, cores=cores, shared=shared)
        return
    payload = pickle.dumps(shared, protocol=pickle.HIGHEST_PROTOCOL)
    call = next(_CALL_IDS)
    pool = _workers(cores, worker_threads(cores) if threads is None else threads)
    futures: list[Future[Any]] = []
    finished = False
    try:
        futures = [pool.submit(_call_in_worker, fn, call, payload, job) for job in jobs]
        for future in as_completed(futures):
            yield future.result()
        finished = True
    finally:
        if not finished:
            # A job failed or the caller stopped: drop the pool (a broken one
            # cannot be reused; a running job's chain would be wasted work).
            for future in futures:
                future.cancel()
            shutdown_workers()
