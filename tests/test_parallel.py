"""The worker threads of gradsketch._parallel."""

from __future__ import annotations

import os
import sys
import threading
import warnings

import pytest

from gradsketch import _parallel


def test_run_parallel_calls_every_part_and_reraises():
    seen: list[int] = []
    lock = threading.Lock()

    def record(part: int) -> None:
        with lock:
            seen.append(part)

    _parallel.run_parallel(record, list(range(9)))
    assert sorted(seen) == list(range(9))

    def boom(part: int) -> None:
        if part == 3:
            raise ValueError("part 3")

    with pytest.raises(ValueError, match="part 3"):
        _parallel.run_parallel(boom, list(range(6)))


def test_nested_run_parallel_runs_in_turn():
    """A part that calls run_parallel again must not wait on the pool it occupies."""
    inner: list[int] = []

    def outer(part: int) -> None:
        _parallel.run_parallel(inner.append, [part * 10, part * 10 + 1])

    _parallel.run_parallel(outer, [1, 2, 3])
    assert sorted(inner) == [10, 11, 20, 21, 30, 31]


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "darwin", reason="needs fork")
def test_pools_are_rebuilt_after_fork():
    """A forked child inherits the executors but not their threads; using them must not hang."""
    _parallel.run_parallel(lambda part: None, [0, 1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12+)
        pid = os.fork()
    if pid == 0:  # child: exit 0 only if the pool works
        code = 1
        try:
            out: list[int] = []
            _parallel.run_parallel(out.append, [0, 1, 2])
            code = 0 if sorted(out) == [0, 1, 2] else 1
        finally:
            os._exit(code)
    for _ in range(400):  # up to 20 s
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        threading.Event().wait(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung on an inherited executor")
    assert os.waitstatus_to_exitcode(status) == 0
