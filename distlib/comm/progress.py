"""Collectives that run while the caller computes: one communication thread per rank, started lazily.

``Progress(comm)`` runs the jobs it is given -- calls of the ordinary collectives on ``comm`` and
whatever bookkeeping belongs with them -- one after another, in the order they were submitted, on
a thread of its own; ``submit`` returns at once with a ``Ticket`` and ``wait``/``drain`` block
until a job (or all of them) is done, re-raising there what it raised (a ``CollectiveError`` from a
peer that timed out or died reaches the caller, and so ``watchdog.watch``, as if the collective
had run inline; after a failure every later job fails with the same error instead of running).

Why a thread rather than advancing a collective's rounds from successive autograd hooks: the
hand-written collectives are multi-round point-to-point exchanges whose every wait must be
serviced for the next round to be posted, and a backward pass offers only one hook per gradient,
at times set by the graph -- rounds would stall between hooks, and every algorithm would need
rewriting as a resumable state machine. A thread waits on gloo with the GIL released and posts each
round as soon as the previous one lands, with the collectives unchanged.

Rules that keep it correct (every rank must post its messages to a peer in the same order):
- one FIFO thread per group, so jobs run in submission order, which is the same on every rank
  (they are submitted from hooks the same graph fires in the same order);
- the submitting thread runs no collective of its own on ``comm`` while jobs are pending: callers
  ``drain()`` first (the ZeRO stages do it in ``sync_grads`` and before any main-thread collective);
- a job touches only what it was given (its buffers, the group): never state the submitting thread
  changes meanwhile -- e.g. a parameter's ``.grad``, which backward rewrites (reading it from the
  thread crashed the process);
- the thread lives from the first ``submit`` to the next ``drain`` (the optimizer drains in
  ``sync_grads`` and ``zero_grad``), idle between jobs in the meantime (a thread started per job
  made a ZeRO-3 step of the tiny model, communication skipped, cost 36 CPU ms instead of 17 on 2
  ranks; idling, 15 against 12: benchmarks/README.md); so none is alive between steps, none is ever started
  before the ranks are forked, and a daemon thread left by a forward without a step (evaluation)
  cannot keep a process from exiting. A group of one runs its jobs inline.
The header check and the per-kind counters (``header.collective``, ``comm.stats``) see each
collective as usual: one outermost collective at a time, on whichever thread.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

from distlib.comm.group import Comm


class Ticket:
    """One submitted job: ``wait()`` blocks until it ran and re-raises what it raised."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def _finish(self, error: BaseException | None) -> None:
        self.error = error
        self._done.set()

    def wait(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise self.error


class Progress:
    """A FIFO of collective jobs on ``comm``, run on a thread that lives from the first submit to
    the next ``drain``."""

    def __init__(self, comm: Comm):
        self.comm = comm
        self._cond = threading.Condition()
        self._jobs: collections.deque = collections.deque()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._failed: BaseException | None = None
        self._last: Ticket | None = None

    def submit(self, fn: Callable, *args) -> Ticket:
        ticket = Ticket()
        if self.comm.size == 1:  # nothing to wait on: run inline
            self._run(ticket, fn, args)
            return ticket
        with self._cond:
            self._jobs.append((ticket, fn, args))
            self._last = ticket
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name=f"distlib-comm-{self.comm.rank}", daemon=True
                )
                self._thread.start()
            self._cond.notify()
        return ticket

    def drain(self) -> None:
        """Wait for every job submitted so far and end the thread; re-raise the first failure (it
        stays: a group whose collective failed is out of step, so every later job and drain raises
        it too)."""
        thread = self._thread
        if thread is not None:
            with self._cond:
                self._stop = True
                self._cond.notify()
            thread.join()  # it leaves once the queue is empty
            self._stop = False
        if self._failed is not None:
            raise self._failed

    def _run(self, ticket: Ticket, fn: Callable, args) -> None:
        if self._failed is not None:  # a failed collective leaves the group out of step
            ticket._finish(self._failed)
            return
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            self._failed = exc
            ticket._finish(exc)
            return
        ticket._finish(None)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._stop:
                    self._cond.wait()  # idle between jobs of a step: no thread start per job
                if not self._jobs:
                    self._thread = None
                    return
                ticket, fn, args = self._jobs.popleft()
            self._run(ticket, fn, args)
            # Let go of the job now: held until the next one, an idle thread kept the last job's
            # buffers alive (a stage-2 gradient bucket, 32 KB over a llama step's peak measured).
            del ticket, fn, args
