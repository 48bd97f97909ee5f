"""Which checkpoints a run keeps, which it deletes, and when: the one place that decides.

``Retention`` is the only caller of ``distlib.checkpoint.sharded.delete``. The rule, with
``checkpoint.keep_last=K``:

* K = 0 (the default): no checkpoint is ever deleted.
* K > 0: rank 0 deletes every committed checkpoint in the run's checkpoint directory but the newest
  K (by step; an earlier run's count too), at the moment a checkpoint becomes *trusted* and only
  then:

  - guard off: at its commit (no verdict to wait for);
  - guard on: when the step after it passes the guard, at its commit if that step passed already
    (an async save committed later), or at the end of the run (the last checkpoint is as trusted
    as it will get).

  While a checkpoint is *pending* (saved, its next step not yet judged) nothing is deleted: if the
  guard distrusts it, the newest trusted checkpoint must still be there to roll back to. Since the
  checkpoint that just became trusted is the newest, it is always kept, and a crash in the middle
  never leaves fewer than K (each is un-committed, its manifest removed, before its directory).
* The resume check reloads the run's first save, which K > 0 may delete: then it follows the
  newest save, which the rule keeps (``resume_check_follows_newest``).

Also here, moved aside rather than deleted: after a rollback the checkpoints this run saved past
the restored step go to ``<dir>/rolled_back_<n>/`` (``set_aside``), so the re-run can save them
again and ``resume=latest`` never picks them.

Removed elsewhere, because none of them is a committed checkpoint: a save's ``.step_X.partial/``
directory (a failed or dropped save, or one a crash left behind; the save protocol in
``distlib.checkpoint.sharded`` removes it, or the run's end, ``remove_unfinished`` here, which
``Checkpointer.finish`` calls; it was never listed or loaded); a damaged checkpoint
``resume=latest`` skips is moved to ``step_X.damaged`` for inspection (``Loader.resolve``); the
memory snapshots in /dev/shm (``MemorySnapshots``: each round replaces the last, the run's end
removes them).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

from distlib.app.unattended.rollback import RollbackError, RollbackPoint
from distlib.checkpoint import sharded as checkpoint
from distlib.comm import agree
from distlib.comm.group import Comm

T = TypeVar("T")


def doomed(committed: Sequence[T], keep_last: int) -> list[T]:
    """Of the committed checkpoints (oldest first), those the rule deletes once one became trusted:
    all but the newest ``keep_last`` (0 deletes none)."""
    return list(committed[:-keep_last]) if keep_last > 0 else []


class Retention:
    """This run's committed checkpoints, which are trusted rollback targets, and the rule above
    applied: each event method returns the checkpoints it deleted (the same list on every rank)."""

    def __init__(self, keep_last: int, guarded: bool, root: Path, comm: Comm):
        self.keep_last, self.guarded, self.root, self.comm = keep_last, guarded, Path(root), comm
        self.trusted: list[RollbackPoint] = []  # rollback targets, oldest first
        self.pending: RollbackPoint | None = None  # saved; waits for the next step's verdict
        self.saved: list[RollbackPoint] = []  # committed by this run and still in place

    @property
    def resume_check_follows_newest(self) -> bool:
        """Whether the resume check must follow the newest save: the first may be deleted."""
        return self.keep_last > 0

    def start(self, point: RollbackPoint) -> None:
        """Guard on: the run's starting state (the checkpoint it resumed from, or kept in memory)
        is the first rollback target."""
        self.trusted = [point]

    # -- the moments the rule runs ------------------------------------------------------
    def committed(self, step: int, path: Path, trusted: bool) -> list[str]:
        """A checkpoint was committed; ``trusted``: the step after it has passed the guard already."""
        point = RollbackPoint(step, Path(path))
        self.saved.append(point)
        if trusted or not self.guarded:
            return self._trust(point)
        self.pending = point
        return []

    def step_passed(self) -> list[str]:
        """The guard accepted a step: the pending checkpoint (saved after the previous one) is trusted."""
        if self.pending is None:
            return []
        point, self.pending = self.pending, None
        return self._trust(point)

    def end(self) -> list[str]:
        """The end of the run: no verdict will come for the pending checkpoint; it counts as trusted."""
        return self.step_passed()

    def _trust(self, point: RollbackPoint) -> list[str]:
        # A trusted checkpoint replaces the in-memory starting state as a target (its memory is freed).
        self.trusted = [p for p in self.trusted if p.path is not None] + [point]
        return self._delete()

    def _delete(self) -> list[str]:
        """Rank 0 deletes what ``doomed`` names; every rank forgets those as rollback targets."""
        if not self.keep_last:
            return []
        removed = agree.agreed(self._delete_on_rank0, self.comm, checkpoint.CheckpointError, rank0_only=True)
        gone = set(removed)
        self.trusted = [p for p in self.trusted if p.path is None or str(p.path) not in gone]
        self.saved = [p for p in self.saved if str(p.path) not in gone]
        return removed

    def _delete_on_rank0(self) -> list[str]:
        removed = []
        try:
            for path in doomed(checkpoint.list_committed(self.root), self.keep_last):
                checkpoint.delete(path)
                removed.append(str(path))
                print(f"checkpoint: removed {path} (checkpoint.keep_last={self.keep_last})")
        except OSError as exc:  # training can go on; the operator must hear about it
            print(f"warning: checkpoint.keep_last could not remove an old checkpoint: {exc}", file=sys.stderr)
        return removed

    # -- a rollback -----------------------------------------------------------------------
    def distrust(self) -> tuple[list[RollbackPoint], RollbackPoint | None]:
        """The guard tripped: (the trusted targets, newest first; the pending checkpoint, which
        holds the rejected update's state and is never trusted, or None)."""
        distrusted, self.pending = self.pending, None
        return list(reversed(self.trusted)), distrusted

    def set_aside(self, target: RollbackPoint, rollback: int) -> list[str]:
        """After rollback number ``rollback`` to ``target``: forget what lies beyond it and move this
        run's later checkpoints to ``rolled_back_<rollback>/`` (rank 0 moves, every rank hears
        whether it worked). Returns their new paths."""
        self.trusted = [p for p in self.trusted if p.step <= target.step]
        later = [p for p in self.saved if p.step > target.step]
        self.saved = [p for p in self.saved if p.step <= target.step]
        moves = [(p.path, self.root / f"rolled_back_{rollback}" / p.path.name) for p in later]

        def move_aside() -> None:
            for src, dest in moves:
                try:
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    os.rename(src, dest)
                except OSError as exc:
                    raise RollbackError(f"could not move {src} aside after a rollback: {exc}") from exc

        agree.agreed(move_aside, self.comm, RollbackError, rank0_only=True)
        return [str(dest) for _, dest in moves]


def remove_unfinished(root: Path) -> list[Path]:
    """Remove the partial directories under ``root`` of saves that never committed and that no
    later save of the same step removed (``sharded.begin``): a crash inside the save of a step that a
    resume from its memory snapshot then went past. Only when no save is in flight (the run's end).
    Returns what it removed."""
    found = sorted(Path(root).glob(".step_*.partial")) if Path(root).is_dir() else []
    for partial in found:
        shutil.rmtree(partial, ignore_errors=True)
    return found
