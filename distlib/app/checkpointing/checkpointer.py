"""Every checkpoint decision of a run, behind the few calls the Trainer makes.

    resume()           fresh start (from model.init_from's weights, if set), an explicit checkpoint, or
                       "latest" (a memory snapshot first, if newer); loads it; returns the step to
                       continue after
    boundary(step, d)  the checkpoint part of a step boundary: commit an async save in flight, take
                       the save the decision ``d`` asks for, keep the memory snapshot
    step_passed()      the guard accepted the step after a save: that checkpoint is trusted (then pruned)
    finish(step)       the end of the run: an async save in flight is committed, snapshots removed
    restore(point)     a rollback target: a checkpoint, or the starting state kept in memory
    verify_resume()    reload a checkpoint of this run into a fresh model and compare every byte

It composes the parts, each an object with its own small API: ``Contents`` (what a checkpoint
holds), ``Loader`` (finding and loading one), ``AsyncSaver`` (the save in flight),
``ResumeVerifier`` (invariant 4), ``MemorySnapshots`` (/dev/shm) and the guard's
``RollbackTargets``, which are kept here because retention must never delete the newest trusted
one. The file format and its commit protocol are ``distlib.checkpoint``'s.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from distlib.app.checkpointing import init_from
from distlib.app.checkpointing.async_saver import (
    AsyncSaveFailed,
    AsyncSaver,
    Saved,
    report_failed,
    report_saved,
)
from distlib.app.checkpointing.contents import Contents
from distlib.app.checkpointing.loader import Loader
from distlib.app.checkpointing.memory_snapshots import MemorySnapshots, fingerprint
from distlib.app.checkpointing.resume_check import Kept, ResumeCheck, ResumeVerifier
from distlib.app.config.run import RunConfig
from distlib.app.data.batches import GlobalBatches
from distlib.app.hooks import StepHooks
from distlib.app.unattended.rollback import RollbackPoint, RollbackTargets
from distlib.app.unattended.stopping import CheckpointClock, Decision
from distlib.checkpoint import rng_state
from distlib.checkpoint import sharded as checkpoint
from distlib.comm import agree
from distlib.comm.group import Comm
from distlib.comm.mesh import Mesh
from distlib.parallel.tensor_parallel import Split
from distlib.parallel.zero import ZeroOptimizer


class Checkpointer:
    def __init__(
        self,
        cfg: RunConfig,
        comm: Comm,
        mesh: Mesh,
        run_dir: Path,
        data: GlobalBatches,
        model: torch.nn.Module,
        optimizer: ZeroOptimizer,
        tp_splits: dict[str, Split],
        hooks: StepHooks,
        clock: Callable[[], float],
    ):
        c = cfg.checkpoint
        self.cfg, self.comm, self.data, self.hooks = cfg, comm, data, hooks
        self.model, self.optimizer = model, optimizer  # the run's; the resume check loads into fresh ones
        self.root = Path(run_dir) / c.dir
        self.clock = CheckpointClock(c.every_minutes, clock)  # rank 0's decides every_minutes
        self.contents = Contents(cfg, mesh, data, optimizer, tp_splits, run_dir)
        self.loader = Loader(cfg, comm, mesh, data, self.root, self.say)
        self.verifier = ResumeVerifier(
            cfg.verifies_resume,
            bool(c.keep_last),
            cfg.seed,
            mesh.dp.rank,
            comm,
            self.root,
            self.loader,
            self.contents,
        )
        self.async_saver = AsyncSaver(comm) if c.async_save else None
        self.memory = MemorySnapshots(
            c.memory_every_steps,
            comm,
            run_dir,
            lambda: fingerprint(self.contents.meta(0), comm.size),
            self.say,
        )
        self.targets = RollbackTargets(None)  # replaced by resume(): the run's starting state

    def say(self, message: str) -> None:
        if self.comm.rank == 0:
            print(message, flush=True)

    # -- starting ---------------------------------------------------------------
    def resume(self) -> tuple[int, Path | None]:
        """Load what checkpoint.resume names (if anything); (the step to continue after, its path).
        With the guard on, that state is the first rollback target."""
        snapped = self.memory.resume(self.cfg.checkpoint.resume == "latest", self.root)  # a RollbackPoint
        path, verified = (None, False) if snapped else self.loader.resolve()
        start = snapped.step if snapped else 0
        if snapped:
            self.restore(snapped)
        elif path is not None:
            start = self.loader.load(path, self.model, self.optimizer, verified)
            self.say(f"resumed from {path} at step {start}")
        elif self.cfg.model.init_from:  # a fresh start only: a resume never reads the directory
            init_from.start_from(self.cfg.model, self.comm, self.optimizer, self.contents.tp_splits)
            self.say(f"model.init_from: starting from the weights of {self.cfg.model.init_from}")
        if self.cfg.guard.enabled:
            self.targets = RollbackTargets(
                RollbackPoint(start, path)
                if path
                else RollbackPoint(start, None, self.contents.state(start, self.optimizer))
            )
        return start, self.memory.dir if snapped else path

    # -- a step boundary ----------------------------------------------------------
    def writing(self) -> bool | None:
        """For the step's decision: None with checkpoint.async_save off, else whether this rank's
        background write is still running."""
        return None if self.async_saver is None else self.async_saver.writing()

    def boundary(self, step: int, decision: Decision, log) -> list[Saved]:
        """Commit the async save in flight once no rank is still writing (or, waiting for it, before a
        new save or a stop), take the save ``decision`` asks for, then the memory snapshot. Returns
        the saves committed here (each logged)."""
        done = []
        if self.writing() is not None and (decision.writes_done or decision.save or decision.stop):
            done += self.settle(step, log, fatal=bool(decision.stop))
        if decision.save and self.async_saver is not None:
            self._start_async(step, decision.save)
        elif decision.save:
            done.append(self._save(step, decision.save))
            report_saved(log, done[-1], step)
        if decision.stop:
            done += self.settle(step, log, fatal=True)
        self.memory.after_step(step, lambda: self.contents.state(step, self.optimizer))
        return done

    def _save(self, step: int, reason: str) -> Saved:
        """Commit this run's state after ``step`` now (collective)."""
        began = time.perf_counter()
        state = self.contents.state(step, self.optimizer)
        meta, hook = self.contents.meta(step), self.hooks.save_hook(step)
        path = checkpoint.save(self.root, step, *state, meta, self.comm, hook, self.contents.extras())
        self.clock.saved()
        params = self.optimizer.params_snapshot() if self.verifier.wants() else None
        seconds = time.perf_counter() - began
        return self._committed(Saved(path, {}, seconds, step, reason, seconds), state, params, trusted=False)

    def _start_async(self, step: int, reason: str) -> None:
        """Copy the state into the staging buffers and start its background write."""
        began = time.perf_counter()
        saver = self.async_saver
        state = self.contents.state(step, self.optimizer, staging=saver.staging)
        params = self.optimizer.params_snapshot() if self.verifier.wants() else None
        if params is not None:  # these host copies become the resume check's at the commit
            saver.staging.hand_over()
        saver.start(
            self.root,
            step,
            reason,
            state,
            self.contents.meta(step),
            self.hooks.save_hook(step),
            params,
            began,
            self.contents.extras(),
        )
        self.clock.saved()

    def settle(self, boundary: int, log, fatal: bool) -> list[Saved]:
        """Wait for the async save in flight (if any) and commit it (collective). A failed write is
        reported (one line, a checkpoint_failed event) and nothing is committed: the previous
        checkpoint stays the trusted one; ``fatal`` (a stop, the end of the run) raises it then."""
        if self.async_saver is None:
            return []
        try:
            committed = self.async_saver.commit()
        except AsyncSaveFailed as exc:
            report_failed(log, exc.pending, boundary, exc, fatal)
            if fatal:
                raise
            return []
        if committed is None:
            return []
        pending, saved = committed
        # Committed after a later step passed the guard: trusted at once (a stop commits at its own step).
        saved = self._committed(
            saved, (pending.tensors, pending.rank_state), pending.params, trusted=boundary > pending.step
        )
        report_saved(log, saved, boundary)
        return [saved]

    def settle_for_rollback(self, trip: int, log) -> None:
        """The guard tripped at step ``trip`` with an async save in flight: if the step after the
        saved one passed the guard, commit it (the newest trusted target); else it holds the bad
        update's state: wait for the writes and drop it."""
        pending = self.async_saver and self.async_saver.in_flight
        if not pending:
            return
        if trip > pending.step + 1:
            self.settle(trip, log, fatal=False)
        else:
            self.async_saver.drop()
            self.say(
                f"checkpoint: dropped the async save of step {pending.step} (step {trip} tripped the guard)"
            )

    def _committed(
        self, saved: Saved, state: tuple[dict, dict], params: torch.Tensor | None, trusted: bool
    ) -> Saved:
        """Bookkeeping of a committed save: the resume check's copy, rollback targets, retention."""
        if params is not None:
            replaced = self.verifier.keep(Kept(saved.step, *state, params))
            if replaced is not None and self.async_saver is not None:  # its tensors: the next save's buffers
                self.async_saver.staging.take_back(replaced.tensors)
        if self.targets.saved_checkpoint(saved.step, saved.path, trusted) or not self.cfg.guard.enabled:
            self.prune()
        return Saved(
            saved.path,
            checkpoint.read_manifest(saved.path),
            saved.seconds,
            saved.step,
            saved.reason,
            saved.blocking_s,
            saved.write_s,
        )

    def step_passed(self) -> None:
        """The guard accepted a step: a checkpoint saved after the previous one is trusted now."""
        if self.targets.step_passed():
            self.prune()

    def finish(self, step: int, log) -> list[Saved]:
        """The end of the run: an async save in flight is waited for and committed (a failure
        raises), then the last checkpoint is as trusted as it will get."""
        done = self.settle(step, log, fatal=True)
        self.memory.finish()
        if self.targets.pending is not None:
            self.prune()
        return done

    def prune(self) -> None:
        """checkpoint.keep_last: rank 0 deletes all but the newest K committed checkpoints, and every
        rank forgets them as rollback targets. With the guard on it runs when a checkpoint becomes
        trusted (and at the end), so the newest trusted rollback target is never deleted."""
        keep = self.cfg.checkpoint.keep_last
        if not keep:
            return

        def remove() -> list[str]:
            removed = []
            try:
                removed = [str(p) for p in checkpoint.prune(self.root, keep)]
                for old in removed:
                    print(f"checkpoint: removed {old} (checkpoint.keep_last={keep})")
            except OSError as exc:  # training can go on; the operator must hear about it
                print(
                    f"warning: checkpoint.keep_last could not remove an old checkpoint: {exc}",
                    file=sys.stderr,
                )
            return removed

        self.targets.forget(agree.agreed(remove, self.comm, checkpoint.CheckpointError, rank0_only=True))

    # -- rollback and the end -----------------------------------------------------
    def restore(self, point: RollbackPoint) -> None:
        """Return the run to a rollback target: a checkpoint (``Loader.load``) or a state kept in memory."""
        if point.path is not None:
            self.loader.load(point.path, self.model, self.optimizer)
            return
        tensors, rank_state = point.state
        self.optimizer.load_state_shard(tensors, rank_state["optimizer_steps"])
        rng_state.restore_rng(tensors, rank_state["rng"])
        rng_state.restore_device_rng(tensors, self.optimizer.device)
        self.data.skipped = rank_state.get("skipped_batches", 0)

    def rolled_back_to(self, target: RollbackPoint, trip: int) -> list[str]:
        """After a rollback to ``target``: this run's later checkpoints are moved aside (their new
        paths returned) and none of them is the one the resume check reloads."""
        set_aside = self.targets.rolled_back_to(target, trip, self.root, self.comm)
        self.memory.rolled_back(target.step)
        self.verifier.forget_after(target.step)
        return set_aside

    def verify_resume(self, build: Callable[[], tuple[torch.nn.Module, ZeroOptimizer]]) -> ResumeCheck | None:
        """Invariant 4 (``ResumeVerifier.verify``); ``build`` makes a fresh model and optimizer."""
        return self.verifier.verify(build)
