"""What a guard trip does, and what it asks of the run's checkpoints.

A bad update at step S shows only in step S+1's loss, so a checkpoint saved after step S is
*pending* until step S+1 passes the guard; only then is it *trusted*, a rollback target. Before
the first trusted checkpoint the target is the run's starting state: the checkpoint it resumed
from, or (fresh start) this rank's optimizer partition and RNG state kept in memory (12P/N bytes
plus the RNG), dropped once a checkpoint is trusted. After a rollback to step T, the checkpoints
this run saved after T belong to the abandoned trajectory: they are moved (never deleted) to
``<dir>/rolled_back_<n>/`` so the re-run steps can save again.

``Rollback`` is the trip itself. It reaches the checkpoints only through ``RollbackSource``, the
three calls declared here; the run's ``Checkpointer`` implements them (the trusted and pending
checkpoints, and which are kept, are ``distlib.app.checkpointing.retention``'s).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from distlib.app.config.operation import GuardConfig
from distlib.app.observe.metrics import json_number
from distlib.app.unattended.guard import GuardError, Verdict
from distlib.checkpoint.sharded import CheckpointError


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


class RollbackSource(Protocol):
    """What a rollback asks of the run's checkpoints (collective calls, on every rank alike)."""

    def trusted_targets(self, trip: int, log) -> tuple[list[RollbackPoint], RollbackPoint | None]:
        """The guard tripped at step ``trip``: (the trusted rollback targets, newest first; the
        pending checkpoint the trip distrusts, or None). A save still in flight is settled first."""
        ...

    def restore(self, point: RollbackPoint) -> None:
        """Return the run's state to ``point``; raises CheckpointError if it cannot be loaded."""
        ...

    def rolled_back_to(self, point: RollbackPoint, rollback: int) -> list[str]:
        """Rollback number ``rollback`` restored ``point``: the later checkpoints are moved aside
        (their new paths returned)."""
        ...


class Rollback:
    """What a guard trip does: no update; the newest trusted state that loads is restored
    (through ``RollbackSource``), the abandoned checkpoints are moved aside, and the
    replay must differ from the run that tripped. The first rollback to a target skips
    ``guard.skip_batches`` batches (0: it replays the same data, which heals a one-off fault); each
    further trip rolled back to the same target skips, on top, every batch the failed attempt read
    since the target (PaLM skips the batches around a spike), so a retry can never repeat the one
    before it. A trip that repeats an earlier one bit for bit (same step, same loss) is named as
    such. Past ``guard.max_rollbacks`` trips the run stops, saying what was tried. The skips are part
    of the checkpointed data position, so a resume continues exactly."""

    def __init__(self, cfg: GuardConfig, checkpoints: RollbackSource, data, lr: float):
        self.cfg, self.checkpoints, self.data, self.lr = cfg, checkpoints, data, lr
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
        target, errors, distrusted = self._restore(step, verdict, log)
        set_aside = self.checkpoints.rolled_back_to(target, self.trips)
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

    def _restore(self, step: int, verdict: Verdict, log):
        """(the restored target, the targets that failed to load, the distrusted pending one)."""
        targets, distrusted = self.checkpoints.trusted_targets(step, log)
        errors = []
        for target in targets:
            try:
                self.checkpoints.restore(target)
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
