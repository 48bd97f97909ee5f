"""When to save and when to stop: step counts, rank 0's clock, and pre-emption signals.

Every step ends with one small collective (the trainer's per-step gather, which carries each
rank's ``vote``; ``decision`` reads the gathered votes) that carries two decisions:
rank 0's clock verdict ("``every_minutes`` have passed since the last save"; the
other ranks' clocks are never consulted, so all ranks save at the same step) and
whether any rank received SIGTERM/SIGINT/SIGUSR2 (a pre-emption may reach the ranks at
different moments, or only some of them). On a stop every rank saves at the same
step and leaves the loop. With ``checkpoint.async_save`` the same collective carries a third
fact: whether any rank's background checkpoint write is still running (when none is, the
ranks commit that save at this boundary); with it off the collective is unchanged.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from distlib.comm.group import Comm

# SIGUSR2: what conf/hydra/launcher/submitit_slurm.yaml asks SLURM to send before the time limit
# (`--signal=USR2@N`); it must save and stop like a pre-emption, not kill the rank.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)


class StopSignals:
    """While installed, SIGTERM/SIGINT/SIGUSR2 only record a request; the loop stops at a step boundary.

    A rank that cannot reach the boundary (stalled outside a collective: a launcher sends
    every worker SIGTERM once one has failed) would otherwise ignore the signal until the
    launcher's SIGKILL (torchrun waits 30 s). So the first signal also starts a deadline:
    if the loop has not acknowledged the stop ``deadline_s`` later, the process exits with
    128 + signal. The loop keeps ``deadline_s`` at dist.timeout_s plus twice its slowest
    step, the most a healthy rank needs to reach the next step boundary.
    """

    def __init__(self, deadline_s: float = 60.0) -> None:
        self.received: int = 0  # signal number, 0 = none
        self.deadline_s = deadline_s
        self._acknowledged = threading.Event()
        self._previous: dict[int, object] = {}
        self._timer: threading.Timer | None = None

    def _handle(self, signum, frame) -> None:
        if self.received:
            return
        self.received = signum
        self._timer = threading.Timer(self.deadline_s, self._expire, args=(signum,))
        self._timer.daemon = True
        self._timer.start()

    def _expire(self, signum: int) -> None:
        if not self._acknowledged.is_set():
            print(
                f"{signal.Signals(signum).name} received, but this process did not reach a step boundary "
                f"within {self.deadline_s:.0f}s (stalled?); exiting without saving",
                file=sys.stderr,
                flush=True,
            )
            os._exit(128 + signum)

    def acknowledge(self) -> None:
        """The loop has seen the stop decision and is saving: no deadline any more."""
        self._acknowledged.set()

    def __enter__(self) -> StopSignals:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        self._acknowledged.set()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


class CheckpointClock:
    """Rank 0's wall clock for ``checkpoint.every_minutes`` (0 disables)."""

    def __init__(self, every_minutes: float, clock: Callable[[], float] = time.monotonic):
        self.every_s, self.clock = every_minutes * 60.0, clock
        self.last_save = clock()

    def due(self) -> bool:
        return self.every_s > 0 and self.clock() - self.last_save >= self.every_s

    def saved(self) -> None:
        self.last_save = self.clock()


@dataclass(frozen=True)
class Decision:
    save: str | None  # why to save after this step: "every_steps", "every_minutes", "signal"
    stop: str | None  # the signal that stops the run after this step (e.g. "SIGTERM")
    writes_done: bool = False  # async saves: no rank's background write is still running


def vote(
    clock: CheckpointClock, signals: StopSignals, comm: Comm, writing: bool | None = False
) -> list[float]:
    """This rank's part of the decision (``VOTE_WIDTH`` floats): rank 0's clock verdict (the
    others' clocks never count), the stop signal this rank received (0: none) and whether its
    background checkpoint write (checkpoint.async_save) is still running."""
    return [float(clock.due()) if comm.rank == 0 else 0.0, float(signals.received), float(bool(writing))]


VOTE_WIDTH = 3


def decision(step: int, every_steps: int, votes: list[list[float]]) -> Decision:
    """The Decision every rank takes from the same gathered ``vote`` rows."""
    time_due, signum = bool(votes[0][0]), int(max(v[1] for v in votes))
    writes_done = not any(v[2] for v in votes)
    stop = signal.Signals(signum).name if signum else None
    if every_steps and step % every_steps == 0:
        save = "every_steps"
    elif time_due:
        save = "every_minutes"
    else:
        save = "signal" if stop else None
    return Decision(save, stop, writes_done)
