"""One background writer thread: writes run in call order while the caller computes.

Both the row store (:class:`gradsketch._store.RowStore`, features written
while the next batch is featurized) and the scoring kernel (score tiles
written while the next tile is multiplied) hand their writes to a
:class:`BackgroundWriter`. Its promises:

* **Call order.** Jobs are written one at a time, in the order submitted.
* **Bounded.** At most ``max_pending`` jobs are submitted and not yet
  written; :meth:`BackgroundWriter.submit` blocks beyond that, so memory
  held by queued data stays bounded.
* **Failures surface.** After a write fails, later jobs are dropped (a
  resumable caller must not mark rows done past a failed write), and the
  first failure is raised by the next :meth:`~BackgroundWriter.submit`,
  :meth:`~BackgroundWriter.wait` or :meth:`~BackgroundWriter.close`.
* **Optional merging.** ``merge(first, second)`` may combine queued jobs
  into one write (or return ``None`` to keep them apart).

Example:
    >>> out = []
    >>> writer = BackgroundWriter(out.append, max_pending=2)
    >>> for i in range(5):
    ...     writer.submit(i)
    >>> writer.close()
    >>> out
    [0, 1, 2, 3, 4]
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

JobT = TypeVar("JobT")


class BackgroundWriter(Generic[JobT]):
    """Runs ``write(job)`` on one daemon thread, in submission order.

    Args:
        write: called with each job (or merged job) on the writer thread.
        max_pending: jobs submitted and not yet written at most (>= 1); with
            1, one write is in flight while the caller prepares the next.
        merge: ``merge(first, second) -> job | None``: one job equal to
            writing ``first`` then ``second``, or ``None``.
        name: the thread's name.

    Raises:
        ValueError: ``max_pending`` is not a positive int.
    """

    def __init__(
        self,
        write: Callable[[JobT], None],
        *,
        max_pending: int = 1,
        merge: Callable[[JobT, JobT], JobT | None] | None = None,
        name: str = "gradsketch-write",
    ) -> None:
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"`max_pending` must be a positive int, got {max_pending!r}.")
        self._write = write
        self._merge = merge
        self.max_pending = max_pending
        self.name = name
        self._jobs: collections.deque[JobT] = collections.deque()
        self._cond = threading.Condition()
        self._pending = 0  # submitted, not yet written (or dropped)
        self._failure: BaseException | None = None
        self._thread: threading.Thread | None = None

    @property
    def failed(self) -> bool:
        """Whether a write failed and has not been raised yet."""
        return self._failure is not None

    def submit(self, job: JobT) -> None:
        """Queue ``job`` (its data must not be modified later); blocks while the queue is full.

        Raises:
            BaseException: the first failed earlier write, re-raised here.
        """
        self._raise_failure()
        with self._cond:
            self._cond.wait_for(lambda: self._pending < self.max_pending)
            self._jobs.append(job)
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def wait(self) -> None:
        """Block until every submitted job is written; raise the first failure, if any.

        Called from the writer thread itself (by a ``write`` that reads back
        what it writes), it returns at once instead of waiting for itself.
        """
        if threading.current_thread() is not self._thread:
            with self._cond:
                self._cond.wait_for(lambda: self._pending == 0)
        self._raise_failure()

    def close(self) -> None:
        """Write what is queued, stop the thread (a later submit starts a new one), raise."""
        try:
            self.wait()
        finally:
            with self._cond:
                # A thread that is no longer `_thread` returns once its queue is empty.
                thread, self._thread = self._thread, None
                self._cond.notify_all()
            if thread is not None and thread is not threading.current_thread():
                thread.join()

    def _raise_failure(self) -> None:
        with self._cond:
            failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def _run(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._jobs) or self._thread is not me)
                if not self._jobs:
                    return
                job = self._jobs.popleft()
            taken = 1
            while self._merge is not None:
                # Only this thread removes jobs, so the head read here stays the head.
                with self._cond:
                    if not self._jobs:
                        break
                    nxt = self._jobs[0]
                merged = self._merge(job, nxt)
                if merged is None:
                    break
                with self._cond:
                    self._jobs.popleft()
                job, taken = merged, taken + 1
            try:
                if self._failure is None:
                    self._write(job)
            except BaseException as exc:  # raised to the caller by submit / wait / close
                with self._cond:
                    if self._failure is None:
                        self._failure = exc
            finally:
                del job
                with self._cond:
                    self._pending -= taken
                    self._cond.notify_all()
