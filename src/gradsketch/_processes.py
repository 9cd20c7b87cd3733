"""Independent jobs (SGMCMC chains) in spawned worker processes, or in this one.

(Threads within one operation: :mod:`gradsketch._parallel`.)

Both chain runners, :func:`gradsketch.sampling.estimate_learning_coeff` and
:func:`gradsketch.slt.sample`, hand their chains to :func:`run_jobs`:

* ``cores=1``: the jobs run here, one after the other, on torch's current
  thread count.
* ``cores=k > 1``: ``k`` workers started with the ``spawn`` method (safe with
  threads, CUDA and OpenMP, unlike ``fork``), each running torch on
  ``max(1, torch.get_num_threads() // k)`` threads (see
  :func:`worker_threads`), so the workers together use the threads the
  caller had. ``shared`` is pickled once per worker, each job once.

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
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from typing import Any, TypeVar

import torch
import torch.multiprocessing as torch_mp

from gradsketch._checks import positive_int

__all__ = ["check_cores", "run_jobs", "threads_for", "worker_threads"]

JobT = TypeVar("JobT")
SharedT = TypeVar("SharedT")
ResultT = TypeVar("ResultT")

#: The ``shared`` value of this worker process (set by :func:`_start_worker`).
_SHARED: Any = None


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
    run on ``worker_threads(k)`` threads bit for bit.

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


def _start_worker(threads: int, shared: Any) -> None:
    global _SHARED
    torch.set_num_threads(threads)
    _SHARED = shared


def _call_in_worker(fn: Callable[[Any, Any], Any], job: Any) -> Any:
    return fn(_SHARED, job)


def _square(shared: int, job: int) -> int:
    return shared + job * job


def run_jobs(
    fn: Callable[[SharedT, JobT], ResultT],
    jobs: Sequence[JobT],
    *,
    cores: int,
    shared: SharedT,
) -> Iterator[ResultT]:
    """Yield ``fn(shared, job)`` for every job, as each finishes.

    Args:
        fn: A module-level function (workers import it by name).
        jobs: Picklable jobs (with ``cores > 1``).
        cores: Worker processes; 1 runs the jobs in this process.
        shared: State every job reads (the model, the data), sent to each
            worker once.
    """
    cores = check_cores(cores)
    if cores == 1 or len(jobs) <= 1:
        for job in jobs:
            yield fn(shared, job)
        return
    context = torch_mp.get_context("spawn")
    pool = ProcessPoolExecutor(
        max_workers=min(cores, len(jobs)),
        mp_context=context,
        initializer=_start_worker,
        initargs=(worker_threads(cores), shared),
    )
    futures: list[Future[Any]] = []
    try:
        futures = [pool.submit(_call_in_worker, fn, job) for job in jobs]
        for future in as_completed(futures):
            yield future.result()
    finally:
        for future in futures:
            future.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
