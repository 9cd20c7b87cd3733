"""The one background writer shared by the row store and the scoring kernel."""

from __future__ import annotations

import threading

import pytest

from gradsketch._writer import BackgroundWriter


def test_writes_in_call_order_and_never_more_than_max_pending():
    gate = threading.Event()
    written: list[int] = []
    in_flight: list[int] = []
    writer: BackgroundWriter[int] = BackgroundWriter(
        lambda job: (gate.wait(10), written.append(job)), max_pending=2
    )
    writer.submit(0)
    writer.submit(1)
    blocked = threading.Thread(target=lambda: (writer.submit(2), in_flight.append(2)))
    blocked.start()
    blocked.join(0.2)
    assert blocked.is_alive() and not in_flight  # the third submit waits for room
    gate.set()
    blocked.join(10)
    writer.close()
    assert written == [0, 1, 2] and in_flight == [2]


def test_failure_drops_later_jobs_and_is_raised_once():
    written: list[int] = []

    def write(job: int) -> None:
        if job == 1:
            raise OSError("disk full")
        written.append(job)

    writer: BackgroundWriter[int] = BackgroundWriter(write, max_pending=3)
    writer.submit(0)
    writer.submit(1)
    writer.submit(2)
    with pytest.raises(OSError, match="disk full"):
        writer.wait()
    assert written == [0]  # job 2 came after the failure: dropped
    writer.wait()  # reported once
    writer.submit(3)
    writer.close()
    assert written == [0, 3]


def test_queued_jobs_merge_into_one_write():
    gate = threading.Event()
    written: list[list[int]] = []

    def write(job: list[int]) -> None:
        gate.wait(10)
        written.append(job)

    writer: BackgroundWriter[list[int]] = BackgroundWriter(
        write, max_pending=5, merge=lambda a, b: a + b if len(a + b) <= 3 else None
    )
    for i in range(5):
        writer.submit([i])
    gate.set()
    writer.close()
    assert [x for job in written for x in job] == [0, 1, 2, 3, 4]
    assert len(written) < 5  # the four queued behind the first merged into fewer writes


@pytest.mark.parametrize("bad", [0, -1, True, 1.5], ids=["zero", "negative", "bool", "float"])
def test_max_pending_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="`max_pending` must be a positive int"):
        BackgroundWriter(print, max_pending=bad)
