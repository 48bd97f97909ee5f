"""Every checkpoint decision of a run, behind the few calls the Trainer makes.

    resume()           fresh start (from model.init_from's weights, if set), an explicit checkpoint, or
                       "latest" (a memory snapshot first, if newer); loads it; returns the step to
                       continue after
    snapshot(step, r)  the memory snapshot, with the step's metrics record ``r`` (written after it)
    boundary(step, d)  the checkpoint part of a step boundary: commit an async save in flight, take
                       the save the decision ``d`` asks for
    step_passed()      the guard accepted the step after a save: that checkpoint is trusted
    finish(step)       the end of the run: an async save in flight is committed, snapshots removed
    verify_resume()    reload a checkpoint of this run into a fresh model and compare every byte

and the guard's ``Rollback`` calls (``RollbackSource``): ``trusted_targets``, ``restore`` (a
checkpoint, or the starting state kept in memory) and ``rolled_back_to``.

It composes the parts, each an object with its own small API: ``Contents`` (what a checkpoint
holds), ``Loader`` (finding and loading one), ``AsyncSaver`` (the save in flight),
``ResumeVerifier`` (invariant 4), ``MemorySnapshots`` (/dev/shm) and ``Retention`` (which
checkpoints are trusted, kept and deleted, and when). The file format and its commit protocol
are ``distlib.checkpoint``'s.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from distlib.app.checkpointing import init_from
from distlib.app.checkpointing import state_buffers as buffers
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
from distlib.app.checkpointing.retention import Retention, remove_unfinished
from distlib.app.config.run import RunConfig
from distlib.app.data.batches import GlobalBatches
from distlib.app.model.bias_balance import state_buffers
from distlib.app.runtime.hooks import StepHooks
from distlib.app.unattended.rollback import RollbackPoint, RollbackSource
from distlib.app.unattended.stopping import CheckpointClock, Decision
from distlib.checkpoint import rng_state
from distlib.checkpoint import sharded as checkpoint
from distlib.comm.mesh import Mesh
from distlib.parallel.tensor_parallel import Split
from distlib.parallel.zero import ZeroOptimizer


@dataclass(frozen=True)
class RunState:
    """What a checkpoint saves and restores: the run's model and optimizer (the resume check loads
    into fresh ones), its data position, and how tensor parallelism split the parameters."""

    model: torch.nn.Module
    optimizer: ZeroOptimizer
    data: GlobalBatches
    tp_splits: dict[str, Split]


class Checkpointer(RollbackSource):
    def __init__(
        self,
        cfg: RunConfig,
        mesh: Mesh,
        run_dir: Path,
        state: RunState,
        hooks: StepHooks,
        clock: CheckpointClock,
    ):
        c, comm = cfg.checkpoint, mesh.world
        self.cfg, self.comm, self.hooks, self.clock = cfg, comm, hooks, clock
        self.model, self.optimizer, self.data = state.model, state.optimizer, state.data
        self.root = Path(run_dir) / c.dir
        self.buffers = state_buffers(state.model)  # model state besides the parameters
        self.contents = Contents(
            cfg, mesh, state.data, state.optimizer, state.tp_splits, run_dir, self.buffers
        )
        self.loader = Loader(cfg, comm, mesh, state.data, self.root, self.say, state.tp_splits)
        self.retention = Retention(c.keep_last, cfg.guard.enabled, self.root, comm)
        self.verifier = ResumeVerifier(
            cfg.verifies_resume,
            self.retention.resume_check_follows_newest,
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
        self.recovered: dict | None = None  # the resumed snapshot's metrics record (``snapshot``)

    def say(self, message: str) -> None:
        if self.comm.rank == 0:
            print(message, flush=True)

    # -- starting ---------------------------------------------------------------
    def resume(self) -> tuple[int, Path | None]:
        """Load what checkpoint.resume names (if anything); (the step to continue after, its path).
        With the guard on, that state is the first rollback target."""
        continuing = self.cfg.checkpoint.resume == "latest" or self.loader.restarting_from_path()
        snapped = self.memory.resume(continuing, self.root)  # a RollbackPoint
        path, verified = (None, False) if snapped else self.loader.resolve()
        start = snapped.step if snapped else 0
        if snapped:
            self.restore(snapped)
            self.recovered = snapped.state[1].get("record")
        elif path is not None:
            start = self.loader.load(path, self.model, self.optimizer, verified)
            self.say(f"resumed from {path} at step {start}")
        elif self.cfg.model.init_from:  # a fresh start only: a resume never reads the directory
            init_from.start_from(
                self.cfg.model, self.comm, self.optimizer, self.contents.tp_splits, self.buffers
            )
            self.say(f"model.init_from: starting from the weights of {self.cfg.model.init_from}")
        if self.retention.guarded:  # no checkpoint holds a fresh start's state: kept in memory
            state = None if path else self.contents.state(start, self.optimizer)
            self.retention.start(RollbackPoint(start, path, state))
        return start, self.memory.dir if snapped else path

    # -- a step boundary ----------------------------------------------------------
    def writing(self) -> bool | None:
        """For the step's decision: None with checkpoint.async_save off, else whether this rank's
        background write is still running."""
        return None if self.async_saver is None else self.async_saver.writing()

    def snapshot(self, step: int, record: dict | None) -> None:
        """The memory snapshot of ``step`` (collective, every K-th step), with the step's metrics
        ``record`` (rank 0's, unwritten: ``MetricsLog.step(defer=True)``) in it: the trainer writes
        the record after the round, so a recorded step is in every rank's snapshot, and a resume
        from it writes a record the kill kept from the file (``recovered``)."""
        if self.memory.every:  # (off by default: a step never enters the snapshots' module)
            self.memory.after_step(
                step, lambda: _with_record(self.contents.state(step, self.optimizer, live=True), record)
            )

    def boundary(self, step: int, decision: Decision, log) -> list[Saved]:
        """Commit the async save in flight once no rank is still writing (or, waiting for it, before
        a new save or a stop), and take the save ``decision`` asks for. Returns the saves committed
        here (each logged)."""
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

    def _committed(
        self, saved: Saved, state: tuple[dict, dict], params: torch.Tensor | None, trusted: bool
    ) -> Saved:
        """A save committed: the resume check may keep its state, retention hears of it; returns
        ``saved`` with its manifest (for the log and the run's result)."""
        if params is not None:
            self._keep_for_resume_check(Kept(saved.step, *state, params))
        self.retention.committed(saved.step, saved.path, trusted)
        return dataclasses.replace(saved, manifest=checkpoint.read_manifest(saved.path))

    def _keep_for_resume_check(self, kept: Kept) -> None:
        replaced = self.verifier.keep(kept)
        if replaced is not None and self.async_saver is not None:  # its tensors: the next save's buffers
            self.async_saver.staging.take_back(replaced.tensors)

    def step_passed(self) -> None:
        """The guard accepted a step: a checkpoint saved after the previous one is trusted now."""
        self.retention.step_passed()

    def finish(self, step: int, log) -> list[Saved]:
        """The end of the run: an async save in flight is waited for and committed (a failure
        raises), then the last checkpoint is as trusted as it will get."""
        done = self.settle(step, log, fatal=True)
        self.memory.finish()
        # (every save of the run is committed or dropped by now: settle)
        if self.comm.rank == 0:
            for partial in remove_unfinished(self.root):
                self.say(f"checkpoint: removed {partial.name}, a save a lost rank left unfinished")
        self.retention.end()
        return done

    # -- a rollback (RollbackSource) and the resume check --------------------------------
    def trusted_targets(self, trip: int, log) -> tuple[list[RollbackPoint], RollbackPoint | None]:
        """The guard tripped at step ``trip``: (the trusted rollback targets, newest first; the
        pending checkpoint the trip distrusts, or None). An async save in flight is committed first
        if the step after it passed the guard (it is the newest trusted target then); else it holds
        the bad update's state: its writes are waited for and it is dropped."""
        pending = self.async_saver and self.async_saver.in_flight
        if pending and trip > pending.step + 1:
            self.settle(trip, log, fatal=False)
        elif pending:
            self.async_saver.drop()
            self.say(
                f"checkpoint: dropped the async save of step {pending.step} (step {trip} tripped the guard)"
            )
        return self.retention.distrust()

    def restore(self, point: RollbackPoint) -> None:
        """Return the run to a rollback target: a checkpoint (``Loader.load``) or a state kept in memory."""
        if point.path is not None:
            self.loader.load(point.path, self.model, self.optimizer)
            return
        tensors, rank_state = point.state
        self.optimizer.load_state_shard(tensors, rank_state["optimizer_steps"])
        buffers.restore(tensors, self.buffers)
        rng_state.restore_rng(tensors, rank_state["rng"])
        rng_state.restore_device_rng(tensors, self.optimizer.device)
        self.data.skipped = rank_state.get("skipped_batches", 0)

    def rolled_back_to(self, point: RollbackPoint, rollback: int) -> list[str]:
        """After rollback number ``rollback`` to ``point``: this run's later checkpoints are moved
        aside (their new paths returned), and neither a later memory snapshot nor a later save is
        what a restart or the resume check reloads."""
        set_aside = self.retention.set_aside(point, rollback)
        self.memory.rolled_back(point.step)
        self.verifier.forget_after(point.step)
        return set_aside

    def verify_resume(self, build: Callable[[], tuple[torch.nn.Module, ZeroOptimizer]]) -> ResumeCheck | None:
        """Invariant 4 (``ResumeVerifier.verify``); ``build`` makes a fresh model and optimizer."""
        return self.verifier.verify(build)


def _with_record(state: tuple[dict, dict], record: dict | None) -> tuple[dict, dict]:
    """A snapshot's (tensors, rank_state) with the step's unwritten metrics record beside them."""
    tensors, rank_state = state
    return tensors, {**rank_state, "record": record}
