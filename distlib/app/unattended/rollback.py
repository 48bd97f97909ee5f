"""Where the divergence guard rolls back to.

A bad update at step S shows only in step S+1's loss, so a checkpoint saved after
step S is *pending* until step S+1 passes the guard; only then is it *trusted*, a
rollback target. Before the first trusted checkpoint the target is the run's starting
state: the checkpoint it resumed from, or (fresh start) this rank's optimizer partition
and RNG state kept in memory (12P/N bytes plus the RNG), dropped once a checkpoint is
trusted. After a rollback to step T, the checkpoints this run saved after T belong to
the abandoned trajectory: they are moved (never deleted) to ``<dir>/rolled_back_<n>/``
so the re-run steps can save again.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from distlib.comm import agree
from distlib.comm.group import Comm
from distlib.app.unattended.guard import GuardError


class RollbackError(GuardError):
    """Checkpoints of the abandoned trajectory could not be moved aside."""


@dataclass
class RollbackPoint:
    """A committed checkpoint, or (path None) a state in memory: (tensors, rank_state)."""
    step: int
    path: Path | None
    state: tuple[dict, dict] | None = None

    def describe(self) -> str:
        return str(self.path) if self.path else f"the step-{self.step} state kept in memory"


class RollbackTargets:
    def __init__(self, start: RollbackPoint | None):
        self.trusted: list[RollbackPoint] = [start] if start else []   # oldest first
        self.pending: RollbackPoint | None = None   # saved; waits for the next step's verdict
        self.saved: list[RollbackPoint] = []        # committed by this run and still in place

    def saved_checkpoint(self, step: int, path: Path) -> None:
        point = RollbackPoint(step, path)
        self.saved.append(point)
        if self.trusted:         # (the guard is on)
            self.pending = point

    def step_passed(self) -> bool:
        """The step after the pending checkpoint passed the guard: that checkpoint is trusted.
        True if one was."""
        if self.pending is None:
            return False
        self.trusted = [p for p in self.trusted if p.path is not None] + [self.pending]
        self.pending = None
        return True

    def forget(self, removed: list[str]) -> None:
        """Checkpoints deleted by retention (checkpoint.keep_last) are no rollback targets."""
        gone = set(removed)
        self.trusted = [p for p in self.trusted if p.path is None or str(p.path) not in gone]
        self.saved = [p for p in self.saved if str(p.path) not in gone]

    def candidates(self) -> list[RollbackPoint]:
        """Trusted targets, newest first; the pending one (if any) is distrusted from now on."""
        self.pending = None
        return list(reversed(self.trusted))

    def rolled_back_to(self, target: RollbackPoint, trip: int, root: Path, comm: Comm) -> list[str]:
        """Forget what lies beyond ``target`` and move this run's later checkpoints aside (rank 0
        moves, every rank hears whether it worked). Returns the new paths."""
        self.trusted = [p for p in self.trusted if p.step <= target.step]
        later = [p for p in self.saved if p.step > target.step]
        self.saved = [p for p in self.saved if p.step <= target.step]
        moves = [(p.path, Path(root) / f"rolled_back_{trip}" / p.path.name) for p in later]

        def move_aside() -> None:
            for src, dest in moves:
                try:
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    os.rename(src, dest)
                except OSError as exc:
                    raise RollbackError(f"could not move {src} aside after a rollback: {exc}") from exc

        agree.agreed(move_aside, comm, RollbackError, rank0_only=True)
        return [str(dest) for _, dest in moves]
