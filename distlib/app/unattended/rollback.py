"""Where the divergence guard rolls back to.

A bad update at step S shows only in step S+1's loss, so a checkpoint saved after
step S is *pending* until step S+1 passes the guard; only then is it *trusted*, a
rollback target. Before the first trusted checkpoint the target is the run's starting
state: the checkpoint it resumed from, or (fresh start) this rank's optimizer partition
and RNG state kept in memory (12P/N bytes plus the RNG), dropped once a checkpoint is
trusted. After a rollback to step T, the checkpoints this run saved after T belong to
the abandoned trajectory: they are moved (never deleted) to ``<dir>/rolled_back_<n>/``
so the re-run steps can save again.

``Rollback`` is the trip itself; the targets are kept by the run's ``Checkpointer``
(``distlib.app.checkpointing.checkpointer``), whose retention must never delete the newest trusted one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from distlib.app.config.operation import GuardConfig
from distlib.app.observe.metrics import json_number
from distlib.app.unattended.guard import GuardError, Verdict
from distlib.checkpoint.sharded import CheckpointError
from distlib.comm import agree
from distlib.comm.group import Comm


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
        self.trusted: list[RollbackPoint] = [start] if start else []  # oldest first
        self.pending: RollbackPoint | None = None  # saved; waits for the next step's verdict
        self.saved: list[RollbackPoint] = []  # committed by this run and still in place

    def saved_checkpoint(self, step: int, path: Path, trusted: bool = False) -> bool:
        """A checkpoint was committed. ``trusted``: the step after it has passed the guard already
        (an async save commits at a later boundary); else it is pending. True if it is trusted now."""
        point = RollbackPoint(step, path)
        self.saved.append(point)
        if not self.trusted:  # the guard is off
            return False
        if trusted:
            self._trust(point)
            return True
        self.pending = point
        return False

    def step_passed(self) -> bool:
        """The step after the pending checkpoint passed the guard: that checkpoint is trusted.
        True if one was."""
        if self.pending is None:
            return False
        self._trust(self.pending)
        self.pending = None
        return True

    def _trust(self, point: RollbackPoint) -> None:
        self.trusted = [p for p in self.trusted if p.path is not None] + [point]

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


class Rollback:
    """What a guard trip does: no update; the newest trusted state is restored (through the
    checkpointer, which keeps the targets), the abandoned checkpoints are moved aside, and the
    replay must differ from the run that tripped. The first rollback to a target skips
    ``guard.skip_batches`` batches (0: it replays the same data, which heals a one-off fault); each
    further trip rolled back to the same target skips, on top, every batch the failed attempt read
    since the target (PaLM skips the batches around a spike), so a retry can never repeat the one
    before it. A trip that repeats an earlier one bit for bit (same step, same loss) is named as
    such. Past ``guard.max_rollbacks`` trips the run stops, saying what was tried. The skips are part
    of the checkpointed data position, so a resume continues exactly."""

    def __init__(self, cfg: GuardConfig, checkpointer, data, lr: float):
        self.cfg, self.checkpointer, self.data, self.lr = cfg, checkpointer, data, lr
        self.tried: list[dict] = []  # one per trip: step, loss_hex, to_step, skipped (batches skipped)
        self.offset: dict[int, int] = {}  # target step -> batches skipped past it so far

    @property
    def trips(self) -> int:
        return len(self.tried)

    def roll_back(self, step: int, verdict: Verdict, grad_norm: float, log) -> dict:
        """The guard tripped at ``step``: restore, log; returns the rollback event (``to_step``: the
        step restored; the run continues after it). Raises GuardError when it must stop instead."""
        detail = dict(reason=verdict.trip, loss=json_number(verdict.loss), grad_norm=json_number(grad_norm))
        repeat = next(
            (
                i + 1
                for i, t in enumerate(self.tried)
                if t["step"] == step and t["loss_hex"] == verdict.loss.hex()
            ),
            None,
        )
        trip = {"step": step, "loss_hex": verdict.loss.hex(), "to_step": None, "skipped": None}
        self.tried.append(trip)
        if self.trips > self.cfg.max_rollbacks:
            self._stop(step, verdict, repeat, detail, log)
        self.checkpointer.settle_for_rollback(step, log)  # an async save in flight: committed or dropped
        target, errors, distrusted = self._restore(step, verdict)
        set_aside = self.checkpointer.rolled_back_to(target, self.trips)
        skip = self._skip(target.step, step)
        self.data.skip(skip)
        trip.update(to_step=target.step, skipped=skip)
        source = target.describe()
        event = dict(
            to_step=target.step,
            source=source,
            set_aside=set_aside,
            distrusted=str(distrusted.path) if distrusted else None,
            skipped_batches=self.data.skipped,
            skip=skip,
            repeat_of=repeat,
            rollback=self.trips,
            max_rollbacks=self.cfg.max_rollbacks,
            failed_targets=errors,
            **detail,
        )
        said = (
            f"{verdict.trip}; no update applied, rolled back to step {target.step} ({source}), rollback "
            f"{self.trips} of at most {self.cfg.max_rollbacks}"
        )
        if repeat:
            said += (
                f"; the same trip as rollback {repeat}, bit for bit (step {step}, loss {verdict.loss:.6g}): "
                f"replaying the same data from the same state repeats it"
            )
        if skip:
            said += f", skipping {skip} batch(es)"
        log.event("rollback", step, say=said, **event)
        return {"step": step, **event}

    def _skip(self, target_step: int, trip_step: int) -> int:
        """Batches to skip past the restored position: ``guard.skip_batches`` the first time this
        target is rolled back to; after that, also every batch the failed attempt read."""
        if target_step not in self.offset:
            self.offset[target_step] = self.cfg.skip_batches
        else:
            self.offset[target_step] += trip_step - target_step
        return self.offset[target_step]

    def _restore(self, step: int, verdict: Verdict):
        """(the restored target, the targets that failed to load, the distrusted pending one)."""
        targets = self.checkpointer.targets
        distrusted, errors = targets.pending, []
        for target in targets.candidates():
            try:
                self.checkpointer.restore(target)
                return target, errors, distrusted
            except CheckpointError as exc:  # same verdict on every rank (load agrees on it)
                errors.append(str(exc))
        raise GuardError(
            f"guard tripped at step {step} ({verdict.trip}) but no state to roll back to: "
            + ("; ".join(errors) or "the guard keeps no rollback target")
        )

    def _stop(self, step: int, verdict: Verdict, repeat: int | None, detail: dict, log) -> None:
        """Past guard.max_rollbacks: one line saying the run diverges and what was tried."""
        tried = "; ".join(
            f"rollback {i} to step {t['to_step']} skipping {t['skipped']} batch(es) tripped again "
            f"at step {self.tried[i]['step']}"
            for i, t in enumerate(self.tried[:-1], 1)
        )
        message = (
            f"guard tripped at step {step} ({verdict.trip}); that is trip {self.trips}, more than "
            f"guard.max_rollbacks={self.cfg.max_rollbacks}: stopping instead of rolling back again. "
            + (f"It repeats rollback {repeat}'s trip bit for bit. " if repeat else "")
            + (f"Tried: {tried}. " if tried else "")
            + f"The run keeps tripping at optimizer.lr={self.lr:g} (it diverges, or its loss is too noisy "
            f"for guard.spike_factor={self.cfg.spike_factor:g}): lower optimizer.lr, or raise "
            f"guard.spike_factor, guard.spike_window or guard.max_rollbacks"
        )
        log.event("guard_stop", step, say=message, tried=self.tried, **detail)
        raise GuardError(message)
