"""The planner's communication queue at its latest (``plan.late_frees``): a job runs when it is
submitted, and what it holds, or freed in place, stays counted until the step waits for it, for a
later job, or drains the queue -- never longer, never shorter."""

from __future__ import annotations

import types

import pytest
import torch

from distlib.app.observe.live_bytes import LiveBytes
from distlib.app.plan.late_frees import LateFrees

GROUP = types.SimpleNamespace(size=2, rank=0)  # (the queue only names its group)


def _queued(meter: LiveBytes, n: int) -> tuple[LateFrees, list, list[int]]:
    """``n`` jobs, each handed a 4,000-byte buffer nothing else keeps, which it writes; returns
    the queue, the tickets and the bytes alive after each submit."""
    queue, tickets, alive = LateFrees(GROUP, meter), [], []
    for _ in range(n):
        buffer = torch.zeros(1000)
        tickets.append(queue.submit(lambda b: b.add_(1), buffer))
        del buffer
        alive.append(meter.now)
    return queue, tickets, alive


def test_what_a_job_holds_is_alive_until_it_or_a_later_one_is_waited_for():
    meter = LiveBytes("cpu")
    with meter:
        queue, tickets, alive = _queued(meter, 3)
        assert alive == [4000, 8000, 12000]
        tickets[1].wait()  # the first two are done
        assert meter.now == 4000
        tickets[0].wait()  # (done already: waits for nothing more)
        assert meter.now == 4000
        queue.drain()
        assert meter.now == 0
    assert meter.peak == 12000


def test_a_job_runs_when_submitted_and_its_failure_reaches_the_waiter():
    meter = LiveBytes("cpu")
    ran = []
    with meter:
        queue = LateFrees(GROUP, meter)
        queue.submit(ran.append, 1)
        assert ran == [1]  # (its allocations as early as any thread could make them)
        failing = queue.submit(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            failing.wait()
        with pytest.raises(ZeroDivisionError):
            queue.drain()


def test_what_a_job_frees_in_place_stays_counted_until_it_is_waited_for():
    meter = LiveBytes("cpu")
    with meter:
        unit = torch.zeros(1000)  # (an operator's output: the meter counts its storage)
        unit.untyped_storage().resize_(0)
        unit[:0].add_(0)  # (seen at two sizes: re-read after every operator from now on)
        unit.untyped_storage().resize_(4000)
        queue = LateFrees(GROUP, meter)
        ticket = queue.submit(lambda: unit.untyped_storage().resize_(0))
        assert meter.settle() == 4000
        ticket.wait()
        assert meter.settle() == 0
