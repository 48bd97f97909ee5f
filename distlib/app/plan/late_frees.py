"""The communication thread at its latest, for the planner's step peak with ``zero.overlap`` at
ZeRO-2/3 (``step_peak``): there the thread's timing decides when a bucket's gradients or a gathered
unit are freed, and the run's peak can hold what a late thread has not freed yet -- with
recomputed blocks a block's gradients still waiting for their reduce-scatter beside the next
block's recomputation (measured over the dry step's quick thread: one llama block's 64 KB, 14% of
the step peak; a mixtral_tiny block's 640 KB, 9.6%).

``LateFrees`` runs each job as it is submitted (its allocations as early as any thread could make
them) and keeps the job -- its arguments, and what it freed in place -- until someone waits for
it, for a later job, or drains the queue (as late as any thread could let go of them: the queue
is first in, first out). The step peak it measures is therefore at or above the run's whatever
the thread's timing, the thread's own temporaries left out as the run's meter leaves them out
(``observe.live_bytes``).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

from distlib.app.observe.live_bytes import LiveBytes
from distlib.comm.group import Comm
from distlib.comm.progress import Progress, Ticket


class LateFrees(Progress):
    def __init__(self, comm: Comm, meter: LiveBytes):
        super().__init__(comm)
        self.meter = meter
        # (ticket, the job and its arguments, kept alive, and the bytes it freed in place)
        self._pending: collections.deque = collections.deque()

    def submit(self, fn: Callable, *args) -> Ticket:
        ticket = _Forcing(self)
        before = self.meter.settle()
        # (on a thread of its own, as the run's: the meter, a dispatch mode of this thread, does
        # not see the job's operators, as it does not in the run)
        worker = threading.Thread(target=self._run, args=(ticket, fn, args), name="distlib-plan-comm")
        worker.start()
        worker.join()
        freed = max(before - self.meter.settle(), 0)
        self.meter.defer(freed)
        self._pending.append((ticket, (fn, args), freed))
        return ticket

    def drain(self) -> None:
        self.force(None)
        if self._failed is not None:
            raise self._failed

    def force(self, ticket: Ticket | None) -> None:
        """Every job up to ``ticket`` (None: all) done: what they freed is freed now."""
        if ticket is not None and all(t is not ticket for t, _, _ in self._pending):
            return  # (done already)
        while self._pending:
            done, job, freed = self._pending.popleft()
            del job  # (what only the job held dies now)
            self.meter.undefer(freed)
            if done is ticket:
                return


class _Forcing(Ticket):
    """A ticket whose wait completes its job and every earlier one (``LateFrees.force``)."""

    def __init__(self, queue: LateFrees):
        super().__init__()
        self._queue = queue

    def wait(self) -> None:
        self._queue.force(self)
        super().wait()
