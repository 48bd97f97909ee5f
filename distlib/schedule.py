"""When to save and when to stop: step counts, rank 0's clock, and pre-emption signals.

Every step ends with one small collective (``decide``) that carries two decisions:
rank 0's clock verdict ("``every_minutes`` have passed since the last save"; the
other ranks' clocks are never consulted, so all ranks save at the same step) and
whether any rank received SIGTERM/SIGINT (a pre-emption may reach the ranks at
different moments, or only some of them). On a stop every rank saves at the same
step and leaves the loop.
"""
from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import Callable

from distlib import agree
from distlib.comm import Comm

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """While installed, SIGTERM/SIGINT only record a request; the loop stops at a step boundary.
    (A process stuck outside the loop is ended by its launcher: torchrun sends SIGKILL after
    its --shutdown-timeout.)"""

    def __init__(self) -> None:
        self.received: int = 0              # signal number, 0 = none
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def __enter__(self) -> "StopSignals":
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
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
    save: str | None         # why to save after this step: "every_steps", "every_minutes", "signal"
    stop: str | None         # the signal that stops the run after this step (e.g. "SIGTERM")


def decide(step: int, every_steps: int, clock: CheckpointClock, signals: StopSignals, comm: Comm) -> Decision:
    """The same Decision on every rank, through one collective."""
    time_due, signum = agree.rank0_and_any(int(clock.due()), signals.received, comm)
    stop = signal.Signals(signum).name if signum else None
    if every_steps and step % every_steps == 0:
        save = "every_steps"
    elif time_due:
        save = "every_minutes"
    else:
        save = "signal" if stop else None
    return Decision(save, stop)
